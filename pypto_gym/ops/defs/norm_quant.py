"""rms_norm_dynamic_quant and add_rms_norm_dynamic_quant (SPEC 2.3, 2.4): RMSNorm + per-row int8/int4;
rms_norm_quant and add_rms_norm_quant (SPEC 15): RMSNorm + static per-tensor int8.

fp32 math: n = f32(x) / rms(f32(x)) * f32(gamma) (+ f32(beta)); with a smooth scale n = n * f32(smooth);
scale = row_max(|n|) / qmax (fp32, shape x.shape[:-1]); y = clamp(round(n / scale), qmin, qmax), round
half to even. int8: qmax 127, qmin -128; int4: 7, -8, one value per int8 element. A row whose max is
0 gives scale 0 and codes 0 (no NaN). The add form is aclnnAddRmsNormDynamicQuant: x_out = x1 + x2
in the input dtype, n from f32(x_out), branch k uses smooth_scale_k; without smooth_scale2 the second
branch's outputs are None. Quantised outputs have no gradient.
"""
import torch

from ..args import FLOAT_DTYPES, ArgValueError, Choice, Float, Output, Tensor, dtype_name
from ..backends.npu import as_rows, quant_limits
from ..backends.pypto_backend import first_runs_here, rows, vector
from ..op import Op
from ..quantize import DST_TYPES, QUANT_RANGES, quantize_rows, quantize_static, unpack_int4_from_int32


def normalise(x, gamma, beta, eps):
    D = x.shape[-1]
    xf = x.to(torch.float32)
    rms = torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    n = xf / rms * gamma.reshape(D).to(torch.float32)
    if beta is not None:
        n = n + beta.reshape(D).to(torch.float32)
    return n


def rms_norm_dynamic_quant(x, gamma, smooth_scales=None, beta=None, eps=1e-6, dst_type="int8"):
    """RMSNorm (+beta, *smooth) then per-row symmetric int8/int4 quantisation -> (y, scale). No gradient."""
    n = normalise(x, gamma, beta, eps)
    if smooth_scales is not None:
        n = n * smooth_scales.reshape(x.shape[-1]).to(torch.float32)
    return quantize_rows(n, dst_type)


def add_rms_norm_dynamic_quant(x1, x2, gamma, smooth_scale1=None, smooth_scale2=None, beta=None, eps=1e-6,
                               dst_type="int8"):
    """aclnnAddRmsNormDynamicQuant: -> (y1, y2, x_out, scale1, scale2); y2/scale2 None without smooth_scale2."""
    x_out = x1 + x2
    n = normalise(x_out, gamma, beta, eps)
    D = x_out.shape[-1]
    b1 = n if smooth_scale1 is None else n * smooth_scale1.reshape(D).to(torch.float32)
    y1, s1 = quantize_rows(b1, dst_type)
    if smooth_scale2 is None:
        return y1, None, x_out, s1, None
    y2, s2 = quantize_rows(n * smooth_scale2.reshape(D).to(torch.float32), dst_type)
    return y1, y2, x_out, s1, s2


def rms_norm_quant(x, gamma, scale, offset=None, beta=None, eps=1e-6):
    """RMSNorm (+beta) in fp32 then static per-tensor int8 under `scale` and `offset` -> y int8. No gradient."""
    return quantize_static(normalise(x, gamma, beta, eps), scale, offset)


def add_rms_norm_quant(x1, x2, gamma, scale, offset=None, beta=None, eps=1e-6):
    """aclnnAddRmsNormQuant: x_out = x1 + x2 (input dtype), y = rms_norm_quant of x_out -> (y, x_out)."""
    x_out = x1 + x2
    return quantize_static(normalise(x_out, gamma, beta, eps), scale, offset), x_out


def _second_needs_first(ctx, *args):
    if ctx.values.get("smooth_scale2") is not None and ctx.values.get("smooth_scale1") is None:
        raise ArgValueError("smooth_scale2", "given without smooth_scale1; expected smooth_scale1 too (or neither)",
                            "value")


def _vector(name, like, gen, optional=True, **kw):
    return Tensor(name, "D", None, like=like, optional=optional, flat=True, gen=gen, **kw)


