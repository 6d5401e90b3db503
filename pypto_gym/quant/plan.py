"""Turn a patched model's linears into W8A8: which producers quantise, which linears go int8.

Producers of int8 rows: the norms, whose consumers are named per model family (models/<family>.py,
W8A8_LINEARS), each name checked against the model (an nn.Linear whose in_features is the norm's D;
a norm none of whose linears is found stays a float norm, with the reason in the report); and the
patched SwiGLU MLPs, whose down_proj reads the fused swiglu + quant's rows. The linears whose input
no fused op produces (o_proj, the vision attn.proj, the merger's linears: W8A8_OWN_INPUT) quantise
it themselves with `dynamic_quant`, smoothed by their own calibrated scale (where it can fold into a
checkpoint: quant/fold.py), in the parts of the model (text, vision) that have patched norms or MLPs. Every other
linear stays in the model dtype and is listed with why.

Two schemes: "dynamic" (quant="w8a8": per-token activation scales computed at run time, W8A8_DYNAMIC) and
"static" (quant="w8a8_static": msModelSlim's W8A8, one scale and offset per source of rows, fixed from the
calibration file's ranges by calibration.static_params, in the model dtype as the format stores them).
"""
from __future__ import annotations

import fnmatch
import warnings

import torch

from .. import hardware
from ..kernels.cpu import quant_matmul
from ..patching.rules.mlp import MlpSite
from ..patching.rules.norm import NormSite
from ..patching.site import SLOT, part
from . import calibration
from .linear import STORED_STATIC, QuantLinear, linear_kind, quant_linear_of
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


class QuantPlan:
    """What W8A8 did to a patched model: quant norms, int8 linears, and every linear left in float."""

    def __init__(self, calibration_path: str | None, sites: list):
        self.calibration = calibration_path
        self.sites = sites
        self.norms: dict = {}  # site path -> QuantNorm
        self.mlps: dict = {}  # site path -> QuantMlp
        self.linears: list[QuantLinear] = []
        self.folded_norms: list = []  # float norm sites holding a static consumer's smooth scale (weight_fold)
        self.float_linears: list[dict] = []
        self.skipped_producers: list[dict] = []
        self.calibration_ignored: list[str] = []  # producers and linears of the file this patch does not quantise
        self.float_reasons: dict = {}  # linear path -> why float_linears left it in the model dtype
        self.speed_note: str | None = None  # said once at patch time where the int8 GEMM has no fast path
        self.int8_gemm: str | None = None  # which exact int32 GEMM the CPU's int8 linears run (ops.int32_gemm)
        self.scheme = "dynamic"  # or "static" (install)
        self.recipe: dict | None = None  # the tuned recipe the calibration file held (quant/tune.py)

    def unpatch_refusal(self) -> str | None:
        """Why unpatch_model cannot restore the float model (its weights were released), else None."""
        released = [ql.path for ql in self.linears if ql.released_bytes]
        stored = [ql.path for ql in self.linears if ql.stored]
        if stored:
            return (f"{len(stored)} int8 linears (e.g. {stored[0]}) were loaded from an int8 checkpoint: there are no "
                    f"float weights to restore")
        if not released:
            return None
        return (f"the float weights of {len(released)} int8 linears (e.g. {released[0]}) were released "
                f"(release_float_weights=True): the float model cannot be restored; load it again instead")

    def uninstall(self) -> None:
        for ql in self.linears:
            ql.uninstall()
        for site in self.sites:
            site.quant = None
        for site in self.folded_norms:
            site.weight_fold = None

    def to_json(self) -> dict:
        rows = [ql.row() for ql in self.linears] + [dict(r) for r in self.float_linears]
        q = [r for r in rows if r["became"] == "w8a8"]
        return {"mode": "w8a8" if self.scheme == "dynamic" else "w8a8_static", "scheme": self.scheme,
                "calibration": self.calibration, "recipe": self.recipe, "smoothing": self.calibration is not None,
                "summary": {"linears": len(rows), "int8": len(q), "float": len(rows) - len(q),
                            "quant_norms": len(self.norms), "quant_mlps": len(self.mlps),
                            "handed_over": sum(r["handed_over"] for r in q),
                            "quantized_here": sum(r["quantized_here"] for r in q),
                            "fallbacks": sum(sum(r["fallbacks"].values()) for r in q),
                            "float_weight_bytes": sum(r["float_weight_bytes"] for r in q),
                            "releasable_float_bytes": sum(r["float_weight_bytes"] for r in q
                                                          if not r["float_weight_shared"]),
                            "released_float_bytes": sum(ql.released_bytes for ql in self.linears),
                            "loaded_int8": sum(ql.stored for ql in self.linears),
                            "int8_weight_bytes": sum(r["int8_weight_bytes"] for r in q)},
                "speed_note": self.speed_note, "int8_gemm": self.int8_gemm, "skipped_producers": [dict(r) for r in self.skipped_producers],
                "calibration_ignored": list(self.calibration_ignored), "linears": rows}


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


_said: list = []  # the no-fast-path note, once per process


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


