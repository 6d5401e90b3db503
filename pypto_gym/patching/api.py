"""patch_model / unpatch_model / patched / patch_report: the public face of patching (SPEC 3)."""
from __future__ import annotations

import contextlib

import torch

from ..ops import registry, validation
from . import discovery, fusion, switch
from .report import PatchReport
from .wrapper import Site, site_of

_STATE_ATTR = "_pypto_gym_patch"


class PatchState:
    """What patch_model did to one model, kept on the model so unpatch can undo exactly that."""

    def __init__(self, backend, cast_mode, fuse_residual, patterns):
        self.backend, self.cast_mode, self.fuse_residual, self.patterns = backend, cast_mode, fuse_residual, patterns
        self.entries: list = []  # Site (patched) or dict (skipped row), in discovery order
        self.layers: list[fusion.FusedLayer] = []
        self.fusion_skipped: list[dict] = []

    @property
    def sites(self) -> list[Site]:
        return [e for e in self.entries if isinstance(e, Site)]

    @staticmethod
    def enabled() -> bool:
        return switch.is_enabled()


def _skipped_row(c: discovery.Candidate, reason: str) -> dict:
    w = c.module.weight
    return {"path": c.path, "kind": c.kind, "status": "skipped", "reason": reason, "backend": None,
            "D": int(w.shape[0]), "eps": c.eps, "dtype": str(w.dtype).replace("torch.", ""), "device": str(w.device),
            "fused_residual": False, "calls": 0, "fallbacks": {}}


def _fuse_layers(model, state: PatchState) -> None:
    """Rewrite every layer that has patched norm children and a recognised residual pattern."""
    for path, module in model.named_modules():
        norms = frozenset(name for name, child in module.named_children() if site_of(child) is not None)
        if not norms:
            continue
        fn, fused, reason = fusion.fused_forward(type(module), norms)
        if fn is None:
            kinds = {site_of(getattr(module, n)).kind for n in norms}
            if kinds & {"text.post_attention_layernorm", "vision.norm2"}:
                state.fusion_skipped.append({"path": path, "reason": reason})
            continue
        layer = fusion.FusedLayer(path, module, fused)
        layer.install(fn)
        state.layers.append(layer)
        for name in fused:
            site_of(getattr(module, name)).fused = True


def patch_model(model: torch.nn.Module, backend: str | None = None, sites=None, fuse_residual: bool = True,
                cast_mode: str = "hf") -> PatchReport:
    """Swap every RMSNorm site of `model` for the fused op; returns the live report.

    backend: "auto" (default, or $PYPTO_GYM_BACKEND), "torch", "cpu", "npu" or "pypto".
    sites: globs over kinds or paths ("text.*,vision.merger.ln_q"); None = every site.
    fuse_residual: also fuse `residual + h` into the following norm where the layer is recognised.
    Patching an already patched model returns its existing report and changes nothing.
    """
    existing = getattr(model, _STATE_ATTR, None)
    if existing is not None:
        return PatchReport(existing)
    backend = registry.default_backend() if backend is None else backend
    registry.get(backend) if backend != "auto" else None  # unknown name -> ValueError naming `backend`
    if cast_mode not in validation.CAST_MODES:
        raise ValueError(f"cast_mode: got {cast_mode!r}; expected one of 'hf', 'fp32'")
    patterns = discovery.parse_sites(sites)
    state = PatchState(backend, cast_mode, fuse_residual, patterns)
    for cand in discovery.find_candidates(model):
        if not cand.is_rms:
            state.entries.append(_skipped_row(cand, cand.reason))
        elif not discovery.selected(cand, patterns):
            state.entries.append(_skipped_row(cand, f"not selected by sites={','.join(patterns)}"))
        else:
            site = Site(cand.path, cand.kind, cand.module, cand.eps, backend, cast_mode)
            site.install()
            state.entries.append(site)
    for device_type in {site.module.weight.device.type for site in state.sites}:
        registry.prepare(backend, device_type)  # build/load kernels now, not in the first forward
    if fuse_residual:
        _fuse_layers(model, state)
    object.__setattr__(model, _STATE_ATTR, state)
    return PatchReport(state)


def unpatch_model(model: torch.nn.Module) -> None:
    """Restore every patched module and layer forward exactly; a no-op on an unpatched model."""
    state = model.__dict__.pop(_STATE_ATTR, None)
    if state is None:
        return
    for layer in state.layers:
        layer.uninstall()
    for site in state.sites:
        site.uninstall()


def patch_report(model: torch.nn.Module) -> PatchReport | None:
    """The live report of a patched model (None if it is not patched)."""
    state = getattr(model, _STATE_ATTR, None)
    return None if state is None else PatchReport(state)


@contextlib.contextmanager
def patched(model: torch.nn.Module, **kwargs):
    """Patch for the duration of a `with` block; unpatched on exit (also on exception)."""
    already = getattr(model, _STATE_ATTR, None) is not None
    report = patch_model(model, **kwargs)
    try:
        yield report
    finally:
        if not already:
            unpatch_model(model)
