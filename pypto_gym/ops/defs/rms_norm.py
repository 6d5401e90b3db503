"""rms_norm and add_rms_norm (SPEC 2.1, 2.2): the norm HF models run, and the residual add fused into it.

Notation: x is [..., D]; rows are all leading dims; rms(v) = sqrt(mean(v^2 over the last dim) + eps).

- `hf` (HF Llama/Qwen, the default for patched models): y = gamma * (f32(x) * rsqrt(mean(f32(x)^2)
  + eps)).to(x.dtype); the output dtype is the promotion of gamma's and x's (an fp32 gamma with bf16
  x gives fp32, exactly as HF does). Bit-identical to `Qwen2_5_VLRMSNorm.forward` on `torch`.
- `fp32` (PyPTO's rms_norm_fp32_cast, aclnn): everything in fp32, gamma
  multiplied in fp32, one final cast to x's dtype.
- `none` (the pypto.rms_norm guide's path for chips without the fp32 cast): every step in x's dtype.

add_rms_norm: x_out = x1 + x2 in the input dtype (rounded exactly as torch's add), y = rms_norm(x_out);
what the norm reads is `norm_input`:
- `rounded` (SPEC 2.2, the default): the rounded x_out, so a fused decoder layer is bit-identical to HF's
  unfused one (`residual + h`, then the norm module);
- `fp32_sum`: the fp32 sum before it is rounded (vLLM's native `fused_add_rms_norm`: it adds in fp32, rounds
  the residual once and normalises the unrounded sum; `hf` then rounds x * r to the input dtype before the
  weight). The two agree wherever the sum is exact in the input dtype (always in fp32).
"""
import functools

import torch

from ..args import FLOAT_DTYPES, ArgValueError, Choice, Float, Output, Tensor, dtype_name
from ..backends.npu import as_rows
from ..backends.pypto_backend import rows, vector
from ..op import Backward, BenchSpec, Op

CAST_MODES = ("hf", "fp32", "none")
MODES = {"hf": 0, "fp32": 1, "none": 2}  # the C++ kernels' codes


def rms_norm(x, gamma=None, eps=1e-6, cast_mode="hf"):
    """y = gamma * (x / rms(x)); `hf` casts before the weight (HF Qwen/Llama, vLLM's native rms_norm), `fp32`
    after (aclnn), `none` computes in x's dtype throughout."""
    g = None if gamma is None else gamma.reshape(x.shape[-1])
    if cast_mode == "none":
        return _rms_norm_no_cast(x, g, eps)
    return _norm_fp32(x.to(torch.float32), x.dtype, g, eps, cast_mode)


def _norm_fp32(h, dtype, g, eps, cast_mode):
    """The `hf` / `fp32` norm of h (fp32), rounding to `dtype`: x's own, or the inputs' when h is add_rms_norm's
    fp32 sum. `hf` is the exact op sequence of transformers' Qwen2_5_VLRMSNorm.forward."""
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    if cast_mode == "hf":
        h = h.to(dtype)
        return h if g is None else g * h
    if g is not None:
        h = h * g.to(torch.float32)
    return h.to(dtype)


def _rms_norm_no_cast(x, g, eps):
    """The no-cast path: every step's result rounded to x's dtype T, each step evaluated as one fp32
    operation (as the vector units do); the sum of squares accumulates exactly:
    var = T(sum(T(x*x)) / D); r = T(1 / fp32(sqrt(T(var + eps)))); y = T(T(g) * T(x * r)).
    Each step is computed in float64 and rounded explicitly, because torch's own low-precision ops
    round differently in their vectorised body and scalar tail (bf16 rsqrt) and its fp32 sqrt is
    not always correctly rounded: the golden must not depend on the row length."""
    T, f32, f64 = x.dtype, torch.float32, torch.float64

    def rnd(t):  # an exact (float64) result, rounded as an fp32 operation then a cast to T would round it
        return t.to(f32).to(T).to(f64)

    xd = x.to(f64)
    var = rnd(rnd(xd * xd).sum(-1, keepdim=True) / x.shape[-1])
    r = rnd(1.0 / torch.sqrt(rnd(var + torch.tensor(eps, dtype=f32, device=x.device).to(f64))).to(f32).to(f64))
    h = rnd(xd * r)
    return h.to(T) if g is None else (rnd(g.to(f64)) * h).to(f32).to(T)


NORM_INPUTS = ("rounded", "fp32_sum")


