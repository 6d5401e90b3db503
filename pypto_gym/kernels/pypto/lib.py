"""Helpers for PyPTO kernel bodies, shared by the kernels of kernels/pypto/<op>.py (imported only to build one).

PyPTO's frontend inlines these calls into the kernel it traces (so they import nothing: its parser
takes no imports). The math follows each op's golden: `norm` is SPEC 2.1 in each cast mode,
`quantise` the per-row symmetric quantisation, `gelu` both GELU forms, `rotate` and `merged_angles`
the rotary embedding.
"""
import pypto

FP32 = pypto.DT_FP32
HF, FP32_MODE, NO_CAST = 0, 1, 2  # the norm ops' cast modes, as compile-time constants
CAST_MODES = {"hf": HF, "fp32": FP32_MODE, "none": NO_CAST}


def f32(t):
    return pypto.cast(t, FP32)


def to(t, dtype):
    return t if dtype == FP32 else pypto.cast(t, dtype)


def norm(x, g, out_dtype, eps, inv_d, mode, dtype):
    """SPEC 2.1 in the given cast mode (defs/rms_norm.py writes the same formulas in torch); hf rounds x * r to
    `dtype`: x's own, or the inputs' when x is their fp32 sum (add_rms_norm's fp32_sum)."""
    if mode == NO_CAST:  # reference 000's no-cast path: the input dtype throughout
        rms = pypto.sqrt(pypto.sum(x * x * inv_d, -1, keepdim=True) + eps)
        return x / rms * g
    xf = f32(x)
    n = xf * pypto.rsqrt(pypto.sum(xf * xf * inv_d, -1, keepdim=True) + eps)
    if mode == HF:  # HF casts x * r to x's dtype before the weight; the product is in the output dtype
        nc = f32(pypto.cast(n, dtype)) if dtype != FP32 else n
        return to(nc * f32(g), out_dtype)
    return to(n * f32(g), out_dtype)


def quantise(n, qmax, qmin):
    """Per-row scale = max|n| / qmax (0 for a zero row); codes = clip(round(n / scale)), as int8.
    Quantised values are rounded in fp32 before the integer cast (via fp16, exact for |q| <= 128)."""
    s = pypto.amax(pypto.abs(n), -1, keepdim=True) * (1.0 / qmax)
    safe = pypto.where(pypto.eq(s, 0.0), 1.0, s)
    q = pypto.clip(pypto.round(n / safe), qmin, qmax)
    return pypto.cast(pypto.cast(q, pypto.DT_FP16), pypto.DT_INT8), s


def quantise_static(n, scale, offset):
    """Static per-tensor int8 (ops/quantize.py quantize_static): clip(round(n / scale + offset)), scale and offset
    [1, D] fp32 rows; rounded in fp32 before the integer cast (via fp16, exact for |q| <= 128)."""
    q = pypto.clip(pypto.round(n / scale + offset), -128.0, 127.0)
    return pypto.cast(pypto.cast(q, pypto.DT_FP16), pypto.DT_INT8)


def gelu(x, tanh_form):
    """GELU of an fp32 tile in the form asked. tanh: x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3), which is
    0.5 x (1 + tanh u) exactly in real arithmetic (PyPTO 0.2.0 has sigmoid, no tanh). erf: 0.5 x (1 + erf(x / sqrt 2))
    with erf by Abramowitz-Stegun 7.1.26 from exp (|error| < 1.5e-7, the polynomial torch's CPU kernel uses; PyPTO
    has no erf): erfc(|z|) = (p1 t + ... + p5 t^5) exp(-z^2), t = 1 / (1 + p |z|); by z's sign, not copysign (SIM's
    cost model has no pipe for COPYSIGN)."""
    if tanh_form == 1:
        return x * pypto.sigmoid((x + x * x * x * 0.044715) * 1.5957691216057308)
    z = x * 0.7071067811865476
    t = pypto.reciprocal(pypto.abs(z) * 0.3275911 + 1.0)
    r = (((t * 1.061405429 + -1.453152027) * t + 1.421413741) * t + -0.284496736) * t + 0.254829592
    h = x * 0.5 * (r * t * pypto.exp(pypto.neg(z * z)))  # 0.5 x erfc(|z|)
    return pypto.where(pypto.ge(x, 0.0), x - h, h)  # x - h where erf(z) = 1 - erfc(|z|), else h


def quant_input(x, g, beta, eps, inv_d):
    """The quant ops' fp32 normalisation: x / rms(x) * gamma + beta (SPEC 2.3)."""
    xf = f32(x)
    rms = pypto.sqrt(pypto.sum(xf * xf * inv_d, -1, keepdim=True) + eps)
    return xf / rms * f32(g) + f32(beta)


def head_norm(x, g, eps, inv_d, hf):
    """qk_norm_rope's per-head norm of a [T, H, D] tensor, as fp32: hf rounded to x's dtype as HF's RMSNorm
    returns it, fp32 left unrounded for the rotation."""
    if hf == 1:
        return f32(norm(x, g, x.dtype, eps, inv_d, HF, x.dtype))
    return norm(x, g, FP32, eps, inv_d, FP32_MODE, x.dtype)


def merged_angles(planes, sec_t, sec_h, sec_w):
    """cos or sin as fp32 [T, 1, E]: the one plane of the merged form (sec_h = sec_w = 0), or MRoPE's three
    planes merged: column chunk c of (t, h, w, t, h, w) from plane c % 3."""
    if sec_h == 0 and sec_w == 0:
        return f32(planes[0])
    T = planes[0].shape[0]
    widths = [sec_t, sec_h, sec_w, sec_t, sec_h, sec_w]
    parts = []
    start = 0
    for c in range(6):
        if widths[c] > 0:
            parts.append(pypto.view(planes[c % 3], [T, 1, widths[c]], [0, 0, start]))
        start += widths[c]
    return f32(pypto.concat(parts, 2))


def rotate(x, cos, sin, out_dtype, hf):
    """x * cos + rotate_half(x) * sin on the first E (cos's width) dims of an fp32 [T, H, D] tensor, the rest
    passed through, in out_dtype; hf rounds both products to out_dtype before the sum (HF's text function)."""
    T, H, D, E = x.shape[0], x.shape[1], x.shape[2], cos.shape[2]
    xr = x if E == D else pypto.view(x, [T, H, E], [0, 0, 0])
    x1 = pypto.view(xr, [T, H, E // 2], [0, 0, 0])
    x2 = pypto.view(xr, [T, H, E // 2], [0, 0, E // 2])
    rot = pypto.concat([pypto.neg(x2), x1], 2)
    if hf == 1 and out_dtype != FP32:
        y = f32(pypto.cast(xr * cos, out_dtype)) + f32(pypto.cast(rot * sin, out_dtype))
    else:
        y = xr * cos + rot * sin
    if E < D:
        y = pypto.concat([y, pypto.view(x, [T, H, D - E], [0, 0, E])], 2)
    return to(y, out_dtype)
