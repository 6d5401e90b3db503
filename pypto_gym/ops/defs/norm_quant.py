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

from ..args import FLOAT_DTYPES, ArgValueError, Choice, Float, Output, Tensor
from ..op import Op
from ..quantize import DST_TYPES, quantize_rows, quantize_static


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
