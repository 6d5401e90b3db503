"""Turn a patched model's norm-fed linears into W8A8: which norms quantise, which linears go int8.

The linears that read a norm's rows are named per model family (models/<family>.py, W8A8_LINEARS); each name
is checked against the model (an nn.Linear whose in_features is the norm's D) and a norm none of
whose linears is found stays a float norm, with the reason in the report. Every other linear of
the model stays in the model dtype and is listed with why.
"""
from __future__ import annotations

import torch

from .. import models
from ..patching.norm import NormSite
from . import calibration
from .linear import QuantLinear, quant_linear_of
from .norm import QuantNorm


def _resolve(model, site, relative: str, regrouped: bool):
    """(path, linear) or (path, reason) for one named consumer of `site` (regrouped: reads k rows as one)."""
    if relative == "<lm_head>":
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        path = next((p for p, m in model.named_modules() if m is head), None) if head is not None else None
        if path is None:
            return "lm_head", "the model has no output embedding"
    else:
        parent = site.path.rpartition(".")[0]
        path = f"{parent}.{relative}" if parent else relative
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return path, "not found"
    D = site.module.weight.shape[0]
    if not isinstance(module, torch.nn.Linear) or module.in_features % D or (not regrouped and module.in_features != D):
        return path, f"not an nn.Linear with in_features={'a multiple of ' if regrouped else ''}{D}"
    return path, module


def tables(model):
    """(linears after each norm kind, linears after a regrouped norm) of the model's family."""
    family = models.family_of(model)
    if family is None:
        name = getattr(getattr(model, "config", None), "model_type", None)
        raise ValueError(f"quant: model_type {name!r} has no W8A8 linear table (families with one: "
                         f"{', '.join(models.FAMILIES)})")
    return family.W8A8_LINEARS, family.W8A8_REGROUPED


def linears_after(model, site, regrouped: bool = False):
    """([(path, linear)], [(path, reason)]) of the linears the model family names for the site's kind."""
    table = tables(model)[1 if regrouped else 0]
    found, missing = [], []
    for relative in table.get(site.kind, ()):
        path, got = _resolve(model, site, relative, regrouped)
        (found if isinstance(got, torch.nn.Module) else missing).append((path, got))
    return found, missing


class QuantPlan:
    """What W8A8 did to a patched model: quant norms, int8 linears, and every linear left in float."""

    def __init__(self, calibration_path: str | None, sites: list):
        self.calibration = calibration_path
        self.sites = sites
        self.norms: dict = {}  # site path -> QuantNorm
        self.linears: list[QuantLinear] = []
        self.float_linears: list[dict] = []
        self.skipped_norms: list[dict] = []
        self.calibration_ignored: list[str] = []  # norms of the file this patch does not quantise

    def uninstall(self) -> None:
        for ql in self.linears:
            ql.uninstall()
        for site in self.sites:
            site.quant = None

    def to_json(self) -> dict:
        rows = [ql.row() for ql in self.linears] + [dict(r) for r in self.float_linears]
        q = [r for r in rows if r["became"] == "w8a8"]
        return {"mode": "w8a8", "calibration": self.calibration, "smoothing": self.calibration is not None,
                "summary": {"linears": len(rows), "int8": len(q), "float": len(rows) - len(q),
                            "quant_norms": len(self.norms),
                            "handed_over": sum(r["handed_over"] for r in q),
                            "quantized_here": sum(r["quantized_here"] for r in q),
                            "fallbacks": sum(sum(r["fallbacks"].values()) for r in q),
                            "float_weight_bytes": sum(r["float_weight_bytes"] for r in q),
                            "releasable_float_bytes": sum(r["float_weight_bytes"] for r in q
                                                          if not r["float_weight_shared"]),
                            "int8_weight_bytes": sum(r["int8_weight_bytes"] for r in q)},
                "skipped_norms": [dict(r) for r in self.skipped_norms],
                "calibration_ignored": list(self.calibration_ignored), "linears": rows}


def install(model, state) -> QuantPlan:
    """The "w8a8" quantisation mode of patch_model: quantise the linears after every patched norm that has
    some; returns the plan (uninstall undoes it). A calibration file may cover every norm of the model,
    patched or not (a `sites=` subset)."""
    tables(model)  # a model of no known family is refused before anything changes
    sites = [s for s in state.sites if isinstance(s, NormSite)]
    backend, calibration_path = state.options.backend, state.options.calibration
    known_norms = [p for e in state.entries for p in (e.paths if isinstance(e, NormSite) else
                                                        e["paths"] if isinstance(e, dict) and e["op"] == "rms_norm"
                                                        else ())]
    plan = QuantPlan(None if calibration_path is None else str(calibration_path), sites)
    fed = {}
    for site in sites:
        found, missing = linears_after(model, site)
        if found:
            fed[site] = found
        elif missing:
            plan.skipped_norms.append({"path": site.path, "reason": "; ".join(f"{p}: {r}" for p, r in missing)})
    smooth = {}
    if calibration_path is not None:
        smooth, plan.calibration_ignored = calibration.load(
            calibration_path, {s.path: s.module.weight.shape[0] for s in fed},
            getattr(getattr(model, "config", None), "model_type", None), set(known_norms))
        for site, found in fed.items():
            where = f"calibration {calibration_path}: tensor '{site.path}{calibration.SUFFIX}'"
            calibration.check_reciprocal(where, smooth[site.path], site.module.weight.dtype)
            for path, linear in found:
                calibration.check_scaled(where, linear.weight, smooth[site.path].to(linear.weight.device), path)
    try:
        for site, found in fed.items():
            s = smooth.get(site.path)
            inv = None if s is None else (1.0 / s).to(device=site.module.weight.device, dtype=site.module.weight.dtype)
            qn = QuantNorm(inv)
            site.quant = qn
            plan.norms[site.path] = qn
            for path, linear in found:
                _add(plan, path, linear, qn, backend, f"int8 rows from {site.path} (fused norm + quant)")
        for site in sites:
            found, _ = linears_after(model, site, regrouped=True)
            for path, linear in found:
                _add(plan, path, linear, None, backend, f"quantised per row here ({site.path}'s output regrouped)")
    except BaseException:
        plan.uninstall()
        raise
    still_needed = {p.data_ptr() for m in model.modules() if quant_linear_of(m) is None
                    for p in m.parameters(recurse=False)}
    for ql in plan.linears:  # a tied weight (lm_head = embed_tokens) stays in memory for its other user
        ql.float_weight_shared = ql.module.weight.data_ptr() in still_needed
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and quant_linear_of(module) is None:
            plan.float_linears.append({
                "path": path, "in_features": module.in_features, "out_features": module.out_features,
                "became": str(module.weight.dtype).replace("torch.", ""), "input": "not a norm's output rows",
                "smoothed": False, "backend": None, "calls": 0, "ran_on": {}, "fallbacks": {}, "handed_over": 0,
                "quantized_here": 0, "float_weight_bytes": module.weight.numel() * module.weight.element_size(),
                "float_weight_shared": False, "int8_weight_bytes": 0})
    return plan


def _add(plan, path, linear, source, backend, why) -> None:
    if quant_linear_of(linear) is not None:  # one module reachable twice (a shared or tied linear)
        return
    ql = QuantLinear(path, linear, source, backend, why)
    ql.install()
    plan.linears.append(ql)
    if source is not None:
        source.consumers.append(path)
        source.consumer_modules.append(linear)
