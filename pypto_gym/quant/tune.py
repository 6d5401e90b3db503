"""A W8A8 recipe found by measurement: per source the alpha, and the fewest float linears, reaching a target cosine.

Every-linear-int8 W8A8 misses logits cosine 0.99 on models with activation outliers, and which linears to keep
float depends on the model. `tune` measures it instead of asking the user to know it:
1. one calibration run (the float model on the calibration inputs: per-channel max |x|, min and max);
2. the linears in groups that go int8 or float together: those reading one producer's rows (a norm's q/k/v, an
   MLP's down_proj, ...; `float_linears` keeps them together too) and each linear quantising its own input;
3. sensitivity: each group alone int8 (every other linear float), at each alpha of `ALPHAS`, on held-out inputs:
   the logits cosine against the float model; each group takes its best alpha (a per-source, so per-layer, alpha);
4. greedy: everything int8 at those alphas, then the most sensitive group float, the next, ... until the target
   cosine is met (or every group is float, said so).
The recipe is a calibration file (format 4: the chosen smooth scales, the ranges) whose metadata holds it:
`patch_model`, `export` and `infer` take it as `calibration=` and keep its float linears float (an explicit
`float_linears` wins). Both schemes: `scheme="static"` measures quant="w8a8_static".
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from . import calibration

ALPHAS = (0.5, 0.75, 0.9)  # SmoothQuant's default and stronger migrations (outliers want more)
HELD_OUT_PROMPTS = ("What does the image say?", "Give the text of this picture.", "Summarise the page.",
                    "List the words you can see.")  # none of them a family's calibration prompt
KEEP_POSITIONS = 16  # logits compared at each input's last positions (a full vocabulary per position is large)


@dataclass
class Group:
    """Linears that go int8 or float together: `key` is the source whose smooth scale they share (a producer, or
    the linear itself when it quantises its own input), `paths` the linears, `bytes` their float weight bytes."""

    key: str
    paths: list
    bytes: int
    text: bool


def groups_of(model, scheme: str, calib_file) -> list[Group]:
    """The int8 groups of `model` in `scheme` with this calibration (a patch learns them, then is undone)."""
    from ..patching import patched
    from ..kinds import part

    mode = "w8a8_static" if scheme == "static" else "w8a8"
    with patched(model, backend="cpu", quant=mode, calibration=calib_file) as report:
        plan = report._state.quant
        out = []
        for key, producer in [*plan.norms.items(), *plan.mlps.items()]:
            out.append(Group(key, list(producer.consumers), 0, part(key) == "text"))
        gelu_fed = {p for producer in plan.gelu_mlps.values() for p in producer.consumers}  # keyed by fc2's path
        out += [Group(ql.path, [ql.path], 0, part(ql.path) == "text") for ql in plan.linears
                if ql.source is None or ql.path in gelu_fed]
        sizes = {ql.path: ql.module.weight.numel() * ql.module.weight.element_size() for ql in plan.linears}
    for g in out:
        g.bytes = sum(sizes[p] for p in g.paths)
    return out


def _cosine(ref: list, got: list) -> float:
    return float(torch.cat([torch.nn.functional.cosine_similarity(r, g, dim=-1) for r, g in zip(ref, got)]).mean())


def tune(model, evaluate, calibrate, target: float, scheme: str = "dynamic", alphas=ALPHAS, out=None,
         model_type: str | None = None, inputs=(), log=print) -> dict:
    """Find the recipe (module docstring) for `model`: `calibrate()` runs the float model on the calibration inputs,
    `evaluate()` returns its logits on held-out inputs (a list of [positions, vocab] tensors). Writes the recipe to
    `out` (a calibration file) if given; returns the report: per group its alpha and alone-cosine, the float groups
    in the order they were chosen, the cosine reached, and the int8 share of the decoder's linear weight bytes."""
    from ..patching import patched

    if scheme not in ("dynamic", "static"):
        raise ValueError(f"scheme: got {scheme!r}; expected 'dynamic' or 'static'")
    if not 0.0 < target <= 1.0:
        raise ValueError(f"target: got {target!r}; expected a cosine in (0, 1]")
    mode = "w8a8_static" if scheme == "static" else "w8a8"
    model_type = model_type or getattr(getattr(model, "config", None), "model_type", "?")
    ref = evaluate()
    with calibration.Calibrator(model) as rec:
        calibrate()
    with tempfile.TemporaryDirectory() as tmp:
        files, scales = {}, {}
        for a in alphas:
            scales[a] = calibration.smooth_scales(model, rec.absmax, a)
            files[a] = Path(tmp) / f"alpha_{a}.safetensors"
            calibration.save(files[a], scales[a], a, model_type, list(inputs), rec.ranges(scales[a]))
        groups = groups_of(model, scheme, files[alphas[0]])
        every = [p for g in groups for p in g.paths]

        def measure(calib, float_paths) -> float:
            with patched(model, backend="cpu", quant=mode, calibration=calib, float_linears=float_paths or None):
                return _cosine(ref, evaluate())

        alone = {}
        for g in groups:  # each group alone int8, at each alpha
            others = [p for p in every if p not in g.paths]
            alone[g.key] = {a: measure(files[a], others) for a in alphas}
            best = max(alphas, key=lambda a: alone[g.key][a])
            log(f"  {g.key:<56} alone int8: " + ", ".join(f"alpha {a} {alone[g.key][a]:.5f}" for a in alphas)
                + f" -> alpha {best}")
        chosen = {g.key: max(alphas, key=lambda a: alone[g.key][a]) for g in groups}
        mixed = {k: scales[chosen.get(k, alphas[0])][k] for k in scales[alphas[0]]}
        recipe_file = Path(tmp) / "recipe.safetensors"
        ranges = rec.ranges(mixed)
        calibration.save(recipe_file, mixed, alphas[0], model_type, list(inputs), ranges)
        order = sorted(groups, key=lambda g: min(alone[g.key].values()))  # most sensitive first
        kept, trail = [], []
        cos = measure(recipe_file, [])
        trail.append({"float": [], "cosine": cos})
        log(f"  every group int8: cosine {cos:.5f} (target {target})")
        for g in order:
            if cos >= target:
                break
            kept.append(g)
            cos = measure(recipe_file, [p for k in kept for p in k.paths])
            trail.append({"float": [k.key for k in kept], "cosine": cos})
            log(f"  + {g.key} float: cosine {cos:.5f}")
    text_bytes = sum(g.bytes for g in groups if g.text)
    float_text = sum(g.bytes for g in kept if g.text)
    report = {"scheme": scheme, "target_cosine": target, "cosine": cos, "met": cos >= target,
              "float_linears": sorted(p for g in kept for p in g.paths), "float_groups": [g.key for g in kept],
              "alpha": chosen, "alone": {k: {str(a): v for a, v in d.items()} for k, d in alone.items()},
              "trail": trail, "int8_groups": len(groups) - len(kept), "groups": len(groups),
              "decoder_int8_share": 1.0 - float_text / text_bytes if text_bytes else 0.0}
    if out is not None:
        calibration.save(out, mixed, alphas[0], model_type, list(inputs), ranges,
                         recipe={k: report[k] for k in ("scheme", "target_cosine", "cosine", "float_linears",
                                                        "alpha", "decoder_int8_share")})
    return report