# examples name arguments of either op; an op ignores the names it does not have
EXAMPLES = ({"R": (3, 5), "D": 33}, {"R": (4,), "D": 2049, "dst_type": "int4"},
            {"R": (2,), "D": 64, "dtype": torch.float16, "beta": None},
            {"R": (3,), "D": 8, "smooth_scales": None, "smooth_scale1": None, "smooth_scale2": None})
EPS = Float("eps", default=1e-6, low=0.0, low_open=True)
DST_TYPE = Choice("dst_type", DST_TYPES, default="int8", kw_only=True)

def _static_scale(shape, gen):  # a norm's output spans about +-4: 255 steps of 0.02-0.04 hold it
    return 0.02 + 0.02 * torch.rand(shape, generator=gen)


def _static_offset(shape, gen):  # an asymmetric range's integer zero point
    return torch.randint(-16, 17, shape, generator=gen).to(torch.float32)


# the static scale and offset: one value each (any float dtype; the offset also int8), read as fp32
STATIC_SCALE = Tensor("scale", "1", floats=True, flat=True, gen=_static_scale)
STATIC_OFFSET = Tensor("offset", "1", (torch.int8, *FLOAT_DTYPES), optional=True, flat=True, gen=_static_offset)

RMS_NORM_DYNAMIC_QUANT = Op(rms_norm_dynamic_quant, [
    Tensor("x", "*R D", case="hidden_states"),
    _vector("gamma", "x", "weight", optional=False, case="weight"),
    _vector("smooth_scales", "x", "smooth", case="smooth_scale1"),
    _vector("beta", "x", "small"),
    EPS, DST_TYPE,
], [Output("y", "codes"), Output("scale", "scale")], min_dims={"D": 1}, examples=EXAMPLES)

ADD_RMS_NORM_DYNAMIC_QUANT = Op(add_rms_norm_dynamic_quant, [
    Tensor("x1", "*R D"),
    Tensor("x2", "*R D", None, like="x1"),
    _vector("gamma", "x1", "weight", optional=False),
    _vector("smooth_scale1", "x1", "smooth"),
    _vector("smooth_scale2", "x1", "smooth"),
    _vector("beta", "x1", "small"),
    EPS, DST_TYPE,
], [Output("y1", "codes"), Output("y2", "codes", present_if="smooth_scale2"), Output("x_out"),
    Output("scale1", "scale"), Output("scale2", "scale", present_if="smooth_scale2")],
    check=_second_needs_first, min_dims={"D": 1}, examples=EXAMPLES)

STATIC_EXAMPLES = ({"R": (3, 5), "D": 33}, {"R": (4,), "D": 2049, "offset": None},
                   {"R": (2,), "D": 64, "dtype": torch.float16, "beta": None},
                   {"R": (7,), "D": 8, "dtype": torch.float32})

RMS_NORM_QUANT = Op(rms_norm_quant, [
    Tensor("x", "*R D", case="hidden_states"),
    _vector("gamma", "x", "weight", optional=False, case="weight"),
    STATIC_SCALE, STATIC_OFFSET,
    _vector("beta", "x", "small"),
    EPS,
], [Output("y", "codes")], min_dims={"D": 1}, examples=STATIC_EXAMPLES)

ADD_RMS_NORM_QUANT = Op(add_rms_norm_quant, [
    Tensor("x1", "*R D"),
    Tensor("x2", "*R D", None, like="x1"),
    _vector("gamma", "x1", "weight", optional=False),
    STATIC_SCALE, STATIC_OFFSET,
    _vector("beta", "x1", "small"),
    EPS,
], [Output("y", "codes"), Output("x_out")], min_dims={"D": 1}, examples=STATIC_EXAMPLES)


# ---- cpu: fused C++ (norm_quant.cpp) ---------------------------------------------------------------
@RMS_NORM_DYNAMIC_QUANT.impl("cpu")
def _(backend, x, gamma, smooth_scales, beta, eps, dst_type):
    y, _, _, scale, _ = backend.ext.quant(x, None, gamma, smooth_scales, None, beta, eps, *QUANT_RANGES[dst_type])
    return y, scale


@ADD_RMS_NORM_DYNAMIC_QUANT.impl("cpu")
def _(backend, x1, x2, gamma, smooth_scale1, smooth_scale2, beta, eps, dst_type):
    return tuple(backend.ext.quant(x1, x2, gamma, smooth_scale1, smooth_scale2, beta, eps, *QUANT_RANGES[dst_type]))


