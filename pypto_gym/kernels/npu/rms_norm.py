"""rms_norm and add_rms_norm on the npu backend: torch_npu.npu_rms_norm / npu_add_rms_norm.

npu_rms_norm(self, gamma, epsilon) -> (y, rstd) computes in fp32 and casts once: `fp32`. For `hf`
(cast before the weight) it normalises with a unit gamma and the real gamma multiplies in torch,
which also reproduces HF's dtype promotion. Limits as documented: 2-8 dims, (x, gamma) dtype
pairs per chip series; npu_add_rms_norm: no empty tensors, gamma in x's dtype, no bf16 on Atlas
inference series chips. Neither has a no-cast path.
"""
import functools

import torch

from ...ops.args import dtype_name
from ...ops.defs.rms_norm import ADD_RMS_NORM, RMS_NORM
from .backend import as_rows

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

