"""The quantisation rules every quantised op and int8 weight shares (SPEC 2.3), and int4 packings.

Per-row symmetric dynamic quantisation: scale = row_max|n| / qmax, codes = clamp(rint(n / scale)),
round half to even (torch.round, the hardware's RINT). Weights are quantised per output channel
with the same rule (a weight's rows are its output channels).

Static per-tensor quantisation (msModelSlim's W8A8, torch_npu's npu_quantize with div_mode=True): one
scale and one integer offset for the whole tensor, fixed offline: codes = clamp(rint(n / scale + offset)),
the division and the add in fp32 (in that order: the add can round the fraction before rint does).
"""
from __future__ import annotations

import torch

QUANT_RANGES = {"int8": (127.0, -128.0), "int4": (7.0, -8.0)}
DST_TYPES = tuple(QUANT_RANGES)


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


def quantize_static(n: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    """Static per-tensor int8: clamp(rint(n / f32(scale) + f32(offset)), -128, 127), n in fp32; scale and offset
    hold one value each. A NaN gives code 0 (int8 has no NaN), an infinity the clamped end."""
    v = n / scale.reshape(()).to(torch.float32)
    if offset is not None:
        v = v + offset.reshape(()).to(torch.float32)
    q = torch.round(v).clamp(-128.0, 127.0)
    return torch.where(torch.isnan(q), torch.zeros_like(q), q).to(torch.int8)


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
