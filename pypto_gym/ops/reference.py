"""Reference formulas of SPEC section 2, in plain torch: the goldens and the `torch` backend.

Written straight from the spec so a reader can check them line by line. In `hf` mode
`rms_norm` is the exact op sequence of transformers' `Qwen2_5_VLRMSNorm.forward`, so a model
patched on this backend is bit-identical to the unpatched one. These are checked against
independent evidence in tests/test_reference.py (the worked examples of the reference
documents and an fp64 formula), never against themselves.
"""
from __future__ import annotations

import torch

QUANT_RANGES = {"int8": (127.0, -128.0), "int4": (7.0, -8.0)}


def out_dtype(x, gamma, cast_mode):
    """SPEC 2.1: `hf` promotes with gamma's dtype (as HF's `weight * h`); `fp32` and `none` give x's dtype."""
    return x.dtype if gamma is None or cast_mode != "hf" else torch.promote_types(x.dtype, gamma.dtype)


def _flat_gamma(gamma: torch.Tensor | None, D: int) -> torch.Tensor | None:
    return None if gamma is None else gamma.reshape(D)


def rms_norm(x, gamma=None, eps=1e-6, cast_mode="hf"):
    D = x.shape[-1]
    g = _flat_gamma(gamma, D)
    input_dtype = x.dtype
    if cast_mode == "none":
        return _rms_norm_no_cast(x, g, eps)
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    if cast_mode == "hf":
        h = h.to(input_dtype)
        return h if g is None else g * h
    if g is not None:
        h = h * g.to(torch.float32)
    return h.to(input_dtype)


def _rms_norm_no_cast(x, g, eps):
    """Reference 000's no-cast path: every step's result rounded to x's dtype T, each step evaluated as
    one fp32 operation (as the vector units do); the sum of squares accumulates exactly:
    var = T(sum(T(x*x)) / D); r = T(1 / fp32(sqrt(T(var + eps)))); y = T(T(g) * T(x * r)).
    Each step is computed in float64 and rounded explicitly, because torch's own low-precision ops
    round differently in their vectorised body and scalar tail (bf16 rsqrt) and its fp32 sqrt is
    not always correctly rounded: the golden must not depend on the row length."""
    T, f32, f64 = x.dtype, torch.float32, torch.float64

    def rnd(t):  # an exact (float64) result, rounded as an fp32 operation then a cast to T would round it
        return t.to(f32).to(T).to(f64)

    xd = x.to(f64)
    var = rnd(rnd(xd * xd).sum(-1, keepdim=True) / x.shape[-1])
    r = rnd(1.0 / torch.sqrt(rnd(var + float(torch.tensor(eps, dtype=f32)))).to(f32).to(f64))
    h = rnd(xd * r)
    return h.to(T) if g is None else (rnd(g.to(f64)) * h).to(f32).to(T)


def add_rms_norm(x1, x2, gamma, eps=1e-6, cast_mode="hf"):
    x_out = x1 + x2
    return rms_norm(x_out, gamma, eps, cast_mode), x_out


def _normalise_for_quant(x, gamma, beta, eps):
    D = x.shape[-1]
    xf = x.to(torch.float32)
    rms = torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    n = xf / rms * gamma.reshape(D).to(torch.float32)
    if beta is not None:
        n = n + beta.reshape(D).to(torch.float32)
    return n


def quantize_rows(n: torch.Tensor, dst_type: str):
    """Per-row symmetric dynamic quantisation: scale = row_max|n| / qmax, y = clamp(rint(n/scale)).

    A row of zeros gets scale 0 and y 0; a NaN row gets scale NaN and y 0 (int8 has no NaN).
    """
    qmax, qmin = QUANT_RANGES[dst_type]
    scale = n.abs().amax(-1, keepdim=True) / qmax
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(n / safe).clamp(qmin, qmax)
    q = torch.where(torch.isnan(q) | (scale == 0), torch.zeros_like(q), q)
    return q.to(torch.int8), scale.squeeze(-1)


def rms_norm_dynamic_quant(x, gamma, smooth_scales=None, beta=None, eps=1e-6, dst_type="int8"):
    n = _normalise_for_quant(x, gamma, beta, eps)
    if smooth_scales is not None:
        n = n * smooth_scales.reshape(x.shape[-1]).to(torch.float32)
    return quantize_rows(n, dst_type)


