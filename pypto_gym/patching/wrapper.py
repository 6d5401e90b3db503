"""The per-site wrapper: a norm module's forward swapped for the fused op, in place.

Nothing about the module changes but its instance `forward` (swap.py): same class, same Parameter
object (state_dict keys and `save_pretrained` output unchanged), same torch hooks, and a patched
model pickles, deep-copies and `torch.save`s like any model; its state is the module's own `Site`.

A fused layer (fusion.py) calls `add_norm(norm, hidden, residual)` where the original did
`residual + hidden` and then `norm(...)`. It runs one `add_rms_norm`, unless fusing would not be
exactly the original: the norm has torch hooks (they must see one tensor in, the normalised
input, and one tensor out), or the add would promote or broadcast (a float32 residual stream).
Then it adds and calls the norm normally, and counts the bypass and its reason for the report.
"""
from __future__ import annotations

import torch
from torch.nn.modules import module as _nn_module

from .. import config, ops
from ..ops.dispatch import Stats
from .swap import SwappedForward

_SLOT = "_pypto_gym_site"
_STATE = config.STATE  # the master switch, read on every call


class Site(SwappedForward):
    """One patched norm: where it is (every path it is reachable by), how it runs, live counters."""

    SLOT = _SLOT

    def __init__(self, paths, kind, module, eps, backend, cast_mode):
        super().__init__(module)
        self.paths, self.kind, self.eps = list(paths), kind, eps
        self.requested_backend = backend
        self.call = ops.BoundNorm(module.weight, eps, cast_mode, backend, Stats())  # what every call runs
        self.fused = False
        self.bypassed: dict[str, int] = {}  # fused calls that ran unfused, by reason
        self.quant = None  # a quant.norm.QuantNorm in W8A8 mode: the norm emits int8 rows for its linears

    def __setstate__(self, state):  # unpickled in a new process: read the switches before the first call
        self.__dict__.update(state)
        config.STATE.load()

    @property
    def path(self) -> str:
        return self.paths[0]

    @property
    def stats(self) -> Stats:
        return self.call.stats

    def row(self) -> dict:
        w = self.module.weight
        stats = self.stats
        return {"path": self.path, "paths": list(self.paths), "kind": self.kind, "status": "patched", "reason": "",
                "backend": stats.backend or self.requested_backend, "requested_backend": self.requested_backend,
                "D": int(w.shape[0]),
                "eps": self.eps, "dtype": str(w.dtype).replace("torch.", ""), "device": str(w.device),
                "fused_residual": self.fused, "fusion_bypassed": dict(self.bypassed),
                "quant": None if self.quant is None else {"int8_to": list(self.quant.consumers),
                                                          "smoothed": self.quant.inv_smooth is not None,
                                                          "bypassed": dict(self.quant.bypassed)},
                "calls": stats.calls,
                "ran_on": dict(stats.ran), "fallbacks": dict(stats.fallbacks)}


def patched_forward(module, hidden_states, residual=None):
    """The forward of every patched norm; with `residual`, returns (norm(residual + h), residual + h)."""
    site = module.__dict__[_SLOT]
    if _STATE.enabled:
        if site.quant is not None:
            return site.quant.forward(site, module, hidden_states, residual)
        if residual is None:
            return site.call.rms_norm(hidden_states, module._parameters["weight"])
        return site.call.add_rms_norm(residual, hidden_states, module._parameters["weight"])
    if residual is None:
        return site.original(hidden_states)
    x_out = residual + hidden_states
    return site.original(x_out), x_out


def has_hooks(module: torch.nn.Module) -> bool:
    """True when calling the module's forward directly would skip a torch hook someone registered."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or _nn_module._global_forward_hooks
                or _nn_module._global_forward_pre_hooks or _nn_module._global_backward_hooks
                or _nn_module._global_backward_pre_hooks)


def _bypass_reason(norm, hidden, residual) -> str | None:
    if has_hooks(norm):
        return "the norm has hooks"
    if not isinstance(residual, torch.Tensor) or residual.dtype != hidden.dtype or residual.shape != hidden.shape:
        return "the residual add promotes or broadcasts"
    return None


def add_norm(norm: torch.nn.Module, hidden, residual):
    """`x_out = residual + hidden; return norm(x_out), x_out`, as one fused op where that is exactly the same."""
    site = norm.__dict__.get(_SLOT)
    reason = "the norm is not patched" if site is None else _bypass_reason(norm, hidden, residual)
    if reason is None:
        return norm.forward(hidden, residual=residual)
    if site is not None:
        site.bypassed[reason] = site.bypassed.get(reason, 0) + 1
    x_out = residual + hidden
    return norm(x_out), x_out


Site.FORWARD = patched_forward


def site_of(module: torch.nn.Module) -> Site | None:
    return module.__dict__.get(_SLOT)
