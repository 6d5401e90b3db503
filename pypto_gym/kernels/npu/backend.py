"""The `npu` backend's machinery: torch_npu, imported lazily, and the chip it runs on.

torch_npu is imported on the first NPU call, so nothing here touches it on machines without
CANN (importing it there breaks `import torch`). Each op's module beside this one (kernels/npu/<op>.py) maps it onto torch_npu's
documented API (`@op.impl("npu", supports=...)`) and states torch_npu's documented limits as its
`supports` predicate; this module provides the module and the chip series those limits depend on.
"""
from __future__ import annotations

import functools
import importlib
import weakref

import torch

from ...ops.registry import Backend, register

HALF = (torch.float16, torch.bfloat16)
# The mapping follows torch_npu's pages on Ascend/op-plugin master and branch 26.0.0 (the `npu` extra pins torch_npu
# 2.13.0, matching torch). Keywords that older releases lack are passed only where a call needs them, so a call
# that does not need them runs on those releases too: `y_dtype` of npu_add_rms_norm_dynamic_quant (int4 only),
# `beta` of npu_add_rms_norm_quant and npu_add_rms_norm_dynamic_quant (given only), `rotary_mode` of the rotary ops
# (never: "half" is the default), `round_mode` of npu_trans_quant_param and `inner_precise` of
# npu_fused_infer_attention_score (where their pages ask for them).
# Where each function and keyword the mapping calls first appears in op-plugin's op_plugin/config/
# op_plugin_functions.yaml (branches 6.0.0 ... 7.3.0, 26.0.0, 26.1.0, master; what is not listed is in 6.0.0): a
# torch_npu without a function declines the ops that call it (`needs`), naming the branch; keywords cannot be probed
# on a C-bound function, so they are passed only where a call needs them (NEWER_KEYWORDS) and listed here for the
# reader. npu_apply_rotary_pos_emb's `layout` defaults to "BSH" up to 26.0.0 ("BSND" from 26.1.0): always passed.
SINCE = {"npu_mrope": "7.0.0", "npu_dequant_swiglu_quant": "7.0.0", "npu_add_rms_norm_quant": "7.1.0",
         "npu_add_rms_norm_dynamic_quant": "7.2.0", "npu_swiglu_quant": "7.2.0",
         "npu_trans_quant_param(round_mode)": "7.1.0", "npu_rotary_mul(rotary_mode)": "7.0.0",
         "npu_add_rms_norm_quant(beta)": "7.2.0", "npu_apply_rotary_pos_emb(rotary_mode)": "7.2.0",
         "npu_add_rms_norm_dynamic_quant(y_dtype)": "26.0.0", "npu_mrope(cache_mode)": "26.0.0"}
NEWER_KEYWORDS = {"npu_add_rms_norm_dynamic_quant": ("y_dtype", "beta"), "npu_add_rms_norm_quant": ("beta",),
                  "npu_apply_rotary_pos_emb": ("rotary_mode",), "npu_rotary_mul": ("rotary_mode",),
                  "npu_mrope": ("rotary_mode", "cache_mode")}


def chip_series(device_name: str) -> str:
    """'a2_a3' (Ascend 910B / 910_93), 'inference' (Atlas inference series: 310P) or 'training' (Ascend 910)."""
    name = device_name.replace(" ", "")
    if name.startswith("Ascend310P"):
        return "inference"
    if name.startswith("Ascend910B") or name.startswith("Ascend910_93") or name.startswith("Ascend950"):
        return "a2_a3"
    return "training" if name.startswith("Ascend910") else "a2_a3"


def quant_limits(name: str, x: torch.Tensor, dst_type: str, backend) -> str | None:
    """The limits torch_npu's per-token quant ops share (npu_dynamic_quant, npu_add_rms_norm_dynamic_quant): not
    empty, Atlas A2/A3, fp16/bf16 input, int4 output only with D % 8 == 0; the reason a call is declined, or None."""
    if not x.numel():
        return f"{name}: empty tensors are not supported"
    if backend.series_of(x) != "a2_a3":
        return f"{name}: supported on Atlas A2/A3 chips only"
    if x.dtype not in HALF:
        return f"dtype {str(x.dtype).replace('torch.', '')} not supported by {name}"
    if dst_type == "int4" and x.shape[-1] % 8:
        return f"{name}: int4 needs D divisible by 8, got D={x.shape[-1]}"
    return None