def add_rms_norm_dynamic_quant(x1, x2, gamma, smooth_scale1=None, smooth_scale2=None, beta=None, eps=1e-6,
                               dst_type="int8"):
    x_out = x1 + x2
    n = _normalise_for_quant(x_out, gamma, beta, eps)
    D = x_out.shape[-1]
    b1 = n if smooth_scale1 is None else n * smooth_scale1.reshape(D).to(torch.float32)
    y1, s1 = quantize_rows(b1, dst_type)
    if smooth_scale2 is None:
        return y1, None, x_out, s1, None
    y2, s2 = quantize_rows(n * smooth_scale2.reshape(D).to(torch.float32), dst_type)
    return y1, y2, x_out, s1, s2


EXACT_K = 1024  # int8 products are at most 2**14 in magnitude: sums of 1024 of them stay exact in fp32 (2**24)


def quant_matmul(x_q, w_q, x_scale, w_scale, bias=None, out_dtype=torch.bfloat16):
    """W8A8 linear: y = fp32(x_q @ w_q^T, accumulated exactly) * x_scale[..., None] * w_scale (+ bias).

    x_q int8 [..., K] with per-row scales x_scale [...]; w_q int8 [N, K] with per-output-channel
    scales w_scale [N]. The integer product is exact (as an int32 accumulator is): computed in fp32
    over chunks of EXACT_K columns, where every partial sum is an integer below 2**24, and summed
    in float64. Then one fp32 conversion, the per-row scale, the per-channel scale, the bias in
    fp32, one cast to out_dtype: the order every backend follows.
    """
    K, N = x_q.shape[-1], w_q.shape[0]
    x2 = x_q.reshape(-1, K)
    acc = torch.zeros(x2.shape[0], N, dtype=torch.float64, device=x_q.device)
    for k in range(0, K, EXACT_K):
        acc += (x2[:, k:k + EXACT_K].to(torch.float32) @ w_q[:, k:k + EXACT_K].to(torch.float32).T).to(torch.float64)
    y = acc.to(torch.float32) * x_scale.reshape(-1, 1).to(torch.float32) * w_scale.to(torch.float32)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(out_dtype).reshape(*x_q.shape[:-1], N)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack int4 values (one per int8, in [-8, 7]) two per byte, low nibble first, along the last dim."""
    if q.dtype != torch.int8:
        raise TypeError(f"pack_int4: q must be torch.int8, got {q.dtype}")
    if q.shape[-1] % 2:
        raise ValueError(f"pack_int4: q's last dim must be even, got shape {tuple(q.shape)}")
    if q.numel() and (int(q.min()) < -8 or int(q.max()) > 7):
        raise ValueError(f"pack_int4: values must lie in [-8, 7], got [{int(q.min())}, {int(q.max())}]")
    u = q.to(torch.uint8) & 0x0F
    return (u[..., 0::2] | (u[..., 1::2] << 4)).to(torch.int8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: [..., D/2] bytes -> [..., D] int8 values in [-8, 7]."""
    if packed.dtype != torch.int8:
        raise TypeError(f"unpack_int4: packed must be torch.int8, got {packed.dtype}")
    u = packed.to(torch.uint8)
    lo = (u & 0x0F).to(torch.int8)
    hi = ((u >> 4) & 0x0F).to(torch.int8)
    lo = torch.where(lo > 7, lo - 16, lo)
    hi = torch.where(hi > 7, hi - 16, hi)
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def pack_int4_to_int32(q: torch.Tensor) -> torch.Tensor:
    """torch_npu's int4 layout (`y_dtype=torch.quint4x2`): eight int4 codes per int32 along the last dim,
    code j of each group of eight in bits 4j..4j+3 (the low nibble first, as in pack_int4)."""
    if q.dtype != torch.int8 or q.shape[-1] % 8:
        raise ValueError(f"pack_int4_to_int32: q must be int8 with a last dim divisible by 8, got {q.dtype} "
                         f"{tuple(q.shape)}")
    nibbles = (q.to(torch.int64) & 0xF).reshape(*q.shape[:-1], -1, 8)
    word = (nibbles << (4 * torch.arange(8, device=q.device))).sum(-1)
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


def unpack_int4_from_int32(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4_to_int32: [..., D/8] int32 -> [..., D] int8 codes in [-8, 7]."""
    if packed.dtype != torch.int32:
        raise TypeError(f"unpack_int4_from_int32: packed must be torch.int32, got {packed.dtype}")
    shifts = 4 * torch.arange(8, device=packed.device)
    nibbles = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF
    return torch.where(nibbles > 7, nibbles - 16, nibbles).to(torch.int8).flatten(-2)
