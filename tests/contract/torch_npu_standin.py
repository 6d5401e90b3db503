"""Stand-in for torch_npu: its documented signatures, computed with pypto-gym's reference math.

The only stand-in the project allows (SPEC 2.6): torch_npu cannot be installed without CANN, so
the `npu` backend's mapping (argument names, output order, casts) is checked against this.
Signatures follow torch_npu's documentation:
  npu_rms_norm(self, gamma, epsilon=1e-06) -> (y, rstd)                      fp32 math, one cast
  npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06) -> (y, rstd, x)
  npu_add_rms_norm_dynamic_quant(x1, x2, gamma, *, smooth_scale1=None, smooth_scale2=None,
      beta=None, epsilon=1e-06, output_mask=None) -> (y1, y2, x_out, scale1, scale2)
"""
import torch

from pypto_gym.ops import reference

calls = []


def _check_gamma(x, gamma):
    if gamma.dtype != x.dtype or gamma.shape != x.shape[-1:]:
        raise RuntimeError(f"gamma must be [{x.shape[-1]}] {x.dtype}, got {list(gamma.shape)} {gamma.dtype}")
    if not 2 <= x.dim() <= 8:
        raise RuntimeError(f"x rank must be 2..8, got {x.dim()}")


def _rstd(x, eps):
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


def npu_rms_norm(self, gamma, epsilon=1e-06):
    calls.append("npu_rms_norm")
    _check_gamma(self, gamma)
    return reference.rms_norm(self, gamma, epsilon, "fp32"), _rstd(self, epsilon)


def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06):
    calls.append("npu_add_rms_norm")
    _check_gamma(x1, gamma)
    y, x = reference.add_rms_norm(x1, x2, gamma, epsilon, "fp32")
    return y, _rstd(x, epsilon), x


def npu_add_rms_norm_dynamic_quant(x1, x2, gamma, *, smooth_scale1=None, smooth_scale2=None, beta=None,
                                   epsilon=1e-06, output_mask=None):
    calls.append("npu_add_rms_norm_dynamic_quant")
    _check_gamma(x1, gamma)
    if x1.dtype not in (torch.float16, torch.bfloat16) or x1.shape[-1] > 8192:
        raise RuntimeError("npu_add_rms_norm_dynamic_quant: fp16/bf16 and D <= 8192 only")
    y1, y2, x_out, s1, s2 = reference.add_rms_norm_dynamic_quant(x1, x2, gamma, smooth_scale1, smooth_scale2, beta,
                                                                 epsilon, "int8")
    if y2 is None:  # the op always returns five tensors; these carry no meaning
        y2, s2 = torch.zeros_like(y1), torch.zeros_like(s1)
    return y1, y2, x_out, s1, s2