def install(model, state, scheme: str = "dynamic") -> QuantPlan:
    """The "w8a8" (scheme "dynamic") and "w8a8_static" quantisation modes of patch_model: every patched norm with
    consumer linears and every patched SwiGLU MLP produce int8 rows for their linears; returns the plan (uninstall
    undoes it). A calibration file may cover every norm and MLP of the model, patched or not (a `sites=` subset);
    the static scheme needs one, with ranges (format 4)."""
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
    plan = QuantPlan(None if calibration_path is None else str(calibration_path), sites)
    plan.scheme = scheme
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
    parts = {part(s.path) for s in sites}
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
    try:
        for site, found in fed.items():
            _, dtype, kind, why = _producer_of(site, found)
            s = smooth.get(site.path)
            inv = None if s is None else (1.0 / s).to(device=found[0][1].weight.device, dtype=dtype)
            static = None
            if scheme == "static":
                static = _static_of(site.path, ranges, inv, found)
            producer = kind(inv, static)
            site.quant = producer
            (plan.mlps if kind is QuantMlp else plan.norms)[site.path] = producer
            for path, linear in found:
                _add(plan, path, linear, producer, backend, why)
        for site in fed:  # an MLP whose gate and up read one norm's rows: one int32 GEMM over both weights
            if isinstance(site, MlpSite) and scheme == "dynamic":
                gate, up = quant_linear_of(site.module.gate_proj), quant_linear_of(site.module.up_proj)
                if gate is not None and up is not None and gate.source is not None and gate.source is up.source \
                        and (gate.module.bias is None) == (up.module.bias is None):
                    site.quant.merge(gate, up)
        for path, linear in own:
            s = smooth.get(path)
            inv = None if s is None else (1.0 / s).to(device=linear.weight.device, dtype=linear.weight.dtype)
            if scheme == "static":
                _add(plan, path, linear, None, backend, "quantised here under its static scale (static_quant: no "
                                                        "fused op produces its input)", inv,
                     _static_of(path, ranges, inv, [(path, linear)]))
            else:
                _add(plan, path, linear, None, backend, "quantised per row here (dynamic_quant: no fused op produces "
                                                        "its input)", inv)
        if scheme == "static":
            _fold_static_smoothing(model, plan)
    except BaseException:
        plan.uninstall()
        raise
    still_needed = {p.data_ptr() for m in model.modules() if quant_linear_of(m) is None
                    for p in m.parameters(recurse=False)}
    for ql in plan.linears:  # a tied weight (lm_head = embed_tokens) stays in memory for its other user
        ql.float_weight_shared = ql.module.weight.data_ptr() in still_needed
    if state.options.release_float_weights:
        for ql in plan.linears:
            if not ql.float_weight_shared:
                ql.release()
    on_cpu = any(ql.module.weight.device.type in ("cpu", "meta") for ql in plan.linears)
    if on_cpu and backend in ("auto", "cpu"):
        plan.int8_gemm = quant_matmul.which_int32_gemm()  # decided here, by a self-test of torch._int_mm where it could run
    if on_cpu and backend in ("auto", "cpu") and not quant_matmul.int_mm_is_exact() and hardware.best_isa() == "generic":
        plan.speed_note = (f"this CPU ({hardware.cpu_model()}) has neither int8 dot-product instructions (VNNI, AMX) "
                           f"nor AVX2: its int8 GEMM has no fast path, so the int8 linears are exact but slower than "
                           f"the float model's")
        if not _said:
            _said.append(plan.speed_note)
            warnings.warn(f"pypto-gym W8A8: {plan.speed_note}", RuntimeWarning, stacklevel=3)
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and quant_linear_of(module) is None:
            plan.float_linears.append({
                "path": path, "in_features": module.in_features, "out_features": module.out_features,
                "became": str(module.weight.dtype).replace("torch.", ""),
                "input": plan.float_reasons.get(path, "not the rows of a patched norm or MLP"),
                "smoothed": False, "backend": None, "calls": 0, "ran_on": {}, "fallbacks": {}, "handed_over": 0,
                "quantized_here": 0, "float_weight_bytes": module.weight.numel() * module.weight.element_size(),
                "float_weight_shared": False, "float_weight_released": False, "int8_weight_bytes": 0})
    return plan


def _fold_static_smoothing(model, plan) -> None:
    """Static scheme: fold each smooth scale into the int8 linear that writes the rows it scales, as an export does
    (quant/fold.py): an MLP's into up_proj's deq_scale, an own-input linear's into its source linear's (v_proj, the
    vision qkv), or a float norm's weight (the merger's ln_q: NormSite.weight_fold); so what runs is what the
    checkpoint holds. Where that writer is neither (a float linear) the smooth scale stays in static_quant."""
    from .fold import folds, source_factor

    for path, mlp in plan.mlps.items():
        up = quant_linear_of(model.get_submodule(path).up_proj)
        if mlp.inv_smooth is not None and up is not None and up.static is not None:
            up.fold_output(mlp.inv_smooth.detach().float())
            mlp.smooth_folded = True
    sources = folds(model)
    for ql in plan.linears:
        fold = sources.get(ql.path)
        if ql.source is not None or ql.inv_smooth is None or fold is None:
            continue
        src = quant_linear_of(fold.source)
        site = fold.source.__dict__.get(SLOT)
        if src is not None and src.static is not None:
            src.fold_output(source_factor(ql.inv_smooth, fold))
            ql.smooth_folded = True
        elif isinstance(site, NormSite) and site.quant is None:  # a float norm (ln_q): its weight, per call
            site.weight_fold = source_factor(ql.inv_smooth, fold).to(fold.source.weight.device)
            plan.folded_norms.append(site)
            ql.smooth_folded = True


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


def _add(plan, path, linear, source, backend, why, inv_smooth=None, static=None) -> None:
    if quant_linear_of(linear) is not None:  # one module reachable twice (a shared or tied linear)
        return
    ql = QuantLinear(path, linear, source, backend, why, inv_smooth, static)
    ql.install()
    plan.linears.append(ql)
    if source is not None:
        source.consumers.append(path)
        source.consumer_modules.append(linear)
