"""SmoothQuant calibration: per-channel smooth scales for every int8 linear's input.

Activation outliers sit in a few channels; per-row int8 quantisation then spends its 255 levels on
them and the other channels round to a handful of codes. SmoothQuant (Xiao et al., 2023) moves part
of that range into the weights: for each channel j, s_j = max|X_j|^alpha / max|W_j|^(1 - alpha), the
quant op producing the int8 rows multiplies them by 1/s (its smooth scale) and every linear reading
them gets W * s, which leaves X @ W^T unchanged in exact arithmetic. One scale per source of rows:
each norm whose output feeds int8 linears (max|W_j| over all of them), each SwiGLU MLP, whose
activation feeds its int8 down_proj (the widest outliers of a decoder: silu(gate) * up multiplies two
large values), and each linear that quantises its own input (o_proj, the vision attn.proj, the
merger's mlp.0), whose dynamic_quant multiplies by 1/s as the fused ops do. Every scale can be folded
into a checkpoint (quant/fold.py): a linear's scale is shared by the input channels one channel of its
source feeds (a kv head's channel for o_proj under GQA), and a linear with no source to fold into (the
merger's mlp.2, after GELU) is not smoothed.

A calibration file is safetensors: one fp32 tensor `<path>.smooth_scale` ([D] for a norm, [I] for an
MLP, [in_features] for a linear) per source, and one metadata entry: a JSON string with the format,
alpha, model type and the inputs used. The same model and inputs give the same bytes. Loading checks
every tensor against the model and names the one that is wrong. max|X_j| is collected by
`Calibrator`'s hooks (at each norm's output, each MLP's down_proj input, each such linear's input)
while the float model runs.

The static scheme (msModelSlim's W8A8) also needs each source's range: the file holds, per source, the
per-channel minimum and maximum of its rows (`<path>.act_min`, `<path>.act_max`, fp32 [D], before
smoothing), from which `static_params` derives the per-tensor scale and offset of the smoothed rows for
any smooth scale (min_j(min_j / s_j), max_j(max_j / s_j): 1/s is positive). With a percentile (`calibrate
--percentile 99.99`) a channel's range is its lower and upper percentile over each call's rows instead of its
min and max. A file without ranges (format 3, or written without them) still serves the dynamic scheme.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

FORMAT = "pypto_gym-smoothquant-4"  # 4: + activation ranges; 3: every scale foldable (2: o_proj per query head)
FORMATS_WITHOUT_RANGES = ("pypto_gym-smoothquant-3",)  # still read: smooth scales only (the dynamic scheme)
OLD_FORMATS = {"pypto_gym-smoothquant-1": "format 1 calibrated the norms only",
               "pypto_gym-smoothquant-2": "format 2 gave scales a checkpoint cannot hold (o_proj per query head, "
                                          "the merger's mlp.2)"}
SUFFIX = ".smooth_scale"
RANGE_SUFFIXES = (".act_min", ".act_max")
META_KEY = "pypto_gym"
FLOOR = 1e-5  # a channel that never fired, or an all-zero weight column, gets s = 1 instead of 0 or inf
# The widest max/min of one norm's smooth scales a file may hold. Calibrations measured here span at
# most ~300 (100x outliers, alpha 1); one channel at 1e-10 or 1e10 (spread ~1e10) took the logits
# cosine to 0.56, and a reciprocal or a scaled weight past the float range gives NaN logits.
MAX_SPREAD = 1e5
MAX_METADATA_BYTES = 64 * 1024  # the JSON entry: format, alpha, model type, input names


class Calibrator:
    """`with Calibrator(model) as cal: generate(...)`: per-channel max |activation| of every producer of the
    float model (the rows its int8 linears will read), collected by forward hooks: a norm's output, an
    MLP's down_proj input, the input of a linear that quantises its own (where its scale can fold)."""

    def __init__(self, model, percentile: float | None = None):
        """`percentile` (e.g. 99.99): each channel's range is its values' lower and upper percentile over the rows of
        a call (so a rare spike does not stretch a static scale), the widest over calls; None: min and max."""
        if percentile is not None and not 50.0 < percentile <= 100.0:
            raise ValueError(f"percentile: got {percentile!r}; expected a number in (50, 100]")
        self.model = model
        self.percentile = percentile
        self.absmax: dict = {}  # producer path -> per-channel max |activation| (fp32, [D])
        self.amin: dict = {}  # producer path -> per-channel min activation (fp32, [D]): the static scheme's range
        self.amax: dict = {}
        self.unsmoothed: list[str] = []  # linears quantising their own input with no source to fold a scale into
        self._handles = []

    def __enter__(self):
        from ..patching.rules.mlp import MLPS
        from ..patching.rules.norm import NORMS
        from .fold import folds

        for cand in NORMS.candidates(self.model, None):
            if not cand.reason:
                self._handles.append(cand.module.register_forward_hook(
                    lambda m, args, out, path=cand.path: self._record(path, out[0] if isinstance(out, tuple) else out)))
        for cand in MLPS.candidates(self.model, None):
            if not cand.reason:
                self._handles.append(cand.module.down_proj.register_forward_pre_hook(
                    lambda m, args, path=cand.path: self._record(path, args[0])))
        from .topology import own_input_linears

        smoothable = folds(self.model)
        for path, linear in own_input_linears(self.model):  # the unsmoothable ones too: the static scheme's range
            if path not in smoothable:
                self.unsmoothed.append(path)
            self._handles.append(linear.register_forward_pre_hook(
                lambda m, args, path=path: self._record(path, args[0])))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return False

    def _record(self, path, y):
        rows = y.detach().reshape(-1, y.shape[-1])
        m = rows.abs().amax(0).to(torch.float32).cpu()
        if self.percentile is None or rows.shape[0] < 2:
            lo, hi = rows.amin(0).to(torch.float32).cpu(), rows.amax(0).to(torch.float32).cpu()
        else:  # each tail's floor(n * (100 - p) / 100) values left out: the k-th smallest and largest per channel
            n = rows.shape[0]
            k = math.floor(n * (100.0 - self.percentile) / 100.0 + 1e-9) + 1
            r = rows.to(torch.float32)
            lo, hi = r.kthvalue(k, dim=0).values.cpu(), r.kthvalue(n - k + 1, dim=0).values.cpu()
        self.absmax[path] = m if path not in self.absmax else torch.maximum(self.absmax[path], m)
        self.amin[path] = lo if path not in self.amin else torch.minimum(self.amin[path], lo)
        self.amax[path] = hi if path not in self.amax else torch.maximum(self.amax[path], hi)

    def ranges(self, smoothed) -> dict:
        """{path: (per-channel min, per-channel max)} (what `save` writes) of the recorded sources among `smoothed`
        (the smooth scales' paths) and of the linears quantising their own input unsmoothed (the merger's mlp.2
        reads GELU's output): the static scheme needs every int8 linear's range."""
        return {p: (self.amin[p], self.amax[p]) for p in [*smoothed, *self.unsmoothed] if p in self.amin}

    @property
    def range_rule(self) -> str:
        return "min/max" if self.percentile is None else f"percentile {self.percentile:g}"


