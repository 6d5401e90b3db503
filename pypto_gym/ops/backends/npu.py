"""The `npu` backend: torch_npu's fused ops on Ascend NPUs, mapped onto SPEC 2's contract.

torch_npu is imported lazily, on the first NPU call, so nothing here touches it on machines
without CANN (importing it there breaks `import torch`). Mapping (torch_npu's documented API):

- rms_norm: `npu_rms_norm(self, gamma, epsilon) -> (y, rstd)` computes in fp32 and casts once,
  which is `cast_mode="fp32"`. For `hf` (cast before the weight, as HF does) it normalises with a
  unit gamma and multiplies by the real gamma in torch, which reproduces HF's dtype promotion.
- add_rms_norm: `npu_add_rms_norm(x1, x2, gamma, epsilon) -> (y, rstd, x_out)`, same two modes.
- add_rms_norm_dynamic_quant: `npu_add_rms_norm_dynamic_quant(x1, x2, gamma, *, smooth_scale1,
  smooth_scale2, beta, epsilon, output_mask, y_dtype) -> (y1, y2, x_out, scale1, scale2)`;
  `output_mask=[True, two]` asks for the second branch only when there is a second smooth scale.
  int4 is `y_dtype=torch.quint4x2`: eight int4 codes packed in each int32 (last dim D/8), which
  `reference.unpack_int4_from_int32` turns into one code per int8 (SPEC 2.3's layout).
- rms_norm_dynamic_quant: the same fused op with x2 = 0 (x + 0 == x exactly), which keeps SPEC
  2.3's fp32 math.
- quant_matmul: `npu_quant_matmul(x1, x2, scale, *, offset, pertoken_scale, bias, output_dtype)`
  with x1 = int8 rows [M, K], x2 = the int8 weight as [K, N] (a transposed view of our [N, K]),
  scale = the per-channel fp32 scales, pertoken_scale = the per-row fp32 scales, a float bias
  added after dequantisation, output_dtype bfloat16 or float16 (the documented pertoken rows).

Limits are torch_npu's documented ones, checked before the kernel is called (capabilities,
counted as fallbacks): no empty tensors for the add ops and the quant op; 2-8 dims (a 1-D input
is viewed as one row); x/gamma dtype pairs of npu_rms_norm per chip; fp16/bf16 only for the
quant op, on A2/A3 chips only; no bf16 for npu_add_rms_norm on Atlas inference series chips;
npu_quant_matmul with pertoken_scale on A2/A3 only, output fp16/bf16, a float bias in fp32 or
the output dtype.
"""
from __future__ import annotations

import functools
import importlib

import torch

from ..reference import unpack_int4_from_int32
from ..registry import GAMMA_INDEX, Backend, register