# npu_fused_infer_attention_score's documented limits (torch_npu-npu_fused_infer_attention_score.md, 约束说明, Atlas
# A2/A3): a prefill (Q_S > 1) B <= 65536 (<= 128 where D is not 32-byte aligned), N <= 256, D <= 512, D 16-byte
# aligned for fp16/bf16; a decode step (Q_S = 1) B <= 65536, N <= 256, D <= 512, KV_S <= 262144. The TND layout:
# at most 4096 sequences, and (no rope, D != 512) D = 128, or q/k D = 192 with v D 128 or 192.
FIA = "npu_fused_infer_attention_score"
FIA_MAX_B, FIA_MAX_N, FIA_MAX_D, FIA_MAX_KV_DECODE, FIA_MAX_TND_SEQUENCES = 65536, 256, 512, 262144, 4096
FIA_TND_D = (128, 192)


def fia_limits(B: int, N: int, N_kv: int, S: int, D: int, kv: int, dtype) -> str | None:
    """Why a BNSD (or, with B = the sequences, a TND) call of FIA at these sizes is refused by its page, or None;
    N_kv its KV heads (num_key_value_heads: N a multiple of it, at most 64 query heads per KV head)."""
    if B > FIA_MAX_B:
        return f"{FIA}: batch {B} > {FIA_MAX_B}"
    if N > FIA_MAX_N:
        return f"{FIA}: {N} query heads > {FIA_MAX_N}"
    if N // N_kv > 64:
        return f"{FIA}: {N // N_kv} query heads per KV head (at most 64)"
    if D > FIA_MAX_D:
        return f"{FIA}: head dim {D} > {FIA_MAX_D}"
    size = dtype.itemsize
    if S > 1 and (D * size) % 16:
        return f"{FIA}: head dim {D} is not 16-byte aligned in {str(dtype).replace('torch.', '')} (a prefill)"
    if S > 1 and (D * size) % 32 and B > 128:
        return f"{FIA}: batch {B} > 128 with a head dim {D} that is not 32-byte aligned (a prefill)"
    if S == 1 and kv > FIA_MAX_KV_DECODE:
        return f"{FIA}: KV length {kv} > {FIA_MAX_KV_DECODE} at a decode step"
    return None


_CONVERTED: dict = {}  # (id(tensor), kind) -> (its version, the converted tensor, a weakref dropping the entry)


def converted_once(t: torch.Tensor, kind, convert) -> torch.Tensor:
    """`convert(t)`, made once per tensor, kind and in-place version (what vllm-ascend does once at load: a model's
    int8 weights in the NZ format, its cos/sin cache in the call dtype; per call it would be a copy of the whole
    tensor at every decode step). The entry goes with the tensor; an in-place update makes it again."""
    key = (id(t), kind)
    held = _CONVERTED.get(key)
    if held is None or held[2]() is not t or held[0] != t._version:
        held = (t._version, convert(t), weakref.ref(t, lambda _, key=key: _CONVERTED.pop(key, None)))
        _CONVERTED[key] = held
    return held[1]


def needs(*functions):
    """A `supports` predicate that first declines where the installed torch_npu lacks one of these functions."""
    def wrap(supports):
        @functools.wraps(supports)
        def guarded(backend, *args):
            return backend.missing(functions) or supports(backend, *args)
        return guarded
    return wrap


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """torch_npu's norm ops want 2-8 dims: a 1-D input is one row."""
    return x.reshape(1, -1) if x.dim() == 1 else x


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

    def missing(self, functions) -> str | None:
        """Why the installed torch_npu cannot make these calls (a release without one of them), None if it can."""
        module = self.torch_npu()
        for name in functions:
            if not hasattr(module, name):
                return f"this torch_npu has no {name} (op-plugin {SINCE.get(name, '6.0.0')} and later)"
        return None

    @functools.lru_cache(maxsize=16)
    def device_name(self, device_index) -> str:
        """The chip's name without spaces ('Ascend910B2', 'Ascend910_9391'): for a page that lists A2 and not A3."""
        return self.torch_npu().npu.get_device_name(device_index).replace(" ", "")

    def series(self, device_index) -> str:
        return chip_series(self.device_name(device_index))

    def series_of(self, t: torch.Tensor) -> str:
        return self.series(t.device.index)


register(NpuBackend())