def _smooth(absmax: torch.Tensor, weights, alpha: float, fold=None) -> torch.Tensor:
    """s = max|X_j|^alpha / max|W_j|^(1 - alpha), W_j over every consumer's column j; 1 where either is 0.
    With a `fold` both maxima are taken over the channels one source channel feeds (fold.group_max)."""
    from .fold import group_max

    a = absmax.to(torch.float32).cpu()
    w = torch.stack([w.detach().abs().amax(0).to(torch.float32).cpu() for w in weights]).amax(0)
    if fold is not None:
        a, w = group_max(a, fold), group_max(w, fold)
    s = a.clamp(min=FLOOR).pow(alpha) / w.clamp(min=FLOOR).pow(1.0 - alpha)
    return torch.where((a > 0) & (w > 0), s, torch.ones_like(s)).contiguous()


def smooth_scales(model, absmax: dict, alpha: float) -> dict:
    """{path: s fp32} for every recorded norm that has consumer linears, every recorded MLP and every recorded
    linear that quantises its own input and has a source to fold its scale into."""
    from ..patching.rules.mlp import MLPS
    from ..patching.rules.norm import NORMS
    from .fold import folds
    from .topology import linears_after

    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha: got {alpha}; expected a number in [0, 1]")
    out = {}
    for cand in NORMS.candidates(model, None):
        if cand.reason or cand.path not in absmax:
            continue
        found, _ = linears_after(model, cand)
        if found:
            out[cand.path] = _smooth(absmax[cand.path], [lin.weight for _, lin in found], alpha)
    for cand in MLPS.candidates(model, None):
        if not cand.reason and cand.path in absmax:
            out[cand.path] = _smooth(absmax[cand.path], [cand.module.down_proj.weight], alpha)
    for path, fold in folds(model).items():
        if path in absmax:
            out[path] = _smooth(absmax[path], [model.get_submodule(path).weight], alpha, fold)
    return out