_HALF = (torch.float16, torch.bfloat16)
# npu_rms_norm's documented (x, gamma) dtype pairs
RMS_NORM_PAIRS_A2_A3 = {(torch.float16, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
                        (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)}
RMS_NORM_PAIRS_OLDER = {(torch.float16, torch.float16), (torch.float32, torch.float32)}


def chip_series(device_name: str) -> str:
    """'a2_a3' (Ascend 910B / 910_93), 'inference' (Atlas inference series: 310P) or 'training' (Ascend 910)."""
    name = device_name.replace(" ", "")
    if name.startswith("Ascend310P"):
        return "inference"
    if name.startswith("Ascend910B") or name.startswith("Ascend910_93") or name.startswith("Ascend950"):
        return "a2_a3"
    return "training" if name.startswith("Ascend910") else "a2_a3"


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def limits_reason(op: str, shape: tuple, dtype: torch.dtype, *, gamma_dtype=None, cast_mode: str = "hf",
                  dst_type: str | None = None, series: str = "a2_a3") -> str | None:
    """Why torch_npu cannot take this call (None if it can): its documented limits only."""
    if len(shape) > 8:
        return f"rank {len(shape)} > 8"
    if cast_mode == "none":
        return "cast_mode none: torch_npu's norm kernels always compute in fp32"
    empty = 0 in shape
    if op == "rms_norm":
        pairs = RMS_NORM_PAIRS_A2_A3 if series == "a2_a3" else RMS_NORM_PAIRS_OLDER
        g = dtype if gamma_dtype is None or cast_mode == "hf" else gamma_dtype  # hf: a unit gamma in x's dtype
        if (dtype, g) not in pairs:
            return f"npu_rms_norm: x {_name(dtype)} with gamma {_name(g)} is not a documented pair on {series} chips"
        return None
    if empty:
        return f"{'npu_add_rms_norm' if op == 'add_rms_norm' else 'npu_add_rms_norm_dynamic_quant'}: " \
               f"empty tensors are not supported"
    if op == "add_rms_norm":
        if series == "inference" and dtype == torch.bfloat16:
            return "npu_add_rms_norm: bfloat16 not supported on Atlas inference series chips"
        if cast_mode == "fp32" and gamma_dtype is not None and gamma_dtype != dtype:
            return f"npu_add_rms_norm: gamma dtype {_name(gamma_dtype)} must equal x's {_name(dtype)}"
        return None
    name = "npu_add_rms_norm_dynamic_quant"
    if series != "a2_a3":
        return f"{name}: supported on Atlas A2/A3 chips only"
    if dtype not in _HALF:
        return f"dtype {_name(dtype)} not supported by {name}"
    if dst_type == "int4" and shape[-1] % 8:
        return f"{name}: int4 needs D divisible by 8, got D={shape[-1]}"
    return None


def quant_matmul_reason(x_q, w_q, bias, out_dtype, series: str) -> str | None:
    """Why npu_quant_matmul cannot take this call with per-token scales (None if it can)."""
    name = "npu_quant_matmul"
    if series != "a2_a3":
        return f"{name}: pertoken_scale is not supported on {series} chips"
    if not x_q.numel() or not w_q.numel():
        return f"{name}: empty tensors are not supported"
    if out_dtype not in _HALF:
        return f"{name}: output_dtype {_name(out_dtype)} not supported with pertoken_scale (float16, bfloat16)"
    if bias is not None and bias.dtype not in (out_dtype, torch.float32):
        return f"{name}: bias {_name(bias.dtype)} with output {_name(out_dtype)} is not a documented combination"
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

    @functools.lru_cache(maxsize=16)
    def series(self, device_index) -> str:
        return chip_series(self.torch_npu().npu.get_device_name(device_index))

    def supports(self, op, args):
        reason = super().supports(op, args)
        if reason:
            return reason
        if op == "quant_matmul":
            x_q, w_q, _, _, bias, out_dtype = args
            return quant_matmul_reason(x_q, w_q, bias, out_dtype, self.series(x_q.device.index))
        x, gamma = args[0], args[GAMMA_INDEX[op]]
        quant = op.endswith("quant")
        return limits_reason("quant" if quant else op, tuple(x.shape), x.dtype,
                             gamma_dtype=None if gamma is None else gamma.dtype,
                             cast_mode="fp32" if quant else args[-1], dst_type=args[-1] if quant else None,
                             series=self.series(x.device.index))

    @staticmethod
    def _as_rows(x):
        return x.reshape(1, -1) if x.dim() == 1 else x

    @staticmethod
    def _gamma(gamma, x, cast_mode):
        """(gamma for the kernel, gamma to apply afterwards in torch for hf mode)."""
        D = x.shape[-1]
        if cast_mode == "fp32" and gamma is not None:
            return gamma.reshape(D), None  # a documented (x, gamma) pair: supports() checked it
        unit = torch.ones(D, dtype=x.dtype, device=x.device)
        return unit, (None if gamma is None else gamma.reshape(D))

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
            smooth_scale2=vec(smooth_scale2), beta=vec(beta), epsilon=eps, output_mask=[True, two],
            y_dtype=torch.quint4x2 if dst_type == "int4" else torch.int8)
        if dst_type == "int4":  # eight codes per int32 -> one code per int8
            y1 = unpack_int4_from_int32(y1)
            y2 = unpack_int4_from_int32(y2) if two else y2
        rows = x1.shape[:-1]
        return (y1.reshape(x1.shape), y2.reshape(x1.shape) if two else None, x_out.reshape(x1.shape),
                s1.reshape(rows), s2.reshape(rows) if two else None)

    def quant_matmul(self, x_q, w_q, x_scale, w_scale, bias, out_dtype):
        K, N = x_q.shape[-1], w_q.shape[0]
        y = self.torch_npu().npu_quant_matmul(x_q.reshape(-1, K), w_q.t(), w_scale, pertoken_scale=x_scale.reshape(-1),
                                              bias=bias, output_dtype=out_dtype)
        return y.reshape(*x_q.shape[:-1], N)


register(NpuBackend())
