"""QuantNorm: a patched norm in W8A8 mode, emitting int8 rows for the linears after it."""
from __future__ import annotations

import torch

from .. import ops
from ..patching.site import has_hooks
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
        self.consumer_modules: list[torch.nn.Module] = []
        self.bypassed: dict[str, int] = {}

    def row(self) -> dict:
        return {"int8_to": list(self.consumers), "smoothed": self.inv_smooth is not None,
                "bypassed": dict(self.bypassed)}

    def _count(self, reason: str) -> None:
        self.bypassed[reason] = self.bypassed.get(reason, 0) + 1

    def forward(self, site, module, x, residual=None):
        """rms_norm_dynamic_quant (or add_rms_norm_dynamic_quant with `residual`) on the site's backend;
        returns the norm's output as QuantRows for the consumers, or as a float tensor where a hand-over
        could not be exact (hooks on the norm or a consumer see and may change a real float tensor)."""
        w = module._parameters["weight"]
        if x.dtype is not w.dtype or (residual is not None and residual.dtype is not x.dtype):
            self._count(f"activations are {x.dtype}, the norm weight {w.dtype}: ran as a float norm")
            if residual is None:
                return site.call(x, w)
            return site.add_call(residual, x, w)
        backend, stats = site.call.backend, site.stats
        if residual is None:
            q, scale = ops.rms_norm_dynamic_quant(x, w, self.inv_smooth, None, site.eps, backend=backend, stats=stats)
        else:
            q, _, x_out, scale, _ = ops.add_rms_norm_dynamic_quant(residual, x, w, self.inv_smooth, None, None,
                                                                   site.eps, backend=backend, stats=stats)
        y = activations.issue(q, scale, self.smooth, x.dtype, self)
        if torch.compiler.is_compiling():
            y = y.value()  # a traced graph carries plain tensors
        elif has_hooks(module) or any(has_hooks(m) for m in self.consumer_modules):
            self._count("hooks on the norm or a consumer: float rows handed on")
            y = y.value()
        return y if residual is None else (y, x_out)
