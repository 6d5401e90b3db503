"""QuantMlp: a patched SwiGLU MLP in W8A8 mode, handing its activation to an int8 down_proj as int8 rows.

gate_proj and up_proj are int8 linears fed by the norm before the MLP (plan.py); between them and
down_proj, `swiglu_dynamic_quant` computes silu(gate) * up, multiplies it by the calibrated smooth
scale and quantises it per row in one pass, so down_proj reads int8 rows and no [tokens, I] float
activation is written. Its smooth scale is fp32, as torch_npu's npu_swiglu_quant takes it.
"""
from __future__ import annotations

from .. import ops
from . import activations


class QuantMlp(activations.Producer):
    """The W8A8 half of one patched MLP site (its Site keeps the path, cast mode, backend and counters)."""

    def forward(self, site, module, x):
        gate, up = module.gate_proj(x), module.up_proj(x)
        q, scale = ops.swiglu_dynamic_quant(gate, up, self.inv_smooth, cast_mode=site.cast_mode,
                                            backend=site.call.backend, stats=site.stats)
        return module.down_proj(self.hand_over(q, scale, gate.dtype))