def static_params(act_min: torch.Tensor, act_max: torch.Tensor, inv_smooth, dtype: torch.dtype):
    """(scale [1], offset [1]) in `dtype` (what msModelSlim's W8A8 stores as input_scale and input_offset) of a
    source's rows times `inv_smooth`: asymmetric int8 over [min(lo, 0), max(hi, 0)], scale = (hi - lo) / 255 rounded
    to `dtype`, offset = rint(-128 - lo / scale) clamped to int8 (so lo maps to -128, 0 to an exact code)."""
    lo, hi = act_min.to(torch.float32), act_max.to(torch.float32)
    if inv_smooth is not None:
        inv = inv_smooth.to(torch.float32).cpu()
        lo, hi = lo * inv, hi * inv
    lo, hi = min(float(lo.min()), 0.0), max(float(hi.max()), 0.0)
    scale = torch.tensor([(hi - lo) / 255.0 if hi > lo else 1.0]).to(dtype)
    if not float(scale) > 0:  # a range below the dtype's smallest step
        scale = torch.tensor([torch.finfo(dtype).tiny]).to(dtype)
    offset = torch.tensor([-128.0 - lo / float(scale)]).round().clamp(-128, 127).to(dtype)
    return scale, offset


def save(path, scales: dict, alpha: float, model_type: str, inputs: list[str], ranges: dict | None = None,
         recipe: dict | None = None, range_rule: str = "min/max") -> None:
    """Write a calibration file (atomically, deterministic bytes): the smooth scales, and `ranges` {path: (min,
    max)} where given; `recipe` (quant/tune.py: float_linears, scheme, the cosine it reached) in its metadata."""
    from safetensors.torch import save

    from .. import files

    info = {"format": FORMAT, "alpha": float(alpha), "model_type": str(model_type), "inputs": list(inputs),
            "norms": len(scales)}
    if ranges:
        info["ranges"] = range_rule
    if recipe is not None:
        info["recipe"] = recipe
    # one metadata key: safetensors writes its metadata map in hash order, which would vary between runs
    metadata = {META_KEY: json.dumps(info, sort_keys=True)}
    tensors = {f"{p}{SUFFIX}": scales[p] for p in sorted(scales)}
    for p, (lo, hi) in (ranges or {}).items():
        tensors[f"{p}.act_min"], tensors[f"{p}.act_max"] = lo.to(torch.float32).contiguous(), \
            hi.to(torch.float32).contiguous()
    data = save(tensors, metadata=metadata)
    files.write_bytes(path, data)