def static_scalars(scale, offset) -> tuple:
    """The static scale and offset as the fp32 values the golden computes with (one host read each)."""
    return float(scale.reshape(()).to(torch.float32)), 0.0 if offset is None else float(offset.reshape(()).float())


@RMS_NORM_QUANT.impl("cpu")
def _(backend, x, gamma, scale, offset, beta, eps):
    return backend.ext.quant_static(x, None, gamma, beta, eps, *static_scalars(scale, offset))[0]


@ADD_RMS_NORM_QUANT.impl("cpu")
def _(backend, x1, x2, gamma, scale, offset, beta, eps):
    return tuple(backend.ext.quant_static(x1, x2, gamma, beta, eps, *static_scalars(scale, offset)))


# ---- npu: torch_npu.npu_add_rms_norm_dynamic_quant --------------------------------------------------
# npu_add_rms_norm_dynamic_quant(x1, x2, gamma, *, smooth_scale1, smooth_scale2, beta, epsilon,
# output_mask, y_dtype) -> (y1, y2, x_out, scale1, scale2): 2-8 dims, no empty tensors, fp16/bf16, A2/A3
# chips; output_mask=[True, two] asks for the second branch only with a second smooth scale; int4 is
# y_dtype=torch.quint4x2 (eight codes per int32, D % 8 == 0). rms_norm_dynamic_quant is the same op with
# x2 = 0 (x + 0 == x exactly), which keeps SPEC 2.3's fp32 math.
NAME = "npu_add_rms_norm_dynamic_quant"


def _npu_supports(backend, x, *rest):
    dst_type = rest[-1]
    if x.dim() > 8:
        return f"rank {x.dim()} > 8"
    return quant_limits(NAME, x, dst_type, backend)


def _npu_add_quant(backend, x1, x2, gamma, smooth_scale1, smooth_scale2, beta, eps, dst_type):
    D = x1.shape[-1]
    vec = (lambda t: None if t is None else t.reshape(D))  # noqa: E731
    two = smooth_scale2 is not None
    # keywords a torch_npu release may lack (beta, y_dtype) only where the call needs them (npu.py: NEWER_KEYWORDS)
    optional = {"beta": vec(beta)} if beta is not None else {}
    if dst_type == "int4":
        optional["y_dtype"] = torch.quint4x2
    y1, y2, x_out, s1, s2 = backend.torch_npu().npu_add_rms_norm_dynamic_quant(
        as_rows(x1), as_rows(x2), gamma.reshape(D), smooth_scale1=vec(smooth_scale1),
        smooth_scale2=vec(smooth_scale2), epsilon=eps, output_mask=[True, two], **optional)
    if dst_type == "int4":  # eight codes per int32 -> one code per int8
        y1 = unpack_int4_from_int32(y1)
        y2 = unpack_int4_from_int32(y2) if two else y2
    shape, row_shape = x1.shape, x1.shape[:-1]
    return (y1.reshape(shape), y2.reshape(shape) if two else None, x_out.reshape(shape), s1.reshape(row_shape),
            s2.reshape(row_shape) if two else None)


@RMS_NORM_DYNAMIC_QUANT.impl("npu", supports=_npu_supports)
def _(backend, x, gamma, smooth_scales, beta, eps, dst_type):
    y1, _, _, s1, _ = _npu_add_quant(backend, x, torch.zeros_like(x), gamma, smooth_scales, None, beta, eps, dst_type)
    return y1, s1


ADD_RMS_NORM_DYNAMIC_QUANT.impl("npu", supports=_npu_supports)(_npu_add_quant)


# ---- pypto ------------------------------------------------------------------------------------------
def quant_kernel(pypto):
    from ..backends import pypto_lib as pl

    def rms_norm_dynamic_quant(x: pypto.Tensor(), g: pypto.Tensor(), smooth: pypto.Tensor(), beta: pypto.Tensor(),
                               y: pypto.Tensor(), scale: pypto.Tensor(), eps, inv_d, qmax, qmin, rows, cols):
        pypto.set_vec_tile_shapes(rows, cols)
        q, s = pl.quantise(pl.quant_input(x, g, beta, eps, inv_d) * pl.f32(smooth), qmax, qmin)
        y[:] = q
        scale[:] = s
    return rms_norm_dynamic_quant


