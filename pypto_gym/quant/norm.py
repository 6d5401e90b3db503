"""QuantNorm: a patched norm in W8A8 mode, emitting int8 rows for the linears after it.

Dynamic scheme: rms_norm_dynamic_quant (per-row scales, the smooth scale an argument of the fused op).
Static scheme: rms_norm_quant under the producer's static scale and offset; torch_npu's static norm + quant
has no smooth scale, so the smooth scale is folded into the norm weight as a checkpoint holds it
(gamma * 1/s, rounded once to the weight's dtype: export/ writes these same values)."""
from __future__ import annotations

from .. import ops
from . import activations


class QuantNorm(activations.Producer):
    """The W8A8 half of one patched norm site (its Site keeps the path, eps, backend and counters); its
    smooth scale is in the weight's dtype, as torch_npu's fused norm + quant takes it."""

    def forward(self, site, module, x, residual=None):
        """rms_norm_dynamic_quant (or add_rms_norm_dynamic_quant with `residual`) on the site's backend;
        returns the norm's output handed over to the consumers (activations.Producer.hand_over)."""
        w = module._parameters["weight"]
        if x.dtype is not w.dtype or (residual is not None and residual.dtype is not x.dtype):
            self.count(f"activations are {x.dtype}, the norm weight {w.dtype}: ran as a float norm")
            if residual is None:
                return site.call(x, w)
            return site.add_call(residual, x, w)
        backend, stats = site.call.backend, site.stats
        if self.static is not None:
            scale, offset = self.static
            g = w if self.inv_smooth is None else (w.float() * self.inv_smooth.float()).to(w.dtype)
            if residual is None:
                q = ops.rms_norm_quant(x, g, scale, offset, None, site.eps, backend=backend, stats=stats)
            else:
                q, x_out = ops.add_rms_norm_quant(residual, x, g, scale, offset, None, site.eps, backend=backend,
                                                  stats=stats)
            y = self.hand_over(q, None, x.dtype, module)
            return y if residual is None else (y, x_out)
        if residual is None:
            q, scale = ops.rms_norm_dynamic_quant(x, w, self.inv_smooth, None, site.eps, backend=backend, stats=stats)
        else:
            q, _, x_out, scale, _ = ops.add_rms_norm_dynamic_quant(residual, x, w, self.inv_smooth, None, None,
                                                                   site.eps, backend=backend, stats=stats)
        y = self.hand_over(q, scale, x.dtype, module)
        return y if residual is None else (y, x_out)
