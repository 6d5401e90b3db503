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
import torch

from ..args import FLOAT_DTYPES, ArgValueError, Choice, Float, Output, Tensor, dtype_name
from ..op import Backward, Op

CAST_MODES = ("hf", "fp32", "none")
MODES = {"hf": 0, "fp32": 1, "none": 2}  # the codes the cpu and pypto kernels take for a cast mode


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

RMS_NORM = Op(rms_norm, [
    Tensor("x", "*R D", FLOAT_DTYPES, case="hidden_states"),
    Tensor("gamma", "D", case="weight", **GAMMA),
    Float("eps", default=1e-6, low=0.0),
    Choice("cast_mode", CAST_MODES, default="hf", kw_only=True),
], [Output("y", case="output")], min_dims={"D": 1},
    backward=Backward(("x", "gamma", "eps", "cast_mode"), _rms_norm_grads), examples=EXAMPLES)

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
              {"R": (5,), "D": 96, "dtype": torch.float16, "cast_mode": "fp32", "norm_input": "fp32_sum"}))


def gamma_not_float(gamma):
    """Why a kernel cannot read this gamma (None if it can): the kernels read fp16, bf16 or fp32 weights, HF accepts
    any float weight (fp64 runs on torch)."""
    if gamma is not None and gamma.dtype not in FLOAT_DTYPES:
        return f"gamma dtype {dtype_name(gamma.dtype)} not supported"
    return None
