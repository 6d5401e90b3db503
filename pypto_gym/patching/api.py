"""patch_model / unpatch_model / patched / patch_report: the public face of patching (SPEC 3)."""
from __future__ import annotations

import contextlib
import warnings

import torch

from .. import config
from ..quant import plan as w8a8
from ..ops import registry, validation
from . import discovery, fusion
from .report import PatchReport
from .wrapper import Site, site_of

_STATE_ATTR = "_pypto_gym_patch"


class PatchError(ValueError):
    """patch_model refused: the model is already patched differently, or part of it is."""


class NoSitesError(PatchError):
    """A `sites` selection (the argument, or $PYPTO_GYM_SITES) that matches none of the model's sites."""

    def __init__(self, patterns, source: str, candidates: int, kinds):
        self.patterns, self.source, self.candidates, self.kinds = list(patterns), source, candidates, sorted(kinds)
        super().__init__(self.describe(source))

    def describe(self, source: str) -> str:
        return (f"{source}: {','.join(self.patterns)!r} matched none of the {self.candidates} sites of this model "
                f"(kinds here: {', '.join(self.kinds)}); nothing was patched")


def default_sites():
    """$PYPTO_GYM_SITES, parsed (None when unset): the default of `sites=` here and in the scripts."""
    return discovery.parse_sites(config.env_text("PYPTO_GYM_SITES"), "PYPTO_GYM_SITES")


def default_fuse_residual() -> bool:
    """$PYPTO_GYM_FUSE_RESIDUAL (default on): the default of `fuse_residual=` here and in the scripts."""
    return config.env_bool("PYPTO_GYM_FUSE_RESIDUAL", True)


class PatchState:
    """What patch_model did to one model, kept on the model so unpatch can undo exactly that."""

    def __init__(self, options: dict):
        self.options = options  # backend, sites (normalised globs), fuse_residual, cast_mode, quant, calibration
        self.entries: list = []  # Site (patched) or dict (skipped row), in discovery order
        self.layers: list[fusion.FusedLayer] = []
        self.fusion_skipped: list[dict] = []
        self.unavailable: dict[str, str] = {}  # device type -> why its backend cannot run (said at patch time)
        self.quant: w8a8.QuantPlan | None = None

    @property
    def sites(self) -> list[Site]:
        return [e for e in self.entries if isinstance(e, Site)]

    @staticmethod
    def enabled() -> bool:
        return config.is_enabled()


def _skipped_row(c: discovery.Candidate, reason: str) -> dict:
    w = c.module.weight
    return {"path": c.path, "paths": c.paths, "kind": c.kind, "status": "skipped", "reason": reason, "backend": None,
            "D": int(w.shape[0]), "eps": c.eps, "dtype": str(w.dtype).replace("torch.", ""), "device": str(w.device),
            "fused_residual": False, "calls": 0, "fallbacks": {}}


def _options(backend, sites, fuse_residual, cast_mode, quant_mode=None, calibration=None) -> dict:
    """The validated patch options; every refusal names the argument. None means the process default
    ($PYPTO_GYM_BACKEND, $PYPTO_GYM_SITES, $PYPTO_GYM_FUSE_RESIDUAL)."""
    sites = default_sites() if sites is None else discovery.parse_sites(sites)
    fuse_residual = default_fuse_residual() if fuse_residual is None else fuse_residual
    if quant_mode is not None and quant_mode not in w8a8.MODES:
        raise ValueError(f"quant: got {quant_mode!r}; expected None or one of {', '.join(map(repr, w8a8.MODES))}")
    if calibration is not None and quant_mode is None:
        raise ValueError("calibration: given without quant='w8a8'; smooth scales only apply to int8 linears")
    backend = registry.default_backend() if backend is None else registry.check_name(backend)
    if not isinstance(fuse_residual, bool):
        raise TypeError(f"fuse_residual: got {fuse_residual!r} ({type(fuse_residual).__name__}); expected True or False")
    if cast_mode not in validation.CAST_MODES:
        raise ValueError(f"cast_mode: got {cast_mode!r}; expected one of {', '.join(map(repr, validation.CAST_MODES))}")
    return {"backend": backend, "sites": sites, "fuse_residual": fuse_residual,
            "cast_mode": cast_mode, "quant": quant_mode, "calibration": None if calibration is None else str(calibration)}


def _refuse_nested(model) -> None:
    """A model containing another patch (inner model patched first) or contained in one (outer first)."""
    for path, module in model.named_modules():
        if path and _STATE_ATTR in module.__dict__:
            opts = module.__dict__[_STATE_ATTR].options
            raise PatchError(f"patch_model: submodule {path!r} is already patched ({_describe(opts)}); "
                             f"unpatch_model(model.get_submodule({path!r})) first, or patch only one of the two")
        site = site_of(module)
        if site is not None:
            raise PatchError(f"patch_model: {path or 'the model'} is a norm already patched as {site.path!r} by "
                             f"patch_model on a model that contains this one; unpatch that model first")


