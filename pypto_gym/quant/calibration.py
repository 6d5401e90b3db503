"""SmoothQuant calibration: per-channel smooth scales for the norms whose outputs feed int8 linears.

Activation outliers sit in a few channels of a norm's output; per-row int8 quantisation then
spends its 255 levels on them and the other channels round to a handful of codes. SmoothQuant
(Xiao et al., 2023) moves part of that range into the weights: for each channel j,
s_j = max|X_j|^alpha / max|W_j|^(1 - alpha), the norm's quant op multiplies its rows by 1/s
(its smooth scale) and every linear reading them gets W * s, which leaves X @ W^T unchanged in
exact arithmetic. max|X_j| is collected at each norm's output while the float model generates on real
inputs; max|W_j| is over all the norm's consumer linears.

A calibration file is safetensors: one fp32 tensor `<norm path>.smooth_scale` of shape [D] per
norm, and one metadata entry: a JSON string with the format, alpha, model type and the inputs used. The same model
and inputs give the same bytes. Loading checks every tensor against the model and names the one that is
wrong. max|X_j| is collected by `Calibrator`'s hooks at each norm's output while the float model runs.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

FORMAT = "pypto_gym-smoothquant-1"
SUFFIX = ".smooth_scale"
META_KEY = "pypto_gym"
FLOOR = 1e-5  # a channel that never fired, or an all-zero weight column, gets s = 1 instead of 0 or inf
# The widest max/min of one norm's smooth scales a file may hold. Calibrations measured here span at
# most ~300 (100x outliers, alpha 1); one channel at 1e-10 or 1e10 (spread ~1e10) took the logits
# cosine to 0.56, and a reciprocal or a scaled weight past the float range gives NaN logits.
MAX_SPREAD = 1e5
MAX_METADATA_BYTES = 64 * 1024  # the JSON entry: format, alpha, model type, input names


class Calibrator:
    """`with Calibrator(model) as cal: generate(...)`: per-channel max |output| of every norm of the float
    model (the activations its int8 linears will read), collected by forward hooks."""

    def __init__(self, model):
        self.model = model
        self.absmax: dict = {}  # norm path -> per-channel max |output| (fp32, [D])
        self._handles = []

    def __enter__(self):
        from ..patching.norm import NORMS

        for cand in NORMS.candidates(self.model, None):
            if not cand.reason:
                self._handles.append(cand.module.register_forward_hook(self._hook(cand.path)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return False

    def _hook(self, path):
        def hook(module, args, output):
            y = output[0] if isinstance(output, tuple) else output
            m = y.detach().abs().reshape(-1, y.shape[-1]).amax(0).to(torch.float32).cpu()
            self.absmax[path] = m if path not in self.absmax else torch.maximum(self.absmax[path], m)
        return hook


def smooth_scales(model, absmax: dict, alpha: float) -> dict:
    """{norm path: s [D] fp32} for every recorded norm that has consumer linears."""
    from ..patching.norm import NORMS
    from .plan import linears_after

    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha: got {alpha}; expected a number in [0, 1]")
    out = {}
    for cand in NORMS.candidates(model, None):
        if cand.reason or cand.path not in absmax:
            continue
        found, _ = linears_after(model, cand)
        if not found:
            continue
        a = absmax[cand.path].to(torch.float32).cpu()
        w = torch.stack([lin.weight.detach().abs().amax(0).to(torch.float32).cpu() for _, lin in found]).amax(0)
        s = a.clamp(min=FLOOR).pow(alpha) / w.clamp(min=FLOOR).pow(1.0 - alpha)
        out[cand.path] = torch.where((a > 0) & (w > 0), s, torch.ones_like(s)).contiguous()
    return out


def save(path, scales: dict, alpha: float, model_type: str, inputs: list[str]) -> None:
    """Write a calibration file (atomically, deterministic bytes)."""
    from safetensors.torch import save

    from .. import files

    info = {"format": FORMAT, "alpha": float(alpha), "model_type": str(model_type), "inputs": list(inputs),
            "norms": len(scales)}
    # one metadata key: safetensors writes its metadata map in hash order, which would vary between runs
    metadata = {META_KEY: json.dumps(info, sort_keys=True)}
    data = save({f"{p}{SUFFIX}": scales[p] for p in sorted(scales)}, metadata=metadata)
    files.write_bytes(path, data)


def load(path, expected: dict, model_type: str | None = None, known=()) -> tuple[dict, list]:
    """({norm path: s}, [ignored norm paths]) from a calibration file, checked against `expected`
    {norm path: D} (the norms being quantised) and the model type. Tensors for `known` norms of the
    model that are not being quantised (a `sites=` subset) are ignored and listed; a tensor naming
    a module the model does not have is refused."""
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
    out, ignored = {}, []
    examples = ", ".join(repr(n) for n in sorted(expected)[:2])
    for name in sorted(tensors):
        t = tensors[name]
        norm = name[:-len(SUFFIX)] if name.endswith(SUFFIX) else None
        if norm in known and norm not in expected:
            ignored.append(norm)
            continue
        if norm not in expected:
            raise ValueError(f"{where}: tensor {name!r} names no quantised norm of this model (a file made for "
                             f"another model? this one's norms are like {examples})")
        D = expected[norm]
        if t.dtype != torch.float32 or tuple(t.shape) != (D,):
            raise ValueError(f"{where}: tensor {name!r} is {str(t.dtype).replace('torch.', '')} "
                             f"{list(t.shape)}; expected float32 [{D}] (the hidden size of {norm})")
        bad = ~torch.isfinite(t) | (t <= 0)
        if bad.any():
            first = int(bad.nonzero()[0, 0])
            raise ValueError(f"{where}: tensor {name!r} has {int(bad.sum())} values that are not finite and "
                             f"positive (the first at channel {first}: {float(t[first])})")
        _check_spread(where, name, t)
        out[norm] = t
    missing = sorted(set(expected) - set(out))
    if missing:
        raise ValueError(f"{where}: no tensor {missing[0] + SUFFIX!r} for norm {missing[0]} ({len(missing)} of "
                         f"{len(expected)} norms missing; a file made for another model?)")
    return out, ignored


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
    if fmt != FORMAT:
        raise ValueError(f"{where}: metadata format {fmt!r}; expected {FORMAT!r} (a file written by "
                         f"scripts/calibrate.py)")
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
