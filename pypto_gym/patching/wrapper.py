"""The per-site wrapper: a norm module's forward swapped for the fused op, in place.

Nothing about the module changes but its instance `forward`: same class, same Parameter object
(state_dict keys and `save_pretrained` output unchanged), same torch hooks. If accelerate has
already wrapped the forward (device_map / offload), its inner `_old_forward` is swapped instead,
so its hooks keep moving weights and activations. The wrapped forward also takes an optional
`residual`: a fused decoder layer calls `norm(h, residual=r)` and gets `(norm(r + h), r + h)`.
"""
from __future__ import annotations

import types

import torch

from .. import ops
from ..ops.registry import Stats
from . import switch

_SLOT = "_pypto_gym_site"


class Site:
    """One patched norm: where it is, how it runs, and its live counters."""

    def __init__(self, path, kind, module, eps, backend, cast_mode):
        self.path, self.kind, self.module, self.eps = path, kind, module, eps
        self.backend, self.cast_mode = backend, cast_mode
        self.stats = Stats()
        self.fused = False
        self._attr = "_old_forward" if "_old_forward" in module.__dict__ else "forward"
        self._saved = module.__dict__.get(self._attr)  # accelerate's inner forward, or None
        self.original_forward = self._saved if self._saved is not None else module.forward

    def install(self) -> None:
        setattr(self.module, self._attr, types.MethodType(patched_forward, self.module))
        setattr(self.module, _SLOT, self)

    def uninstall(self) -> None:
        if self._saved is None:
            self.module.__dict__.pop(self._attr, None)
        else:
            setattr(self.module, self._attr, self._saved)
        self.module.__dict__.pop(_SLOT, None)

    def row(self) -> dict:
        w = self.module.weight
        return {"path": self.path, "kind": self.kind, "status": "patched", "reason": "",
                "backend": self.stats.backend or self.backend, "D": int(w.shape[0]), "eps": self.eps,
                "dtype": str(w.dtype).replace("torch.", ""), "device": str(w.device), "fused_residual": self.fused,
                "calls": self.stats.calls, "fallbacks": dict(self.stats.fallbacks)}


def patched_forward(self, hidden_states, residual=None):
    """The forward of every patched norm. State comes from the module's own Site, not a closure,
    so a deep-copied patched model gets its own counters and its own original forward."""
    site = self.__dict__[_SLOT]
    if not switch._enabled:
        if residual is None:
            return site.original_forward(hidden_states)
        x_out = residual + hidden_states
        return site.original_forward(x_out), x_out
    if residual is None:
        return ops.rms_norm(hidden_states, self.weight, site.eps, cast_mode=site.cast_mode, backend=site.backend,
                            stats=site.stats)
    return ops.add_rms_norm(residual, hidden_states, self.weight, site.eps, cast_mode=site.cast_mode,
                            backend=site.backend, stats=site.stats)


def site_of(module: torch.nn.Module) -> Site | None:
    return module.__dict__.get(_SLOT)
