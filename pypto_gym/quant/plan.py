"""Turn a patched model's linears into W8A8: which producers quantise, which linears go int8.

Producers of int8 rows: the norms, whose consumers are named per model family (models/<family>.py,
w8a8_linears), each name checked against the model (an nn.Linear whose in_features is the norm's D;
a norm none of whose linears is found stays a float norm, with the reason in the report); the
patched SwiGLU MLPs, whose down_proj reads the fused swiglu + quant's rows; and the patched GELU MLPs
(Qwen3-VL's vision tower), whose int8 fc2 reads the fused gelu + quant's rows. The linears whose input
no fused op produces (o_proj, the vision attn.proj, the merger's linears, Qwen3-VL's whole vision tower:
w8a8_own_input) quantise it themselves with `dynamic_quant`, smoothed by their own calibrated scale (where it can
fold into a checkpoint: quant/fold.py), in the parts of the model (text, vision) that have patched norms (RMS or
Layer) or MLPs (SwiGLU or GELU). Every other
linear stays in the model dtype and is listed with why.

Two schemes: "dynamic" (quant="w8a8": per-token activation scales computed at run time, W8A8_DYNAMIC) and
"static" (quant="w8a8_static": msModelSlim's W8A8, one scale and offset per source of rows, fixed from the
calibration file's ranges by calibration.static_params, in the model dtype as the format stores them).

`decide` works all of that out, and checks the calibration file, before anything changes, returning a `Plan`
value; install.py applies it (and undoes it).
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch

from ..kinds import part
from ..patching.rules.gelu_mlp import GeluMlpSite
from ..patching.rules.layer_norm import LayerNormSite
from ..patching.rules.mlp import MlpSite
from ..patching.rules.norm import NormSite
from . import calibration
from .gelu_mlp import QuantGeluMlp
from .linear import STORED_STATIC, linear_kind
from .mlp import QuantMlp
from .norm import QuantNorm
from .topology import linears_after, own_input_linears, w8a8_family


def output_embedding(model):
    """(path, linear) of the model's lm_head (its output embedding, an nn.Linear), or None."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        return None
    return next(((p, m) for p, m in model.named_modules() if m is head), None)


LM_HEAD_FLOAT = ("lm_head stays in the model dtype (the default: vLLM's and vllm-ascend's ParallelLMHead is not "
                 "quantised from a compressed-tensors checkpoint; int8_lm_head=True makes it int8)")


@dataclass
class Producer:
    """A patched norm or MLP whose int8 rows its linears will read."""

    site: object
    linears: list  # [(path, nn.Linear)] reading its rows
    kind: type  # QuantNorm, QuantMlp or QuantGeluMlp
    why: str  # what the report says of its linears' input
    inv_smooth: torch.Tensor | None = None  # 1 / smooth scale, in the row dtype, on the linears' device
    static: tuple | None = None  # static scheme: (scale, offset) in the model dtype


@dataclass
class OwnInput:
    """A linear that quantises its own input (no fused op produces it)."""

    path: str
    linear: torch.nn.Module
    why: str
    inv_smooth: torch.Tensor | None = None
    static: tuple | None = None


@dataclass
class Plan:
    """What W8A8 will do to a patched model, decided (and its calibration checked) before anything changes."""

    scheme: str  # "dynamic" or "static"
    calibration: str | None
    backend: str
    sites: list  # the patched norm and MLP sites
    producers: list = field(default_factory=list)  # [Producer]
    own: list = field(default_factory=list)  # [OwnInput]
    recipe: dict | None = None  # the tuned recipe the calibration file held (quant/tune.py)
    float_reasons: dict = field(default_factory=dict)  # linear path -> why it stays in the model dtype
    skipped_producers: list = field(default_factory=list)  # [{"path", "reason"}]
    calibration_ignored: list = field(default_factory=list)  # the file's entries this patch does not quantise
    release_float_weights: bool = False


def _down_proj(site):
    """([(path, down_proj)], reason) of a patched MLP site: its down_proj, if an nn.Linear reading the I channels."""
    down, I = site.module.down_proj, site.module.gate_proj.weight.shape[0]
    if not isinstance(down, torch.nn.Linear) or down.in_features != I:
        return [], f"{site.path}.down_proj: not an nn.Linear with in_features={I}"
    return [(f"{site.path}.down_proj", down)], ""


