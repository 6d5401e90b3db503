"""patch_model / unpatch_model / patched / patch_report: the public face of patching (SPEC 3, 9).

patch_model applies every site rule (site.RULES: norms, and the rules registered after them) to the
model: each rule's candidates are classified (structure + probe), selected by `sites=`, and the
selected ones become sites (on the cpu backend with their bf16 linears' bias added in the GEMM's epilogue,
gemm.py); then layer rewrites (residual.py) fuse what spans several modules, and a
quantisation mode (registered by pypto_gym.quant) turns linears into int8 linears. Everything is
recorded in a PatchState kept on the model, which unpatch_model undoes exactly.
"""
from __future__ import annotations

import contextlib
import warnings

import torch

from .. import config
from ..ops import registry
from . import gemm, residual
from .options import QUANT_MODES, PatchConfig
from .report import PatchReport
from .site import RULES, Site, execution_device, selected, site_of

_STATE_ATTR = "_pypto_gym_patch"


class PatchError(ValueError):
    """patch_model refused: the model is already patched differently, or part of it is."""


class NoSitesError(PatchError):
    """A `sites` selection (the argument, or $PYPTO_GYM_SITES) that matches none of the model's sites."""

    def __init__(self, patterns, source: str, candidates: int, kinds, declined: dict | None = None):
        self.patterns, self.source, self.candidates, self.kinds = list(patterns), source, candidates, sorted(kinds)
        self.declined = dict(declined or {})  # kind -> why the sites of that kind the selection names cannot be patched
        super().__init__(self.describe(source))

    def describe(self, source: str) -> str:
        if self.declined:  # it names sites, none of which can be patched as selected: say what they need
            why = "; ".join(f"{kind}: {reason}" for kind, reason in sorted(self.declined.items()))
            return (f"{source}: {','.join(self.patterns)!r} selects sites none of which can be patched as selected "
                    f"({why}); nothing was patched")
        return (f"{source}: {','.join(self.patterns)!r} matched none of the {self.candidates} sites of this model "
                f"(kinds here: {', '.join(self.kinds)}); nothing was patched")


class PatchState:
    """What patch_model did to one model, kept on the model so unpatch can undo exactly that."""

    def __init__(self, options: PatchConfig):
        self.options = options
        self.entries: list = []  # Site (patched) or dict (skipped row), in discovery order
        self.layers: list[residual.FusedLayer] = []
        self.fusion_skipped: list[dict] = []
        self.unavailable: dict[str, str] = {}  # device type -> why its backend cannot run (said at patch time)
        self.quant = None  # what the quantisation mode installed (uninstall(), to_json())

    @property
    def sites(self) -> list[Site]:
        return [e for e in self.entries if isinstance(e, Site)]

    def sites_of(self, rule_name: str) -> list[Site]:
        return [s for s in self.sites if s.rule == rule_name]

    @staticmethod
    def enabled() -> bool:
        return config.is_enabled()


def _refuse_nested(model) -> None:
    """A model containing another patch (inner model patched first) or contained in one (outer first)."""
    for path, module in model.named_modules():
        if path and _STATE_ATTR in module.__dict__:
            opts = module.__dict__[_STATE_ATTR].options
            raise PatchError(f"patch_model: submodule {path!r} is already patched ({opts.describe()}); "
                             f"unpatch_model(model.get_submodule({path!r})) first, or patch only one of the two")
        site = site_of(module)
        if site is not None:
            raise PatchError(f"patch_model: {path or 'the model'} is a {site.kind} site already patched as "
                             f"{site.path!r} by patch_model on a model that contains this one; unpatch that model first")


def _say_unavailable(state: PatchState) -> None:
    """A backend that cannot build/load is reported once, loudly, at patch time (raised when strict)."""
    # a meta parameter holds no data (an int8 linear loaded from a checkpoint, a released float weight): skipped
    devices = {execution_device(s.module, next((p for p in s.module.parameters() if not p.is_meta), torch.empty(0)))
               for s in state.sites}
    for device_type in sorted(devices):
        reason = registry.prepare(state.options.backend, device_type)  # builds/loads kernels now
        if reason is None:
            continue
        state.unavailable[device_type] = reason
        message = (f"pypto-gym: backend {state.options.backend!r} cannot run on {device_type}: {reason}; "
                   f"every call there will fall back to torch")
        if state.options.strict or (state.options.strict is None and config.is_strict()):
            raise RuntimeError(message + " (strict mode)")
        warnings.warn(message, RuntimeWarning, stacklevel=3)  # printed once, on stderr