def add_rms_norm(x1, x2, gamma, eps=1e-6, cast_mode="hf", norm_input="rounded"):
    """(rms_norm(x1 + x2), x1 + x2): the residual add fused into the norm; x_out is the next residual. The norm
    reads the rounded x_out (`rounded`, HF's layer) or the fp32 sum before its rounding (`fp32_sum`, vLLM's)."""
    x_out = x1 + x2
    if norm_input == "rounded" or x1.dtype == torch.float32:
        return rms_norm(x_out, gamma, eps, cast_mode), x_out
    s = x1.to(torch.float32) + x2.to(torch.float32)  # torch's 16-bit add rounds this same sum: x_out
    g = None if gamma is None else gamma.reshape(x1.shape[-1])
    return _norm_fp32(s, x1.dtype, g, eps, cast_mode), x_out


def _check_add_rms_norm(ctx, x1, x2, gamma, eps, cast_mode, norm_input):
    if norm_input == "fp32_sum" and cast_mode == "none":
        raise ArgValueError("norm_input", "'fp32_sum' with cast_mode 'none'; expected 'rounded' (the no-cast path "
                                          "computes in the input dtype, there is no fp32 sum)", "value")


def norm_backward(gy, x, gamma, eps, cast_mode):
    """Gradients of rms_norm w.r.t. x and gamma, following the casts autograd sees in HF's module."""
    D = x.shape[-1]
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    n = xf * r
    g = None if gamma is None else gamma.reshape(D)
    grad_g = None
    if cast_mode == "hf":
        nc = n.to(x.dtype)
        gn = (gy if g is None else gy * g).to(x.dtype).float()
        if g is not None:
            grad_g = (gy * nc).reshape(-1, D).sum(0)
    else:
        gyf = gy.float()
        gn = gyf if g is None else gyf * g.float()
        if g is not None:
            grad_g = (gyf * n).reshape(-1, D).sum(0)
    grad_x = r * (gn - n * (gn * n).mean(-1, keepdim=True))
    if grad_g is not None:
        grad_g = grad_g.to(gamma.dtype).reshape(gamma.shape)
    return grad_x.to(x.dtype), grad_g


def _rms_norm_grads(saved, grads):
    gx, gg = norm_backward(grads[0], saved["x"], saved["gamma"], saved["eps"], saved["cast_mode"])
    return {"x": gx, "gamma": gg}


def _add_rms_norm_grads(saved, grads):
    """The norm's gradient at x_out (for `fp32_sum`, at the sum's rounding: within its ulp)."""
    gy, gx_out = grads
    gx, gg = norm_backward(gy, saved["x_out"], saved["gamma"], saved["eps"], saved["cast_mode"])
    total = gx if gx_out is None else gx + gx_out
    return {"x1": total, "x2": total, "gamma": gg}


GAMMA = dict(floats=True, optional=True, flat=True, gen="weight")
EXAMPLES = ({"R": (2, 5), "D": 64}, {"R": (7,), "D": 2049, "cast_mode": "fp32"}, {"R": (3,), "D": 33, "gamma": None},
            {"R": (2, 3), "D": 40, "dtype": torch.float16, "cast_mode": "none"})

