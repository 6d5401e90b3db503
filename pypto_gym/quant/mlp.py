"""QuantMlp: a patched SwiGLU MLP in W8A8 mode, handing its activation to an int8 down_proj as int8 rows.

gate_proj and up_proj are int8 linears fed by the norm before the MLP (plan.py). Where both read that
norm's int8 rows and the tensors are on the CPU, the MLP runs them as one exact int32 GEMM over their
merged weights (`ops.int32_gemm`: the two linears' int8 weights are views of one [2I, K] tensor, no
second copy) and `dequant_swiglu_quant` takes the int32 output to down_proj's int8 rows: no float
gate, up or activation is written. Otherwise (hooks on gate_proj/up_proj, rows that escaped, another
device) the linears run as modules and `swiglu_dynamic_quant` quantises silu(gate) * up; the report
counts both. Either way the arithmetic is W8A8's own, not HF's roundings: the int32 path dequantises
in fp32 as torch_npu does. The smooth scale is fp32, as torch_npu's swiglu quant ops take it.

In the static scheme the MLP's activation (`swiglu` in the site's cast mode) is quantised by `static_quant`
under the producer's static scale and offset (gate_proj and up_proj run as their int8 modules); its smooth
scale is folded into an int8 up_proj's deq_scale, as a checkpoint holds it.
"""
from __future__ import annotations

import functools

import torch

from .. import ops
from ..ops import registry
from ..patching.site import has_hooks
from . import activations


class QuantMlp(activations.Producer):
    """The W8A8 half of one patched MLP site (its Site keeps the path, cast mode, backend and counters)."""

    def __init__(self, inv_smooth, static=None):
        super().__init__(inv_smooth, static)
        self.merged = None  # (w_q [2I, K], w_scale [2I], gate QuantLinear, up QuantLinear) for the int32 path
        self.int32_calls = 0  # calls that ran one int32 GEMM + dequant_swiglu_quant
        self.smooth_folded = False  # static: the smooth scale is folded into up_proj's deq_scale (plan.py)

    def merge(self, gate, up) -> None:
        """Make gate's and up's int8 weights and scales the two halves of one tensor (the int32 path's weight)."""
        I = gate.w_q.shape[0]
        w_q, w_scale = torch.cat([gate.w_q, up.w_q]), torch.cat([gate.w_scale, up.w_scale])
        gate.w_q, up.w_q = w_q[:I], w_q[I:]
        gate.w_scale, up.w_scale = w_scale[:I], w_scale[I:]
        self.merged = (w_q, w_scale, gate, up)
        gate.merged_into = up.merged_into = self

    def remerge(self) -> None:
        """One of the two weights was quantised again (QuantLinear.refresh): merge the current halves."""
        _, _, gate, up = self.merged
        self.merge(gate, up)

    def row(self) -> dict:
        return {**super().row(), "gate_up_int32_gemm": self.merged is not None, "int32_calls": self.int32_calls}

    def _handed_rows(self, module, x):
        """(q, scale) of the norm's int8 rows if the int32 path can take them exactly, else None."""
        if self.merged is None:
            return None
        _, _, gate, up = self.merged
        if not _provides_int32_gemm(gate.backend, x.device.type):  # the NPU runs each int8 linear's npu_quant_matmul
            return None
        if module.gate_proj is not gate.module or module.up_proj is not up.module:
            self.count("gate_proj or up_proj replaced after patching: the modules run")
            return None
        if has_hooks(module.gate_proj) or has_hooks(module.up_proj):
            return None  # hooks that expect to see gate_proj's and up_proj's outputs
        if not torch.compiler.is_compiling():
            gate.refresh()  # a weight changed since patching is quantised again (and merged again) first
            up.refresh()
        return activations.handed_over(x, gate.source)

    def forward(self, site, module, x):
        if self.static is not None:
            act = ops.swiglu(module.gate_proj(x), module.up_proj(x), cast_mode=site.cast_mode,
                             backend=site.call.backend, stats=site.stats)
            smooth = None if self.smooth_folded else self.inv_smooth
            q = ops.static_quant(act, *self.static, smooth, backend=site.call.backend, stats=site.stats)
            return module.down_proj(self.hand_over(q, None, act.dtype))
        rows = self._handed_rows(module, x)
        if rows is not None:
            q, x_scale = rows
            w_q, w_scale, gate, up = self.merged
            acc = ops.int32_gemm(q.reshape(-1, q.shape[-1]), w_q, backend=gate.backend, stats=gate.stats)
            acc = acc.reshape(*q.shape[:-1], w_q.shape[0])
            biases = (gate.module.bias, up.module.bias)
            bias = None if biases[0] is None else torch.cat(biases).detach()
            y, scale = ops.dequant_swiglu_quant(acc, w_scale, x_scale, bias, self.inv_smooth, activate_left=True,
                                                backend=site.call.backend, stats=site.stats)
            if not torch.compiler.is_compiling():  # a counter read inside a graph is a guard: eager calls only
                gate.handed_over += 1
                up.handed_over += 1
                self.int32_calls += 1
            return module.down_proj(self.hand_over(y, scale, x.dtype))
        gate, up = module.gate_proj(x), module.up_proj(x)
        q, scale = ops.swiglu_dynamic_quant(gate, up, self.inv_smooth, cast_mode=site.cast_mode,
                                            backend=site.call.backend, stats=site.stats)
        return module.down_proj(self.hand_over(q, scale, gate.dtype))


def _provides_int32_gemm(backend: str, device_type: str) -> bool:
    """Whether the backend a site's calls go to on this device implements the merged int32 GEMM (the cpu backend, and
    torch's golden), decided by the op's registrations rather than the device type: the npu mapping on CPU tensors
    (the contract tests' whole models) runs two npu_quant_matmul calls as on an NPU. Kept per registry generation:
    an MLP asks on every call."""
    return _int32_gemm_served(backend, device_type, registry.GENERATION[0])


@functools.lru_cache(maxsize=32)
def _int32_gemm_served(backend: str, device_type: str, generation: int) -> bool:
    candidates = registry.candidates(backend, device_type)
    return bool(candidates) and (candidates[0] is registry.TORCH or candidates[0].family in ops.OPS["int32_gemm"].impls)