def load(path, expected: dict, model_type: str | None = None, known=(), unsmoothed=None) -> tuple[dict, list, dict]:
    """({producer path: s}, [ignored paths], {producer path: (min, max)}) from a calibration file, checked against
    `expected` {producer path: D} (the norms and MLPs being quantised) and the model type. Tensors for `known`
    producers of the model that are not being quantised (a `sites=` subset) are ignored and listed; a
    tensor naming a module the model does not have is refused. The ranges are {} in a format 3 file; those of
    `unsmoothed` {linear path: K} (no smooth scale) are returned where the file holds them (an older file may not)."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load as load_bytes

    p = Path(path)
    where = f"calibration {p}"
    if not p.is_file():
        raise FileNotFoundError(f"{where}: no such file")
    try:
        with safe_open(str(p), framework="pt") as f:
            metadata = f.metadata() or {}
        tensors = load_bytes(p.read_bytes())
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"{where}: not a safetensors file ({str(e).splitlines()[0][:120]})") from None
    info = _metadata(where, metadata)
    if model_type is not None and info.get("model_type") != model_type:
        raise ValueError(f"{where}: metadata model_type {info.get('model_type')!r}; this model is {model_type!r} "
                         f"(a file made for another model?)")
    out, ignored, bounds = {}, [], {}
    unsmoothed = unsmoothed or {}
    examples = ", ".join(repr(n) for n in sorted(expected)[:2])
    for name in sorted(tensors):
        t = tensors[name]
        kind = next((k for k in (SUFFIX, *RANGE_SUFFIXES) if name.endswith(k)), None)
        norm = name[:-len(kind)] if kind is not None else None
        if kind in RANGE_SUFFIXES and (norm in expected or norm in unsmoothed):
            D = expected.get(norm, unsmoothed.get(norm))
            if t.dtype != torch.float32 or tuple(t.shape) != (D,) or not torch.isfinite(t).all():
                raise ValueError(f"{where}: tensor {name!r} is {str(t.dtype).replace('torch.', '')} {list(t.shape)}"
                                 f"{'' if torch.isfinite(t).all() else ' with values that are not finite'}; "
                                 f"expected finite float32 [{D}] (the range of {norm}'s rows)")
            bounds.setdefault(norm, {})[kind] = t
            continue
        if norm in known and norm not in expected:
            ignored.append(norm)
            continue
        if norm not in expected:
            raise ValueError(f"{where}: tensor {name!r} names no norm, MLP or linear this model quantises (a file "
                             f"made for another model? this one's are like {examples})")
        D = expected[norm]
        if t.dtype != torch.float32 or tuple(t.shape) != (D,):
            raise ValueError(f"{where}: tensor {name!r} is {str(t.dtype).replace('torch.', '')} "
                             f"{list(t.shape)}; expected float32 [{D}] (the width of {norm}'s rows)")
        bad = ~torch.isfinite(t) | (t <= 0)
        if bad.any():
            first = int(bad.nonzero()[0, 0])
            raise ValueError(f"{where}: tensor {name!r} has {int(bad.sum())} values that are not finite and "
                             f"positive (the first at channel {first}: {float(t[first])})")
        _check_spread(where, name, t)
        out[norm] = t
    missing = sorted(set(expected) - set(out))
    if missing:
        raise ValueError(f"{where}: no tensor {missing[0] + SUFFIX!r} for {missing[0]} ({len(missing)} of "
                         f"{len(expected)} smooth scales missing; a file made for another model?)")
    ranges = {}
    if bounds:  # a file holds every source's range or none (smooth scales only: the dynamic scheme's)
        for norm in sorted(expected):
            got = bounds.get(norm, {})
            lacking = [k for k in RANGE_SUFFIXES if k not in got]
            if lacking:
                raise ValueError(f"{where}: no tensor {norm + lacking[0]!r} (the file holds other sources' ranges: "
                                 f"it must hold every one)")
            ranges[norm] = _possible_range(where, norm, got[".act_min"], got[".act_max"])
        for lin in sorted(set(bounds) - set(expected)):
            if all(k in bounds[lin] for k in RANGE_SUFFIXES):
                ranges[lin] = _possible_range(where, lin, bounds[lin][".act_min"], bounds[lin][".act_max"])
    return out, sorted(set(ignored)), ranges


def _possible_range(where: str, source: str, lo: torch.Tensor, hi: torch.Tensor) -> tuple:
    """(lo, hi) of a source's rows, refused where no rows could have it: a channel whose minimum is above its
    maximum, or a source whose every channel's range is 0 (its rows were never seen: a static scale from it maps
    every real value to the clamp; such files ran the model at logits cosine 0.2-0.3)."""
    inverted = lo > hi
    if inverted.any():
        c = int(inverted.nonzero()[0, 0])
        raise ValueError(f"{where}: tensors '{source}.act_min' and '{source}.act_max' give channel {c} the range "
                         f"[{float(lo[c]):g}, {float(hi[c]):g}] ({int(inverted.sum())} channels with min > max); "
                         f"expected act_min <= act_max")
    if not (lo != 0).any() and not (hi != 0).any():
        raise ValueError(f"{where}: tensors '{source}.act_min' and '{source}.act_max' are 0 in every channel (a range "
                         f"of width 0: no rows were recorded for {source}); expected the range its rows spanned")
    return lo, hi


def recipe_of(path) -> dict | None:
    """The recipe a calibration file holds (`tune` wrote it), or None; its float_linears checked to be a list of
    names (the patch then checks them against the model)."""
    from safetensors import SafetensorError, safe_open

    where = f"calibration {path}"
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    except (SafetensorError, OSError, ValueError, RuntimeError):
        return None  # load() refuses the file, naming the problem
    recipe = _metadata(where, metadata).get("recipe")
    if recipe is None:
        return None
    floats = recipe.get("float_linears") if isinstance(recipe, dict) else None
    if not isinstance(floats, list) or not all(isinstance(p, str) and p for p in floats):
        raise ValueError(f"{where}: metadata recipe.float_linears is {floats!r}; expected a list of linear paths")
    return recipe


def _metadata(where: str, metadata: dict) -> dict:
    """The file's JSON metadata entry, checked: our format, an alpha in [0, 1], a bounded size."""
    text = metadata.get(META_KEY, "{}")
    if len(text) > MAX_METADATA_BYTES:
        raise ValueError(f"{where}: metadata entry {META_KEY!r} is {len(text):,} bytes; expected at most "
                         f"{MAX_METADATA_BYTES:,}")
    try:
        info = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        info = None
    fmt = info.get("format") if isinstance(info, dict) else None
    if fmt != FORMAT and fmt not in FORMATS_WITHOUT_RANGES:
        old = f" ({OLD_FORMATS[fmt]}: run scripts/calibrate.py again)" if fmt in OLD_FORMATS else ""
        raise ValueError(f"{where}: metadata format {fmt!r}; expected {FORMAT!r} (a file written by "
                         f"scripts/calibrate.py){old}")
    alpha = info.get("alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"{where}: metadata alpha {alpha!r}; expected a number in [0, 1]")
    return info


def _check_spread(where: str, name: str, s: torch.Tensor) -> None:
    """Refuse scales whose reciprocal leaves fp32's normal range or whose max/min exceeds MAX_SPREAD,
    naming the channel furthest from the median."""
    check_reciprocal(f"{where}: tensor {name!r}", s, torch.float32)
    spread = float(s.max() / s.min())
    if spread > MAX_SPREAD:
        j = int((s.log() - s.log().median()).abs().argmax())
        raise ValueError(f"{where}: tensor {name!r} channel {j}: smooth scale {float(s[j]):.3g} makes its max/min "
                         f"{spread:.3g}, above the bound of {MAX_SPREAD:g} (median {float(s.median()):.3g})")


def check_reciprocal(where: str, s: torch.Tensor, dtype: torch.dtype) -> None:
    """Refuse scales whose reciprocal (what the quant op multiplies by, in `dtype`) is not a normal number."""
    inv = (1.0 / s.to(torch.float32)).to(dtype)
    bad = ~torch.isfinite(inv) | (inv.abs() < torch.finfo(dtype).tiny)
    if bad.any():
        j = int(bad.nonzero()[0, 0])
        raise ValueError(f"{where} channel {j}: smooth scale {float(s[j]):.3g} has no normal "
                         f"{str(dtype).replace('torch.', '')} reciprocal (1/s = {float(inv[j]):.3g})")


def check_scaled(where: str, weight: torch.Tensor, smooth: torch.Tensor, linear: str) -> None:
    """Refuse a smooth scale whose product with a consumer's weight is not finite in fp32 and in the
    weight's dtype (the int8 weights are quantised from W * s)."""
    for i in range(0, weight.shape[0], 4096):
        w = weight[i:i + 4096].detach().to(torch.float32) * smooth
        bad = ~torch.isfinite(w) | ~torch.isfinite(w.to(weight.dtype))
        if bad.any():
            j = int(bad.any(0).nonzero()[0, 0])
            raise ValueError(f"{where}: channel {j}: smooth scale {float(smooth[j]):.3g} times {linear}'s weight "
                             f"is not finite in float32 and {str(weight.dtype).replace('torch.', '')}")