def _describe(options: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in options.items())


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
        layer = fusion.FusedLayer(path, module, norms, fused)
        layer.install()
        state.layers.append(layer)


def _say_unavailable(state: PatchState) -> None:
    """A backend that cannot build/load is reported once, loudly, at patch time (raised when strict)."""
    for device_type in sorted({_execution_device(site.module) for site in state.sites}):
        reason = registry.prepare(state.options["backend"], device_type)  # builds/loads kernels now
        if reason is None:
            continue
        state.unavailable[device_type] = reason
        message = (f"pypto-gym: backend {state.options['backend']!r} cannot run on {device_type}: {reason}; "
                   f"every norm call there will fall back to torch")
        if config.is_strict():
            raise RuntimeError(message + " (strict mode)")
        warnings.warn(message, RuntimeWarning, stacklevel=3)  # printed once, on stderr


def _execution_device(module) -> str:
    """Where the norm computes: accelerate's execution device for offloaded modules, else its weight's device."""
    device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    return torch.device(device).type if device is not None else module.weight.device.type


def patch_model(model: torch.nn.Module, backend: str | None = None, sites=None, fuse_residual: bool | None = None,
                cast_mode: str = "hf", quant: str | None = None, calibration=None) -> PatchReport:
    """Swap every RMSNorm site of `model` for the fused op; returns the live report.

    backend: "auto" (default, or $PYPTO_GYM_BACKEND), "torch", "cpu", "npu" or "pypto".
    sites: globs over kinds or paths ("text.*,vision.merger.ln_q" or a list); None = $PYPTO_GYM_SITES,
      else every site. A selection that matches no site is refused (NoSitesError), nothing patched.
    fuse_residual: also fuse `residual + h` into the following norm where the layer is recognised
      (None = $PYPTO_GYM_FUSE_RESIDUAL, else True).
    quant: "w8a8" also turns the linears that read a patched norm's rows into int8 linears fed by
      the fused norm + dynamic quant ops (pypto_gym.quant); None (default) keeps them float.
    calibration: with quant, a smooth-scale file from scripts/calibrate.py (SmoothQuant); without
      one, no smoothing (the report says so).
    Patching an already patched model with the same options returns its report and changes
    nothing; with other options it raises (unpatch first). A model that contains a patched
    model, or is part of one, is refused with the other patch named.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: got {type(model).__name__}; expected a torch.nn.Module")
    config.STATE.load()
    options = _options(backend, sites, fuse_residual, cast_mode, quant, calibration)
    existing = model.__dict__.get(_STATE_ATTR)
    if existing is not None:
        if existing.options != options:
            raise PatchError(f"patch_model: model is already patched with {_describe(existing.options)}; got "
                             f"{_describe(options)}. Call unpatch_model(model) first to patch it differently.")
        return PatchReport(existing)
    _refuse_nested(model)
    state = PatchState(options)
    patterns = options["sites"]
    candidates = discovery.find_candidates(model)
    if patterns and not any(c.is_rms and discovery.selected(c, patterns) for c in candidates):
        raise NoSitesError(patterns, "sites" if sites is not None else "PYPTO_GYM_SITES", len(candidates),
                           {c.kind for c in candidates})
    for cand in candidates:
        if not cand.is_rms:
            state.entries.append(_skipped_row(cand, cand.reason))
        elif not discovery.selected(cand, patterns):
            state.entries.append(_skipped_row(cand, f"not selected by sites={','.join(patterns)}"))
        else:
            site = Site(cand.paths, cand.kind, cand.module, cand.eps, options["backend"], cast_mode)
            site.install()
            state.entries.append(site)
    try:
        _say_unavailable(state)
        if quant is not None:
            state.quant = w8a8.install(model, state.sites, options["backend"], calibration,
                                       [p for c in candidates if c.is_rms for p in c.paths])
        if options["fuse_residual"]:
            _fuse_layers(model, state)
    except BaseException:
        _undo(state)
        raise
    model.__dict__[_STATE_ATTR] = state
    return PatchReport(state)


def _undo(state: PatchState) -> None:
    if state.quant is not None:
        state.quant.uninstall(state.sites)
    for layer in state.layers:
        layer.uninstall()
    for site in state.sites:
        site.uninstall()


def unpatch_model(model: torch.nn.Module) -> None:
    """Restore every patched module and layer forward exactly; a no-op on an unpatched model."""
    state = model.__dict__.pop(_STATE_ATTR, None)
    if state is not None:
        _undo(state)


def patch_report(model: torch.nn.Module) -> PatchReport | None:
    """The live report of a patched model (None if it is not patched)."""
    state = model.__dict__.get(_STATE_ATTR)
    return None if state is None else PatchReport(state)


@contextlib.contextmanager
def patched(model: torch.nn.Module, **kwargs):
    """Patch for the duration of a `with` block; unpatched on exit (also on exception).

    On a model already patched with the same options it leaves that patch in place on exit.
    """
    already = model.__dict__.get(_STATE_ATTR) is not None
    report = patch_model(model, **kwargs)
    try:
        yield report
    finally:
        if not already:
            unpatch_model(model)
