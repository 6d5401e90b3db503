"""Helpers for PyPTO kernel bodies, shared by the op definitions' kernels (imported only to build one).

PyPTO's frontend inlines these calls into the kernel it traces. The norm math follows each op's
golden: `norm` is SPEC 2.1 in each cast mode, `quantise` the per-row symmetric quantisation.
"""
import pypto

FP32 = pypto.DT_FP32
HF, FP32_MODE, NO_CAST = 0, 1, 2  # the norm ops' cast modes, as compile-time constants
CAST_MODES = {"hf": HF, "fp32": FP32_MODE, "none": NO_CAST}


def f32(t):
    return pypto.cast(t, FP32)


def to(t, dtype):
    return t if dtype == FP32 else pypto.cast(t, dtype)


def norm(x, g, out_dtype, eps, inv_d, mode):
    """SPEC 2.1 in the given cast mode (defs/rms_norm.py writes the same formulas in torch)."""
    if mode == NO_CAST:  # reference 000's no-cast path: the input dtype throughout
        rms = pypto.sqrt(pypto.sum(x * x * inv_d, -1, keepdim=True) + eps)
        return x / rms * g
    xf = f32(x)
    n = xf * pypto.rsqrt(pypto.sum(xf * xf * inv_d, -1, keepdim=True) + eps)
    if mode == HF:  # HF casts x * r to x's dtype before the weight; the product is in the output dtype
        nc = f32(pypto.cast(n, x.dtype)) if x.dtype != FP32 else n
        return to(nc * f32(g), out_dtype)
    return to(n * f32(g), out_dtype)


def quantise(n, qmax, qmin):
    """Per-row scale = max|n| / qmax (0 for a zero row); codes = clip(round(n / scale)), as int8.
    Quantised values are rounded in fp32 before the integer cast (via fp16, exact for |q| <= 128)."""
    s = pypto.amax(pypto.abs(n), -1, keepdim=True) * (1.0 / qmax)
    safe = pypto.where(pypto.eq(s, 0.0), 1.0, s)
    q = pypto.clip(pypto.round(n / safe), qmin, qmax)
    return pypto.cast(pypto.cast(q, pypto.DT_FP16), pypto.DT_INT8), s


def quant_input(x, g, beta, eps, inv_d):
    """The quant ops' fp32 normalisation: x / rms(x) * gamma + beta (SPEC 2.3)."""
    xf = f32(x)
    rms = pypto.sqrt(pypto.sum(xf * xf * inv_d, -1, keepdim=True) + eps)
    return xf / rms * f32(g) + f32(beta)