def add_quant_kernel(pypto):
    from ..backends import pypto_lib as pl

    def add_rms_norm_dynamic_quant(x1: pypto.Tensor(), x2: pypto.Tensor(), g: pypto.Tensor(), smooth: pypto.Tensor(),
                                   beta: pypto.Tensor(), y: pypto.Tensor(), x_out: pypto.Tensor(),
                                   scale: pypto.Tensor(), eps, inv_d, qmax, qmin, rows, cols):
        pypto.set_vec_tile_shapes(rows, cols)
        s = pypto.add(x1, x2)
        q, sc = pl.quantise(pl.quant_input(s, g, beta, eps, inv_d) * pl.f32(smooth), qmax, qmin)
        y[:] = q
        x_out[:] = s
        scale[:] = sc
    return add_rms_norm_dynamic_quant


def add_quant2_kernel(pypto):
    from ..backends import pypto_lib as pl

    def add_rms_norm_dynamic_quant2(x1: pypto.Tensor(), x2: pypto.Tensor(), g: pypto.Tensor(),
                                    smooth1: pypto.Tensor(), smooth2: pypto.Tensor(), beta: pypto.Tensor(),
                                    y1: pypto.Tensor(), y2: pypto.Tensor(), x_out: pypto.Tensor(),
                                    scale1: pypto.Tensor(), scale2: pypto.Tensor(), eps, inv_d, qmax, qmin, rows,
                                    cols):
        pypto.set_vec_tile_shapes(rows, cols)
        s = pypto.add(x1, x2)
        n = pl.quant_input(s, g, beta, eps, inv_d)
        q1, sc1 = pl.quantise(n * pl.f32(smooth1), qmax, qmin)
        q2, sc2 = pl.quantise(n * pl.f32(smooth2), qmax, qmin)
        y1[:] = q1
        y2[:] = q2
        x_out[:] = s
        scale1[:] = sc1
        scale2[:] = sc2
    return add_rms_norm_dynamic_quant2


@RMS_NORM_DYNAMIC_QUANT.impl("pypto", supports=first_runs_here)
def _(backend, x, gamma, smooth_scales, beta, eps, dst_type):
    y, scale = RMS_NORM_DYNAMIC_QUANT.empty_outputs(x, gamma, smooth_scales, beta, eps, dst_type)
    if x.numel():
        D = x.shape[-1]
        backend.launch("rms_norm_dynamic_quant", quant_kernel, x,
                       [rows(x), vector(gamma, D, x, 1.0), vector(smooth_scales, D, x, 1.0), vector(beta, D, x, 0.0)],
                       [y.view(-1, D), scale.view(-1, 1)], [float(eps), 1.0 / D, *QUANT_RANGES[dst_type]], align=32)
    return y, scale


@ADD_RMS_NORM_DYNAMIC_QUANT.impl("pypto", supports=first_runs_here)
def _(backend, x1, x2, gamma, smooth_scale1, smooth_scale2, beta, eps, dst_type):
    y1, y2, x_out, s1, s2 = ADD_RMS_NORM_DYNAMIC_QUANT.empty_outputs(x1, x2, gamma, smooth_scale1, smooth_scale2, beta,
                                                                     eps, dst_type)
    if x1.numel():
        D = x1.shape[-1]
        vectors = [vector(gamma, D, x1, 1.0), vector(smooth_scale1, D, x1, 1.0)]
        scalars = [float(eps), 1.0 / D, *QUANT_RANGES[dst_type]]
        if smooth_scale2 is not None:
            vectors.append(vector(smooth_scale2, D, x1, 1.0))
            backend.launch("add_rms_norm_dynamic_quant2", add_quant2_kernel, x1,
                           [rows(x1), rows(x2), *vectors, vector(beta, D, x1, 0.0)],
                           [y1.view(-1, D), y2.view(-1, D), x_out.view(-1, D), s1.view(-1, 1), s2.view(-1, 1)],
                           scalars, align=32)
        else:
            backend.launch("add_rms_norm_dynamic_quant", add_quant_kernel, x1,
                           [rows(x1), rows(x2), *vectors, vector(beta, D, x1, 0.0)],
                           [y1.view(-1, D), x_out.view(-1, D), s1.view(-1, 1)], scalars, align=32)
    return y1, y2, x_out, s1, s2



