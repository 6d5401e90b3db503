"""QuantNorm: a patched norm in W8A8 mode, emitting int8 rows for the linears after it."""
from __future__ import annotations

import torch

from .. import ops
from . import activations


class QuantNorm:
    """The W8A8 half of one patched norm site (its Site keeps the path, eps, backend and counters).

    `inv_smooth` is what the fused quant op multiplies the normalised rows by (1/s of SmoothQuant,
    in the weight's dtype, as torch_npu's smooth scales are) or None without calibration.
    """

    def __init__(self, inv_smooth: torch.Tensor | None):
        self.inv_smooth = inv_smooth
        # the s the int8 rows are scaled back by, and the consumers' weights scaled by: exactly 1/inv_smooth
        self.smooth = None if inv_smooth is None else 1.0 / inv_smooth.float()
        self.consumers: list[str] = []
        self.bypassed: dict[str, int] = {}

    def forward(self, site, module, x, residual=None):
        """rms_norm_dynamic_quant (or add_rms_norm_dynamic_quant with `residual`) on the site's backend;
        returns the float rows the int8 rows stand for, handed over to the consumers."""
        w = module._parameters["weight"]
        call = site.call
        if x.dtype is not w.dtype or (residual is not None and residual.dtype is not x.dtype):
            reason = f"activations are {x.dtype}, the norm weight {w.dtype}: ran as a float norm"
            self.bypassed[reason] = self.bypassed.get(reason, 0) + 1
            if residual is None:
                return call.rms_norm(x, w)
            return call.add_rms_norm(residual, x, w)
        if residual is None:
            q, scale = ops.rms_norm_dynamic_quant(x, w, self.inv_smooth, None, site.eps, backend=call.backend,
                                                  stats=call.stats)
        else:
            q, _, x_out, scale, _ = ops.add_rms_norm_dynamic_quant(residual, x, w, self.inv_smooth, None, None,
                                                                   site.eps, backend=call.backend, stats=call.stats)
        y = q.to(torch.float32) * scale.unsqueeze(-1)
        y = (y if self.smooth is None else y * self.smooth).to(x.dtype)
        if not torch.compiler.is_compiling():
            activations.issue(y, q, scale, self)
        return y if residual is None else (y, x_out)
