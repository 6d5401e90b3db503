"""QuantGeluMlp: a patched GELU MLP in W8A8 mode, handing its activation to its int8 second linear as int8 rows.

fc1 runs as its module (an int8 linear quantising its own input, or a float one `float_linears` keeps); the GELU and
the quantisation of its output are one op, `gelu_dynamic_quant` (per-row scales) or, in the static scheme,
`gelu_quant` under fc2's calibrated static scale and offset; fc2, an int8 linear fed by this producer, reads the rows
as they are. Without it fc2 quantises the GELU's output itself: the [tokens, I] activation written by the GELU and
read back by dynamic_quant. fc2 is not smoothed (nothing writes its input that a scale could fold into: fold.py), so
the rows stand for the activation alone; calibration keeps fc2's range under fc2's own path, as for a linear that
quantises its own input, so a calibration file and an export are the same with or without this producer.
"""
from __future__ import annotations

from .. import ops
from ..patching.rules.gelu_mlp import regrouped
from ..patching.site import has_hooks
from . import activations


class QuantGeluMlp(activations.Producer):
    """The W8A8 half of one patched GELU MLP site (its Site keeps the path, the GELU's form, fc1, fc2 and a merger's
    norm)."""

    def forward(self, site, module, x):
        if site.act is not None and has_hooks(site.act):
            self.count("hooks on the activation module: the module's forward runs")
            return site.original(x)
        if site.norm is not None:
            x = regrouped(site.norm, site.norm_width, x, site.fc1)
        h = site.fc1(x)
        approximate, backend, stats = site.approximate, site.call.backend, site.stats
        if self.static is not None:
            q = ops.gelu_quant(h, *self.static, self.inv_smooth, approximate=approximate, backend=backend,
                               stats=stats)
            return site.fc2(self.hand_over(q, None, h.dtype))
        q, scale = ops.gelu_dynamic_quant(h, self.inv_smooth, approximate=approximate, backend=backend, stats=stats)
        return site.fc2(self.hand_over(q, scale, h.dtype))