def patch_model(model: torch.nn.Module, backend: str | None = None, sites=None, fuse_residual: bool | None = None,
                cast_mode: str = "hf", quant: str | None = None, calibration=None,
                strict: bool | None = None, float_linears=None, release_float_weights: bool = False,
                int8_lm_head: bool = False) -> PatchReport:
    """Swap every site of `model` (RMSNorms, SwiGLU MLPs, rotary embeddings) for the fused ops; returns
    the live report.

    backend: "auto" (default, or $PYPTO_GYM_BACKEND), "torch", "cpu", "npu" or "pypto".
    sites: globs over kinds or paths ("text.*,vision.merger.ln_q", "!*.mlp" excludes, or a list); None =
      $PYPTO_GYM_SITES, else every site. A selection that matches no site is refused (NoSitesError).
    fuse_residual: also fuse `residual + h` into the following norm where the layer is recognised
      (None = $PYPTO_GYM_FUSE_RESIDUAL, else True).
    cast_mode: the norms' cast mode ("hf", bit-identical to HF on `torch`; "fp32"; "none").
    quant: "w8a8" also turns the model's linears into int8 linears fed by the fused quant ops
      (pypto_gym.quant); None (default) keeps them float.
    calibration: with quant, a smooth-scale file from `pypto-gym calibrate` (SmoothQuant); without one,
      no smoothing (the report says so).
    float_linears: with quant, globs over linear kinds or paths ("text.o_proj,vision.proj", or a list) kept
      in the model dtype; the linears reading one norm's or MLP's rows stay float together.
    release_float_weights: with quant, a deployment: the int8 linears drop their float weights (the memory is
      returned; a weight shared with another module, a tied lm_head's, stays); unpatch_model and the switch
      are then refused for them.
    int8_lm_head: with quant, lm_head int8 too (it quantises the rows it reads). Off by default: vLLM and
      vllm-ascend serve a compressed-tensors checkpoint's lm_head float (ParallelLMHead is not quantised), so
      that is what W8A8 runs and exports unless asked (vllm-ascend does load an msModelSlim W8A8_DYNAMIC one).
    strict: this patch's sites raise instead of falling back (None: the process-wide switch).
    Patching an already patched model with the same options returns its report and changes
    nothing; with other options it raises (unpatch first). A model that contains a patched
    model, or is part of one, is refused with the other patch named.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: got {type(model).__name__}; expected a torch.nn.Module")
    config.STATE.load()
    options = PatchConfig.make(backend, sites, fuse_residual, cast_mode, quant, calibration, strict, float_linears,
                               release_float_weights, int8_lm_head)
    existing = model.__dict__.get(_STATE_ATTR)
    if existing is not None:
        if not existing.options.same(options):
            raise PatchError(f"patch_model: model is already patched with {existing.options.describe()}; got "
                             f"{options.describe()}. Call unpatch_model(model) first to patch it differently.")
        return PatchReport(existing)
    _refuse_nested(model)
    state = PatchState(options)
    found = [c for rule in RULES for c in rule.candidates(model, options)]
    if options.sites and not any(not c.reason and selected(c, options.sites) for c in found):
        declined = {c.kind: c.reason for c in found if c.reason and selected(c, options.sites)}
        raise NoSitesError(options.sites, options.sites_from, len(found), {c.kind for c in found}, declined)
    try:
        for cand in found:
            if cand.reason:
                state.entries.append(cand.row(cand.reason))
            elif not selected(cand, options.sites):
                state.entries.append(cand.row(f"not selected by sites={','.join(options.sites)}"))
            else:
                site = cand.rule.install(cand, options)
                site.rule = cand.rule.name
                site.linears = gemm.install(site, cand.rule.linears, options)
                state.entries.append(site)
        _say_unavailable(state)
        if quant is not None:
            state.quant = QUANT_MODES[quant](model, state)
        if options.fuse_residual:
            state.fusion_skipped += residual.fuse_layers(model, state.layers)
    except BaseException:
        _undo(state)
        raise
    model.__dict__[_STATE_ATTR] = state
    return PatchReport(state)


def _undo(state: PatchState) -> None:
    if state.quant is not None:
        state.quant.uninstall()
    for layer in state.layers:
        layer.uninstall()
    for site in state.sites:
        site.uninstall()
        for linear in site.linears:
            linear.uninstall()


def unpatch_model(model: torch.nn.Module) -> None:
    """Restore every patched module and layer forward exactly; a no-op on an unpatched model."""
    state = model.__dict__.get(_STATE_ATTR)
    if state is None:
        return
    if state.quant is not None:
        refusal = getattr(state.quant, "unpatch_refusal", lambda: None)()
        if refusal:
            raise PatchError(f"unpatch_model: {refusal}")
    model.__dict__.pop(_STATE_ATTR)
    _undo(state)


def patch_options(model: torch.nn.Module) -> PatchConfig | None:
    """The options `model` is patched with (None if it is not patched)."""
    state = model.__dict__.get(_STATE_ATTR)
    return None if state is None else state.options


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