# ---- npu: torch_npu.npu_add_rms_norm_quant -----------------------------------------------------------
# npu_add_rms_norm_quant(x1, x2, gamma, scales1, zero_points1, beta, scales2, zero_points2, *, axis=-1, epsilon,
# div_mode=True) -> (y1, y2, x_out): x = x1 + x2, y1 = round(rms_norm(x) * gamma (+ beta) / scales1 + zero_points1)
# with div_mode=True (our rule); scales2 must be None; 1-8 dims, no empty tensors, fp16 (bf16 on A2/A3). The scale
# and offset go in repeated to D (as vllm-ascend passes them: aclnn_input_scale, aclnn_input_offset) in the dtypes of
# the page's table (torch_npu-npu_add_rms_norm_quant.md, 各产品型号支持数据类型说明): fp16 x takes float32 scales and
# int32 zero points, bf16 x bfloat16 for both; a scale or offset those dtypes do not hold exactly is declined, never
# rounded. rms_norm_quant is the same op with x2 = 0 (x + 0 == x exactly).
STATIC_NAME = "npu_add_rms_norm_quant"
# (scales, zero points) dtypes per x dtype: the norm op's table; npu_quantize with div_mode=True takes float32 scales
# and int32 zero points on every chip series (torch_npu-npu_quantize.md; bfloat16 scales only on A2/A3)
STATIC_PARAM_DTYPES = {STATIC_NAME: {torch.float16: (torch.float32, torch.int32),
                                     torch.bfloat16: (torch.bfloat16, torch.bfloat16)},
                       "npu_quantize": {torch.float16: (torch.float32, torch.int32),
                                        torch.bfloat16: (torch.float32, torch.int32)}}


def exact_in(t, dtype) -> bool:
    """Whether `t` holds the same values in `dtype` (int8 codes always do in fp16/bf16/fp32/int32; a float is exact in
    an integer dtype when it is a finite integer in its range)."""
    if t is None or t.dtype in (dtype, torch.int8):
        return True
    if not dtype.is_floating_point and not bool(torch.isfinite(t.float()).all()):
        return False
    return torch.equal(t.to(dtype).to(t.dtype), t)


def npu_static_supports(name, backend, x, scale, offset) -> str | None:
    """The limits torch_npu's static quant ops share (npu_add_rms_norm_quant, npu_quantize), or None."""
    if not x.numel():
        return f"{name}: empty tensors are not supported"
    if x.dim() > 8:
        return f"{name}: rank {x.dim()} > 8"
    if x.dtype not in (torch.float16, torch.bfloat16):
        return f"{name}: dtype {dtype_name(x.dtype)} not supported (float16, bfloat16)"
    if x.dtype == torch.bfloat16 and backend.series_of(x) != "a2_a3":
        return f"{name}: bfloat16 is supported on Atlas A2/A3 chips only"
    if name == STATIC_NAME and backend.series_of(x) != "a2_a3" and x.shape[-1] < 32:
        return f"{name}: last dim {x.shape[-1]} < 32 on {backend.series_of(x)} chips"
    scale_t, zero_t = STATIC_PARAM_DTYPES[name][x.dtype]
    for arg, t, want in (("scale", scale, scale_t), ("offset", offset, zero_t)):
        if not exact_in(t, want):
            return f"{name}: {arg} {dtype_name(t.dtype)} is not exact in the {dtype_name(want)} it takes"
    return None


def npu_static_params(name, x, scale, offset):
    """scale and offset as torch_npu's static quant op `name` takes them: repeated to D, in the dtypes its page
    documents for x's dtype (STATIC_PARAM_DTYPES)."""
    D = x.shape[-1]
    scale_t, zero_t = STATIC_PARAM_DTYPES[name][x.dtype]
    zero = torch.zeros(1, dtype=zero_t, device=x.device) if offset is None else offset
    return scale.reshape(1).to(scale_t).expand(D).contiguous(), zero.reshape(1).to(zero_t).expand(D).contiguous()