def _producer_of(site, found):
    """(width of its rows, dtype of its smooth scale, Producer class, why its consumers read int8) of a site."""
    if isinstance(site, MlpSite):
        return found[0][1].in_features, torch.float32, QuantMlp, f"int8 rows from {site.path} (fused swiglu + quant)"
    w = site.module.weight
    return w.shape[0], w.dtype, QuantNorm, f"int8 rows from {site.path} (fused norm + quant)"


def _kept_float(model, globs) -> set:
    """The paths of the linears `float_linears` names (globs over linear kinds or paths); a glob naming none
    is refused, with the kinds the model has."""
    if not globs:
        return set()
    linears = [(p, linear_kind(p)) for p, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    kept = set()
    for glob in globs:
        hit = {p for p, kind in linears if fnmatch.fnmatchcase(kind, glob) or fnmatch.fnmatchcase(p, glob)}
        if not hit:
            kinds = sorted({kind for _, kind in linears})
            raise ValueError(f"float_linears: {glob!r} matched none of the model's {len(linears)} linears; expected a "
                             f"glob over their kinds ({', '.join(kinds)}) or paths")
        kept |= hit
    return kept


def decide(model, state, scheme: str = "dynamic") -> Plan:
    """The "w8a8" (scheme "dynamic") and "w8a8_static" plan for a patched model: every patched norm with consumer
    linears and every patched SwiGLU MLP produce int8 rows for their linears, the linears after attention quantise
    their own input. A calibration file may cover every norm and MLP of the model, patched or not (a `sites=`
    subset); the static scheme needs one, with ranges (format 4). Raises, naming the problem, before anything
    changes."""
    w8a8_family(model)  # a model of no known family is refused before anything changes
    loaded = any(STORED_STATIC in m.__dict__ for m in model.modules())
    if scheme == "static" and state.options.calibration is None and not loaded:
        raise ValueError("quant='w8a8_static': no calibration given; expected calibration= a file from `pypto-gym "
                         "calibrate` (the static scales and offsets come from its activation ranges)")
    sites = [s for s in state.sites if isinstance(s, (NormSite, MlpSite))]
    backend, calibration_path = state.options.backend, state.options.calibration
    known = [p for e in state.entries for p in (e.paths if isinstance(e, (NormSite, MlpSite)) else
                                                e["paths"] if isinstance(e, dict) and e["op"] in ("rms_norm", "swiglu")
                                                else ())]
    plan = Plan(scheme, None if calibration_path is None else str(calibration_path), backend, sites,
                release_float_weights=state.options.release_float_weights)
    recipe = None if calibration_path is None else calibration.recipe_of(calibration_path)
    globs = state.options.float_linears
    if globs is None and recipe is not None and recipe["float_linears"]:  # a tuned recipe (quant/tune.py)
        globs = tuple(recipe["float_linears"])
    plan.recipe = recipe
    kept = _kept_float(model, globs)
    fed = {}
    for site in sites:
        if isinstance(site, MlpSite):
            found, reason = _down_proj(site)
        else:
            found, missing = linears_after(model, site)
            reason = "; ".join(f"{p}: {r}" for p, r in missing)
        if any(p in kept for p, _ in found):  # one producer's rows: its linears are int8 together or not at all
            why = f"float_linears keeps {', '.join(p for p, _ in found if p in kept)} in the model dtype"
            plan.skipped_producers.append({"path": site.path, "reason": why})
            plan.float_reasons.update({p: f"reads {site.path}'s rows: {why}" for p, _ in found})
        elif found:
            fed[site] = found
        elif reason:
            plan.skipped_producers.append({"path": site.path, "reason": reason})
    # the linears that quantise their own input, in the parts (text, vision) with patched norms or MLPs; lm_head one of
    # them only on request (int8_lm_head), unsmoothed: it reads one row at decode, and what vLLM loads is float
    every_own = own_input_linears(model)
    head = output_embedding(model)
    if head is not None and state.options.int8_lm_head:
        every_own.append(head)
    elif head is not None:
        plan.float_reasons[head[0]] = LM_HEAD_FLOAT
    parts = {part(s.path) for s in state.sites if isinstance(s, (NormSite, MlpSite, LayerNormSite, GeluMlpSite))}
    own = [(p, m) for p, m in every_own if part(p) in parts and p not in kept]
    plan.float_reasons.update({p: "float_linears keeps it in the model dtype" for p, _ in every_own if p in kept})
    known += [p for p, _ in every_own]
    smooth, ranges = {}, {}
    if calibration_path is not None:
        from .fold import folds

        smoothed = folds(model)  # the others (the merger's mlp.2) are not smoothed: no source to fold into
        own_smoothed = [(p, m) for p, m in own if p in smoothed]
        expected = {s.path: _producer_of(s, found)[0] for s, found in fed.items()}
        expected.update({p: m.in_features for p, m in own_smoothed})
        smooth, plan.calibration_ignored, ranges = calibration.load(
            calibration_path, expected, getattr(getattr(model, "config", None), "model_type", None), set(known),
            {p: m.in_features for p, m in own if p not in smoothed})
        if scheme == "static" and expected and not ranges:
            raise ValueError(f"calibration {calibration_path}: the file holds no activation ranges (smooth scales "
                             f"only), which quant='w8a8_static' needs; calibrate again (pypto-gym calibrate)")
        if scheme == "static" and not loaded:
            unranged = sorted(p for p, _ in own if p not in ranges)  # a file calibrated before unsmoothed ranges
            plan.float_reasons.update({p: "the calibration file has no range for its input (static scheme)"
                                       for p in unranged})
            own = [(p, m) for p, m in own if p in ranges]
        checks = [(site.path, _producer_of(site, found)[1], found) for site, found in fed.items()]
        checks += [(p, m.weight.dtype, [(p, m)]) for p, m in own_smoothed]
        for key, dtype, found in checks:
            where = f"calibration {calibration_path}: tensor '{key}{calibration.SUFFIX}'"
            calibration.check_reciprocal(where, smooth[key], dtype)
            for path, linear in found:
                calibration.check_scaled(where, linear.weight, smooth[key].to(linear.weight.device), path)
    for site, found in fed.items():
        _, dtype, kind, why = _producer_of(site, found)
        s = smooth.get(site.path)
        inv = None if s is None else (1.0 / s).to(device=found[0][1].weight.device, dtype=dtype)
        static = _static_of(site.path, ranges, inv, found) if scheme == "static" else None
        plan.producers.append(Producer(site, found, kind, why, inv, static))
    for path, linear in own:
        s = smooth.get(path)
        inv = None if s is None else (1.0 / s).to(device=linear.weight.device, dtype=linear.weight.dtype)
        if scheme == "static":
            plan.own.append(OwnInput(path, linear, "quantised here under its static scale (static_quant: no fused op "
                                                   "produces its input)", inv,
                                     _static_of(path, ranges, inv, [(path, linear)])))
        else:
            plan.own.append(OwnInput(path, linear, "quantised per row here (dynamic_quant: no fused op produces its "
                                                   "input)", inv))
    _gelu_producers(plan, state)
    return plan


def _gelu_producers(plan, state) -> None:
    """An int8 fc2 of a patched GELU MLP reads its site's rows (the GELU's output quantised in the op computing it)
    instead of quantising its input itself: the same scale and offset (calibrated under fc2's path), one pass less."""
    fc2_of = {id(s.fc2): s for s in state.sites if isinstance(s, GeluMlpSite)}
    for o in [o for o in plan.own if id(o.linear) in fc2_of]:
        site = fc2_of[id(o.linear)]
        plan.own.remove(o)
        plan.producers.append(Producer(site, [(o.path, o.linear)], QuantGeluMlp,
                                       f"int8 rows from {site.path} (fused gelu + quant)", o.inv_smooth, o.static))
        plan.sites.append(site)


def _static_of(path, ranges, inv, found):
    """A source's static (scale, offset) in the model dtype, on its consumers' device: the one its consumers were
    loaded with (an msModelSlim W8A8 checkpoint: they must agree), else from the calibration file's range."""
    weight = found[0][1].weight
    stored = [lin.__dict__.get(STORED_STATIC) for _, lin in found]
    if all(s is not None for s in stored):
        for (p, _), s in zip(found[1:], stored[1:]):
            if not (torch.equal(s[0], stored[0][0]) and torch.equal(s[1], stored[0][1])):
                raise ValueError(f"{p}: input_scale/input_offset {float(s[0])}/{float(s[1])} differ from "
                                 f"{found[0][0]}'s {float(stored[0][0])}/{float(stored[0][1])}, which read the same "
                                 f"rows ({path}'s)")
        return stored[0]
    if path not in ranges:
        raise ValueError(f"quant='w8a8_static': {path} has no static scale: expected a calibration file (pypto-gym "
                         f"calibrate) holding its range")
    scale, offset = calibration.static_params(*ranges[path], inv, weight.dtype)
    return scale.to(weight.device), offset.to(weight.device)
