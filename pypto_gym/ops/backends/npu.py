"""The `npu` backend: torch_npu's fused ops on Ascend NPUs, mapped onto SPEC 2's contract.

torch_npu is imported lazily, on the first NPU call, so nothing here touches it on machines
without CANN (importing it there breaks `import torch`). Mapping:

- rms_norm: `npu_rms_norm(x, gamma, epsilon) -> (y, rstd)` computes in fp32 and casts once,
  which is `cast_mode="fp32"`. For `hf` (cast before the weight, as HF does) it normalises with a
  unit gamma and multiplies by the real gamma in torch, which reproduces HF's dtype promotion.
- add_rms_norm: `npu_add_rms_norm(x1, x2, gamma, epsilon) -> (y, rstd, x_out)`, same two modes.
- add_rms_norm_dynamic_quant: `npu_add_rms_norm_dynamic_quant(x1, x2, gamma, *, smooth_scale1,
  smooth_scale2, beta, epsilon, output_mask) -> (y1, y2, x_out, scale1, scale2)`; y2/scale2 are
  dropped when there is no smooth_scale2 (the op leaves them meaningless).
- rms_norm_dynamic_quant: the same fused op with x2 = 0 (x + 0 == x exactly), which keeps SPEC
  2.3's fp32 math; composing npu_rms_norm with npu_dynamic_quant would quantise a value already
  rounded to x's dtype.

Limits checked before every call: rank 2..8 for the norms (a 1-D input is viewed as one row);
in fp32 mode gamma in x's dtype (the kernel would otherwise see a rounded gamma); for the quant
ops D <= 8192, float16/bfloat16, int8 only.
"""
from __future__ import annotations

import importlib

import torch

from ..registry import GAMMA_INDEX, Backend, register

QUANT_MAX_D = 8192
QUANT_DTYPES = (torch.float16, torch.bfloat16)


def limits_reason(op: str, shape: tuple, dtype: torch.dtype, dst_type: str | None = None,
                  gamma_dtype: torch.dtype | None = None, cast_mode: str = "hf") -> str | None:
    """Why torch_npu cannot take this call (None if it can); independent of the device."""
    if len(shape) > 8:
        return f"rank {len(shape)} > 8"
    if cast_mode == "none":
        return "cast_mode none: torch_npu's norm kernels always compute in fp32"
    if cast_mode == "fp32" and gamma_dtype is not None and gamma_dtype != dtype:
        return (f"cast_mode fp32 with gamma dtype {str(gamma_dtype).replace('torch.', '')} != "
                f"x dtype {str(dtype).replace('torch.', '')}")
    if op.endswith("quant"):
        name = "npu_add_rms_norm_dynamic_quant"
        if shape[-1] > QUANT_MAX_D:
            return f"D={shape[-1]} > {QUANT_MAX_D}"
        if dtype not in QUANT_DTYPES:
            return f"dtype {str(dtype).replace('torch.', '')} not supported by {name}"
        if dst_type != "int8":
            return f"dst_type {dst_type} not supported by {name}"
    return None


class NpuBackend(Backend):
    name = "npu"
    devices = ("npu",)

    def __init__(self, module_name: str = "torch_npu"):
        self.module_name = module_name
        self._module = None

    def torch_npu(self):
        if self._module is None:
            self._module = importlib.import_module(self.module_name)
        return self._module

    def supports(self, op, args):
        x, gamma = args[0], args[GAMMA_INDEX[op]]
        quant = op.endswith("quant")
        return super().supports(op, args) or limits_reason(
            op, tuple(x.shape), x.dtype, args[-1] if quant else None, None if gamma is None else gamma.dtype,
            "fp32" if quant else args[-1])

    @staticmethod
    def _as_rows(x):
        return x.reshape(1, -1) if x.dim() == 1 else x

    @staticmethod
    def _gamma(gamma, x, cast_mode):
        """(gamma for the kernel, gamma to apply afterwards in torch for hf mode)."""
        D = x.shape[-1]
        if gamma is None:
            return torch.ones(D, dtype=x.dtype, device=x.device), None
        g = gamma.reshape(D)
        if cast_mode == "fp32":  # same dtype as x: supports() refuses the other case
            return g, None
        return torch.ones(D, dtype=x.dtype, device=x.device), g

    def rms_norm(self, x, gamma, eps, cast_mode):
        g, post = self._gamma(gamma, x, cast_mode)
        y, _ = self.torch_npu().npu_rms_norm(self._as_rows(x), g, epsilon=eps)
        y = y.reshape(x.shape)
        return y if post is None else post * y

    def add_rms_norm(self, x1, x2, gamma, eps, cast_mode):
        g, post = self._gamma(gamma, x1, cast_mode)
        y, _, x_out = self.torch_npu().npu_add_rms_norm(self._as_rows(x1), self._as_rows(x2), g, epsilon=eps)
        y, x_out = y.reshape(x1.shape), x_out.reshape(x1.shape)
        return (y if post is None else post * y), x_out

    def rms_norm_dynamic_quant(self, x, gamma, smooth_scales, beta, eps, dst_type):
        y1, _, _, s1, _ = self.add_rms_norm_dynamic_quant(x, torch.zeros_like(x), gamma, smooth_scales, None, beta,
                                                          eps, dst_type)
        return y1, s1

    def add_rms_norm_dynamic_quant(self, x1, x2, gamma, smooth_scale1, smooth_scale2, beta, eps, dst_type):
        D = x1.shape[-1]
        vec = (lambda t: None if t is None else t.reshape(D))  # noqa: E731
        two = smooth_scale2 is not None
        y1, y2, x_out, s1, s2 = self.torch_npu().npu_add_rms_norm_dynamic_quant(
            self._as_rows(x1), self._as_rows(x2), gamma.reshape(D), smooth_scale1=vec(smooth_scale1),
            smooth_scale2=vec(smooth_scale2), beta=vec(beta), epsilon=eps, output_mask=[True, two])
        rows = x1.shape[:-1]
        return (y1.reshape(x1.shape), y2.reshape(x1.shape) if two else None, x_out.reshape(x1.shape),
                s1.reshape(rows), s2.reshape(rows) if two else None)


register(NpuBackend())