def _npu_add_static(backend, x1, x2, gamma, scale, offset, beta, eps):
    scales, zeros = npu_static_params(STATIC_NAME, x1, scale, offset)
    D = x1.shape[-1]
    optional = {} if beta is None else {"beta": beta.reshape(D)}  # beta: a keyword older releases lack
    y, _, x_out = backend.torch_npu().npu_add_rms_norm_quant(
        as_rows(x1), as_rows(x2), gamma.reshape(D), scales, zeros, epsilon=eps, div_mode=True, **optional)
    return y.reshape(x1.shape), x_out.reshape(x1.shape)


@RMS_NORM_QUANT.impl("npu", supports=lambda backend, x, gamma, scale, offset, *rest:
                     npu_static_supports(STATIC_NAME, backend, x, scale, offset))
def _(backend, x, gamma, scale, offset, beta, eps):
    return _npu_add_static(backend, x, torch.zeros_like(x), gamma, scale, offset, beta, eps)[0]


ADD_RMS_NORM_QUANT.impl("npu", supports=lambda backend, x1, x2, gamma, scale, offset, *rest:
                        npu_static_supports(STATIC_NAME, backend, x1, scale, offset))(_npu_add_static)


# ---- pypto: the static scale and offset as [1, D] fp32 rows (what torch_npu's repeat to D is) --------------
def static_rows(scale, offset, D, like):
    """The static scale and offset as [1, D] fp32 kernel inputs: runtime values, one kernel for every scale."""
    zero = torch.zeros(1) if offset is None else offset
    return [t.reshape(1, 1).to(device=like.device, dtype=torch.float32).expand(1, D).contiguous()
            for t in (scale, zero)]


def static_kernel(pypto):
    from ..backends import pypto_lib as pl

    def rms_norm_quant(x: pypto.Tensor(), g: pypto.Tensor(), beta: pypto.Tensor(), scale: pypto.Tensor(),
                       offset: pypto.Tensor(), y: pypto.Tensor(), eps, inv_d, rows, cols):
        pypto.set_vec_tile_shapes(rows, cols)
        y[:] = pl.quantise_static(pl.quant_input(x, g, beta, eps, inv_d), scale, offset)
    return rms_norm_quant


def add_static_kernel(pypto):
    from ..backends import pypto_lib as pl

    def add_rms_norm_quant(x1: pypto.Tensor(), x2: pypto.Tensor(), g: pypto.Tensor(), beta: pypto.Tensor(),
                           scale: pypto.Tensor(), offset: pypto.Tensor(), y: pypto.Tensor(), x_out: pypto.Tensor(),
                           eps, inv_d, rows, cols):
        pypto.set_vec_tile_shapes(rows, cols)
        s = pypto.add(x1, x2)
        y[:] = pl.quantise_static(pl.quant_input(s, g, beta, eps, inv_d), scale, offset)
        x_out[:] = s
    return add_rms_norm_quant


@RMS_NORM_QUANT.impl("pypto", supports=first_runs_here)
def _(backend, x, gamma, scale, offset, beta, eps):
    y = RMS_NORM_QUANT.empty_outputs(x, gamma, scale, offset, beta, eps)
    if x.numel():
        D = x.shape[-1]
        backend.launch("rms_norm_quant", static_kernel, x,
                       [rows(x), vector(gamma, D, x, 1.0), vector(beta, D, x, 0.0), *static_rows(scale, offset, D, x)],
                       [y.view(-1, D)], [float(eps), 1.0 / D], align=32)
    return y


@ADD_RMS_NORM_QUANT.impl("pypto", supports=first_runs_here)
def _(backend, x1, x2, gamma, scale, offset, beta, eps):
    y, x_out = ADD_RMS_NORM_QUANT.empty_outputs(x1, x2, gamma, scale, offset, beta, eps)
    if x1.numel():
        D = x1.shape[-1]
        backend.launch("add_rms_norm_quant", add_static_kernel, x1,
                       [rows(x1), rows(x2), vector(gamma, D, x1, 1.0), vector(beta, D, x1, 0.0),
                        *static_rows(scale, offset, D, x1)],
                       [y.view(-1, D), x_out.view(-1, D)], [float(eps), 1.0 / D], align=32)
    return y, x_out
