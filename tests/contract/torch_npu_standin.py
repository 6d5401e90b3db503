"""Stand-in for torch_npu: its documented signatures and limits, computed with pypto-gym's reference math.

The only stand-in the project allows (SPEC 2.6): torch_npu cannot be installed without CANN, so
the `npu` backend's mapping (argument names, output order and layout, casts, limits) is checked
against this module, written from torch_npu's API pages:
  npu_rms_norm(self, gamma, epsilon=1e-06) -> (y, rstd)          self 2-8 dims; empty tensors allowed;
      (x, gamma) dtype pairs per chip (A2/A3: fp16/fp32, bf16/fp32, fp16/fp16, bf16/bf16, fp32/fp32)
  npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06) -> (y, rstd, x)  1-8 dims; no empty tensors; gamma
      dtype = x1's; no bf16 on Atlas inference series chips
  npu_add_rms_norm_dynamic_quant(x1, x2, gamma, *, smooth_scale1=None, smooth_scale2=None, beta=None,
      epsilon=1e-06, output_mask=None, y_dtype=None) -> (y1, y2, x_out, scale1, scale2)
      2-8 dims; no empty tensors; fp16/bf16; y_dtype int8 or torch.quint4x2 (eight int4 per int32,
      D % 8 == 0); an output the mask turns off is an empty tensor; A2/A3 chips only.
`npu.get_device_name()` reports the chip this stand-in pretends to be (`DEVICE_NAME`).
"""
import types

import torch

from pypto_gym.ops import reference

calls = []
DEVICE_NAME = "Ascend910B2"
npu = types.SimpleNamespace(get_device_name=lambda device=None: DEVICE_NAME)
A2_A3_PAIRS = {(torch.float16, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
               (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)}


def _a2_a3() -> bool:
    return DEVICE_NAME.startswith(("Ascend910B", "Ascend910_93"))


def _rstd(x, eps):
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


def _check(cond, message):
    if not cond:
        raise RuntimeError(message)


def npu_rms_norm(self, gamma, epsilon=1e-06):
    calls.append("npu_rms_norm")
    _check(2 <= self.dim() <= 8, f"npu_rms_norm: self must have 2-8 dims, got {self.dim()}")
    pairs = A2_A3_PAIRS if _a2_a3() else {(torch.float16, torch.float16), (torch.float32, torch.float32)}
    _check((self.dtype, gamma.dtype) in pairs, f"npu_rms_norm: unsupported dtypes {self.dtype}, {gamma.dtype}")
    _check(gamma.shape == self.shape[-1:], f"npu_rms_norm: gamma shape {tuple(gamma.shape)}")
    y = reference.rms_norm(self, gamma.float(), epsilon, "fp32").to(self.dtype)  # fp32 math, one cast
    return y, _rstd(self, epsilon)


def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06):
    calls.append("npu_add_rms_norm")
    _check(1 <= x1.dim() <= 8 and x1.shape == x2.shape, "npu_add_rms_norm: x1/x2 must match, 1-8 dims")
    _check(x1.numel() > 0, "npu_add_rms_norm: empty tensors are not supported")
    _check(gamma.dtype == x1.dtype and gamma.shape == x1.shape[-1:], "npu_add_rms_norm: gamma must be [D] of x1's dtype")
    _check(_a2_a3() or x1.dtype != torch.bfloat16, "npu_add_rms_norm: no bfloat16 on this chip")
    y, x = reference.add_rms_norm(x1, x2, gamma, epsilon, "fp32")
    return y, _rstd(x, epsilon), x


def npu_add_rms_norm_dynamic_quant(x1, x2, gamma, *, smooth_scale1=None, smooth_scale2=None, beta=None,
                                   epsilon=1e-06, output_mask=None, y_dtype=None):
    calls.append("npu_add_rms_norm_dynamic_quant")
    _check(_a2_a3(), "npu_add_rms_norm_dynamic_quant: Atlas A2/A3 only")
    _check(2 <= x1.dim() <= 8 and x1.shape == x2.shape, "npu_add_rms_norm_dynamic_quant: x1/x2 must match, 2-8 dims")
    _check(x1.numel() > 0, "npu_add_rms_norm_dynamic_quant: empty tensors are not supported")
    _check(x1.dtype in (torch.float16, torch.bfloat16), "npu_add_rms_norm_dynamic_quant: fp16/bf16 only")
    for name, t in (("gamma", gamma), ("smooth_scale1", smooth_scale1), ("smooth_scale2", smooth_scale2),
                    ("beta", beta)):
        _check(t is None or (t.dtype == x1.dtype and t.shape == x1.shape[-1:]), f"{name} must be [D] of x1's dtype")
    _check(y_dtype in (None, torch.int8, torch.quint4x2), f"y_dtype {y_dtype} not supported")
    int4 = y_dtype == torch.quint4x2
    _check(not int4 or x1.shape[-1] % 8 == 0, "int4 needs the last dim divisible by 8")
    if output_mask is not None:
        _check(len(output_mask) == 2 and any(output_mask), "output_mask: two bools, not both False")
        _check(smooth_scale1 is None or output_mask[0], "smooth_scale1 given but output_mask[0] is False")
        _check(smooth_scale2 is None or output_mask[1], "smooth_scale2 given but output_mask[1] is False")
        out1, out2 = output_mask
    else:
        out1, out2 = True, smooth_scale1 is not None and smooth_scale2 is not None
    dst = "int4" if int4 else "int8"
    x_out = x1 + x2
    n = reference._normalise_for_quant(x_out, gamma, beta, epsilon)
    results = []
    for wanted, smooth in ((out1, smooth_scale1), (out2, smooth_scale2)):
        if not wanted:
            results.append((torch.empty(0, dtype=torch.int32 if int4 else torch.int8), torch.empty(0)))
            continue
        y, s = reference.quantize_rows(n if smooth is None else n * smooth.float(), dst)
        results.append((reference.pack_int4_to_int32(y) if int4 else y, s))
    (y1, s1), (y2, s2) = results
    return y1, y2, x_out, s1, s2