# ---- bench ops: GutenOCR-3B's norms (text hidden 2048, vision 1280) against HF's module ------------------
def _norm_shapes(quick, dtype, two=False):
    tokens = [64, 512, 4096] if quick else [64, 256, 512, 1024, 2048, 4096]
    shapes = [("decode", (1, 1, 2048))] + [("prefill", (1, s, 2048)) for s in tokens]
    shapes += [("vision", (t, 1280)) for t in ([3744] if quick else [1024, 3744])]
    gen = torch.Generator().manual_seed(0)
    out = []
    for phase, shape in shapes:
        xs = [torch.randn(shape, generator=gen).to(dtype) for _ in range(2 if two else 1)]
        gamma = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
        out.append((phase, xs[0].numel() // shape[-1], (*xs, gamma, 1e-6, "hf", *(["rounded"] if two else []))))
    return out


def hf_norm_module(gamma, eps):
    """HF's own RMSNorm module (Qwen2.5-VL's) with this weight."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRMSNorm

    m = Qwen2_5_VLRMSNorm(gamma.shape[0], eps=eps).to(gamma.dtype)
    m.weight.data = gamma
    return m


def _hf_rms_norm(args):
    m = hf_norm_module(args[1], args[2])
    return lambda: m(args[0])


def _hf_add_rms_norm(args):
    """The decoder layer's `residual + h`, then HF's norm."""
    m = hf_norm_module(args[2], args[3])

    def run():
        s = args[0] + args[1]
        return m(s), s
    return run


def _unfused_add_rms_norm(args, backend):
    """The add in torch, then the norm's own kernel: what the fused op saves."""
    x1, x2, gamma, eps, cast_mode = args[:5]
    return lambda: RMS_NORM.call((x1 + x2, gamma, eps, cast_mode), backend, None)


NORM_GOALS = {"vs_compile": 1.5, "floor": 1.5, "min_tokens": 512}


def hf_norm_kernels(x, gamma, prefix=""):
    """HF's RMSNorm forward, kernel by kernel: to(fp32), pow(2), mean(-1), + eps, rsqrt, mul, to(dtype), weight * h."""
    x = x.reshape(-1, x.shape[-1])
    R, D = x.shape
    gamma = torch.ones(D) if gamma is None else gamma
    h, v = torch.zeros(R, D), torch.zeros(R, 1)
    return [(f"{prefix}x.to(float32)", "cast", [x], (R, D), torch.float32, ()),
            (f"{prefix}h.pow(2)", "mul", [h, h], (R, D), torch.float32, ()),
            (f"{prefix}.mean(-1)", "mean", [h], (R, 1), torch.float32, (1.0 / D,)),
            (f"{prefix}variance + eps", "add_scalar", [v], (R, 1), torch.float32, (1e-6,)),
            (f"{prefix}torch.rsqrt", "rsqrt", [v], (R, 1), torch.float32, ()),
            (f"{prefix}h * rsqrt", "mul", [h, v], (R, D), torch.float32, ()),
            (f"{prefix}.to(dtype)", "cast", [h], (R, D), x.dtype, ()),
            (f"{prefix}weight * h", "mul", [x, gamma.reshape(1, D)], (R, D), x.dtype, ())]


def _hf_add_norm_kernels(args):
    x1, x2, gamma = (a.reshape(-1, a.shape[-1]) if a is not None else None for a in args[:3])
    return [("residual + hidden", "add", [x1, x2], x1.shape, x1.dtype, ()), *hf_norm_kernels(x1, gamma)]

RMS_NORM = Op(rms_norm, [
    Tensor("x", "*R D", FLOAT_DTYPES, case="hidden_states"),
    Tensor("gamma", "D", case="weight", **GAMMA),
    Float("eps", default=1e-6, low=0.0),
    Choice("cast_mode", CAST_MODES, default="hf", kw_only=True),
], [Output("y", case="output")], min_dims={"D": 1},
    backward=Backward(("x", "gamma", "eps", "cast_mode"), _rms_norm_grads), examples=EXAMPLES,
    bench=BenchSpec(_norm_shapes, _hf_rms_norm, lambda a: a[0].clone, "clone()", NORM_GOALS,
                    hf_kernels=lambda a: hf_norm_kernels(a[0], a[1])))

ADD_RMS_NORM = Op(add_rms_norm, [
    Tensor("x1", "*R D", FLOAT_DTYPES),
    Tensor("x2", "*R D", None, like="x1"),
    Tensor("gamma", "D", **GAMMA),
    Float("eps", default=1e-6, low=0.0),
    Choice("cast_mode", CAST_MODES, default="hf", kw_only=True),
    Choice("norm_input", NORM_INPUTS, default="rounded", kw_only=True),
], [Output("y"), Output("x_out")], min_dims={"D": 1}, check=_check_add_rms_norm,
    backward=Backward(("x_out", "gamma", "eps", "cast_mode"), _add_rms_norm_grads),
    examples=(*EXAMPLES, {"R": (3, 4), "D": 2050, "norm_input": "fp32_sum"},
              {"R": (5,), "D": 96, "dtype": torch.float16, "cast_mode": "fp32", "norm_input": "fp32_sum"}),
    bench=BenchSpec(lambda quick, dtype: _norm_shapes(quick, dtype, two=True), _hf_add_rms_norm,
                    lambda a: (lambda: (a[0].clone(), a[1].clone())), "clone() of x1 and x2", NORM_GOALS,
                    unfused=_unfused_add_rms_norm, hf_kernels=_hf_add_norm_kernels))


def _gamma_float(gamma):
    """The kernels read gamma as fp16, bf16 or fp32 (HF accepts any float weight: fp64 runs on torch)."""
    if gamma is not None and gamma.dtype not in FLOAT_DTYPES:
        return f"gamma dtype {dtype_name(gamma.dtype)} not supported"
    return None


def _norm_gamma(backend, x, gamma, *rest):
    return _gamma_float(gamma)


def _add_norm_gamma(backend, x1, x2, gamma, *rest):
    return _gamma_float(gamma)


# ---- cpu: fused C++ (rms_norm.cpp) ----------------------------------------------------------------
@RMS_NORM.impl("cpu", supports=_norm_gamma)
def _(backend, x, gamma, eps, cast_mode):
    return backend.ext.rms_norm(x, gamma, eps, MODES[cast_mode])


@ADD_RMS_NORM.impl("cpu", supports=_add_norm_gamma)
def _(backend, x1, x2, gamma, eps, cast_mode, norm_input):
    return backend.ext.add_rms_norm(x1, x2, gamma, eps, MODES[cast_mode], norm_input == "fp32_sum")


# ---- npu: torch_npu.npu_rms_norm / npu_add_rms_norm ----------------------------------------------
# npu_rms_norm(self, gamma, epsilon) -> (y, rstd) computes in fp32 and casts once: `fp32`. For `hf`
# (cast before the weight) it normalises with a unit gamma and the real gamma multiplies in torch,
# which also reproduces HF's dtype promotion. Limits as documented: 2-8 dims, (x, gamma) dtype
# pairs per chip series; npu_add_rms_norm: no empty tensors, gamma in x's dtype, no bf16 on Atlas
# inference series chips. Neither has a no-cast path.
RMS_NORM_PAIRS_A2_A3 = {(torch.float16, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
                        (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)}
RMS_NORM_PAIRS_OLDER = {(torch.float16, torch.float16), (torch.float32, torch.float32)}


def _npu_common(x, cast_mode):
    if x.dim() > 8:
        return f"rank {x.dim()} > 8"
    if cast_mode == "none":
        return "cast_mode none: torch_npu's norm kernels always compute in fp32"
    return None


def _npu_rms_norm_supports(backend, x, gamma, eps, cast_mode):
    reason = _npu_common(x, cast_mode)
    if reason:
        return reason
    series = backend.series_of(x)
    pairs = RMS_NORM_PAIRS_A2_A3 if series == "a2_a3" else RMS_NORM_PAIRS_OLDER
    g = x.dtype if gamma is None or cast_mode == "hf" else gamma.dtype  # hf: a unit gamma in x's dtype
    if (x.dtype, g) not in pairs:
        return (f"npu_rms_norm: x {dtype_name(x.dtype)} with gamma {dtype_name(g)} is not a documented pair on {series} "
                f"chips")
    return None


def _npu_add_rms_norm_supports(backend, x1, x2, gamma, eps, cast_mode, norm_input):
    reason = _npu_common(x1, cast_mode)
    if reason:
        return reason
    if not x1.numel():
        return "npu_add_rms_norm: empty tensors are not supported"
    if backend.series_of(x1) == "inference" and x1.dtype == torch.bfloat16:
        return "npu_add_rms_norm: bfloat16 not supported on Atlas inference series chips"
    if cast_mode == "fp32" and gamma is not None and gamma.dtype != x1.dtype:
        return f"npu_add_rms_norm: gamma dtype {dtype_name(gamma.dtype)} must equal x's {dtype_name(x1.dtype)}"
    return None


def _npu_gamma(gamma, x, cast_mode):
    """(gamma for the kernel, gamma to apply afterwards in torch for hf mode)."""
    D = x.shape[-1]
    if cast_mode == "fp32" and gamma is not None:
        return gamma.reshape(D), None  # a documented (x, gamma) pair: supports() checked it
    return unit_gamma(D, x.dtype, x.device), (None if gamma is None else gamma.reshape(D))


@functools.lru_cache(maxsize=64)
def unit_gamma(D: int, dtype, device) -> torch.Tensor:
    """The unit gamma hf mode normalises with, made once per (width, dtype, device): a norm call made one (a host
    allocation and a fill launch) every time, 36 layers x 2 norms a decode step."""
    return torch.ones(D, dtype=dtype, device=device)


@RMS_NORM.impl("npu", supports=_npu_rms_norm_supports)
def _(backend, x, gamma, eps, cast_mode):
    g, post = _npu_gamma(gamma, x, cast_mode)
    y, _ = backend.torch_npu().npu_rms_norm(as_rows(x), g, epsilon=eps)
    y = y.reshape(x.shape)
    return y if post is None else post * y


@ADD_RMS_NORM.impl("npu", supports=_npu_add_rms_norm_supports)
def _(backend, x1, x2, gamma, eps, cast_mode, norm_input):
    tnpu = backend.torch_npu()
    if norm_input == "fp32_sum" and x1.dtype != torch.float32:
        # npu_add_rms_norm's documentation does not say whether it normalises the sum before or after rounding
        # it: the fp32 sum goes through npu_rms_norm (fp32 in, fp32 out: a documented pair) instead
        s = x1.float() + x2.float()
        g, post = _npu_gamma(gamma, s, cast_mode)
        y, _ = tnpu.npu_rms_norm(as_rows(s), g.float(), epsilon=eps)
        y = y.reshape(x1.shape).to(x1.dtype)
        return (y if post is None else post * y), s.to(x1.dtype)
    g, post = _npu_gamma(gamma, x1, cast_mode)
    y, _, x_out = tnpu.npu_add_rms_norm(as_rows(x1), as_rows(x2), g, epsilon=eps)
    y, x_out = y.reshape(x1.shape), x_out.reshape(x1.shape)
    return (y if post is None else post * y), x_out


# ---- pypto: one shape-agnostic JIT kernel per op --------------------------------------------------
def rms_norm_kernel(pypto):
    from ..backends import pypto_lib as pl

    def rms_norm(x: pypto.Tensor(), g: pypto.Tensor(), out: pypto.Tensor(), eps, inv_d, mode, rows, cols):
        pypto.set_vec_tile_shapes(rows, cols)
        out[:] = pl.norm(x, g, out.dtype, eps, inv_d, mode, x.dtype)
    return rms_norm


def add_rms_norm_kernel(pypto):
    from ..backends import pypto_lib as pl

    def add_rms_norm(x1: pypto.Tensor(), x2: pypto.Tensor(), g: pypto.Tensor(), out: pypto.Tensor(),
                     x_out: pypto.Tensor(), eps, inv_d, mode, fp32_sum, rows, cols):
        pypto.set_vec_tile_shapes(rows, cols)
        if fp32_sum == 1:  # the norm reads the fp32 sum, the residual is its rounding (vLLM's)
            s = pypto.add(pl.f32(x1), pl.f32(x2))
            y = pl.norm(s, g, out.dtype, eps, inv_d, mode, x1.dtype)
            out[:] = y
            x_out[:] = pl.to(s, x1.dtype)
        else:
            s = pypto.add(x1, x2)
            y = pl.norm(s, g, out.dtype, eps, inv_d, mode, x1.dtype)
            out[:] = y
            x_out[:] = s
    return add_rms_norm


def _pypto_gamma(gamma, x, cast_mode):
    g = vector(gamma, x.shape[-1], x, 1.0)
    return g.to(x.dtype) if cast_mode == "none" else g  # no-cast: everything in x's dtype


@RMS_NORM.impl("pypto", supports=lambda backend, x, gamma, *rest: backend.runs_on(x) or _gamma_float(gamma))
def _(backend, x, gamma, eps, cast_mode):
    y = RMS_NORM.empty_outputs(x, gamma, eps, cast_mode)
    if x.numel():
        D = x.shape[-1]
        backend.launch("rms_norm", rms_norm_kernel, x, [rows(x), _pypto_gamma(gamma, x, cast_mode)],
                       [y.view(-1, D)], [float(eps), 1.0 / D, MODES[cast_mode]])
    return y


@ADD_RMS_NORM.impl("pypto", supports=lambda backend, x1, x2, gamma, *rest: backend.runs_on(x1) or _gamma_float(gamma))
def _(backend, x1, x2, gamma, eps, cast_mode, norm_input):
    y, x_out = ADD_RMS_NORM.empty_outputs(x1, x2, gamma, eps, cast_mode, norm_input)
    if x1.numel():
        D = x1.shape[-1]
        backend.launch("add_rms_norm", add_rms_norm_kernel, x1,
                       [rows(x1), rows(x2), _pypto_gamma(gamma, x1, cast_mode)], [y.view(-1, D), x_out.view(-1, D)],
                       [float(eps), 1.0 / D, MODES[cast_mode], int(norm_input == "fp32_sum")])
    return y, x_out
