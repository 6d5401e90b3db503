"""Find the RMSNorm sites of a model by structure and by math, never by class name alone.

A module is a candidate when it has a 1-D `weight` and an eps attribute (`variance_epsilon` or
`eps`). A semantic probe then runs the module's own forward on a small random input, on the
module's own device with its own weight (nothing moved or copied), and compares it with the `hf`
RMSNorm formula: remote-code norms with other class names pass, and look-alikes with other math
(Gemma's `1 + weight`, LayerNorm) are skipped with the reason. Modules on the meta device cannot
be run, so they are classified by class name and attributes.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch

from ..ops import reference

VISION_PARTS = {"visual", "vision", "vision_tower", "vision_model", "vision_encoder"}
TEXT_KINDS = {"input_layernorm", "post_attention_layernorm", "q_norm", "k_norm"}
_PROBE_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@dataclass
class Candidate:
    path: str
    module: torch.nn.Module
    kind: str
    eps: float | None
    is_rms: bool
    reason: str = ""
    aliases: tuple = ()  # further paths of the same module object (a norm shared by two parents)

    @property
    def paths(self) -> list[str]:
        return [self.path, *self.aliases]


def site_kind(path: str) -> str:
    """`vision.norm1`, `text.input_layernorm`, ... from the module path, for either transformers layout."""
    parts = path.split(".")
    attr, parent = parts[-1], parts[-2] if len(parts) > 1 else ""
    if VISION_PARTS & set(parts):
        if parent == "merger" and attr == "ln_q":
            return "vision.merger.ln_q"
        if attr in ("norm1", "norm2"):
            return f"vision.{attr}"
        return f"other.{attr}"
    if attr in TEXT_KINDS:
        return f"text.{attr}"
    if attr == "norm" and not parent.isdigit():
        return "text.norm"
    return f"other.{attr}"


def _eps_of(module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _probe(module, weight: torch.Tensor, eps: float) -> str:
    """'' if the module computes the hf RMSNorm formula, else why not."""
    hook = getattr(module, "_hf_hook", None)  # accelerate: weights may live elsewhere until pre_forward
    device = getattr(hook, "execution_device", None) or weight.device
    dtype = weight.dtype if weight.is_floating_point() and weight.dtype in _PROBE_TOL else torch.float32
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(2, weight.shape[0], generator=gen).to(device=device, dtype=dtype) * 3 + 0.5
    try:
        with torch.no_grad():
            if hook is None:
                y = module.forward(x)  # bypasses torch forward hooks (a ShapeRecorder must not see probes)
                expected = reference.rms_norm(x, weight, eps, "hf")
            else:  # accelerate: the weight is only materialised between pre_forward and post_forward
                (x,), _ = hook.pre_forward(module, x)
                try:
                    y = module._old_forward(x)
                    expected = reference.rms_norm(x, module.weight, eps, "hf")
                finally:
                    hook.post_forward(module, x)
    except Exception as e:  # noqa: BLE001 - a module that cannot run on [2, D] is not an RMSNorm site
        return f"probe failed ({type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''})"
    if not isinstance(y, torch.Tensor) or y.shape != expected.shape:
        return "probe: output is not a tensor of the input's shape"
    diff = float((y.float() - expected.float()).abs().max())
    scale = float(expected.float().abs().max()) or 1.0
    if not diff <= _PROBE_TOL[dtype] * scale:
        return f"probe: output differs from the RMSNorm formula (max abs diff {diff:.3g})"
    return ""


def classify(path: str, module) -> Candidate | None:
    """A Candidate for modules shaped like a norm (1-D weight + eps), None for everything else."""
    weight = getattr(module, "weight", None)
    eps = _eps_of(module)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or eps is None:
        return None
    kind = site_kind(path)
    if module._parameters.get("weight") is not weight:
        return Candidate(path, module, kind, eps, False, "weight is not a registered nn.Parameter")
    if weight.is_meta and getattr(module, "_hf_hook", None) is None:
        name = type(module).__name__
        ok = name.endswith("RMSNorm") and "Gemma" not in name
        reason = "" if ok else f"meta device: {name} is not recognised as an RMSNorm by name"
        return Candidate(path, module, kind, eps, ok, reason)
    reason = _probe(module, weight, eps)
    return Candidate(path, module, kind, eps, not reason, reason)


def find_candidates(model: torch.nn.Module) -> list[Candidate]:
    """Every norm-shaped module once, with every path it is reachable by (shared modules have several)."""
    paths: dict[int, list[str]] = {}
    modules = {}
    for path, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), []).append(path)
        modules[id(module)] = module
    out = []
    for key, module_paths in paths.items():
        cand = classify(module_paths[0], modules[key])
        if cand is not None:
            cand.aliases = tuple(module_paths[1:])
            out.append(cand)
    return out


def selected(candidate: Candidate, patterns: list[str] | None) -> bool:
    """Glob selection by kind (`text.*`) or by any of the module's paths (`*.merger.ln_q`)."""
    if not patterns:
        return True
    names = [candidate.kind, *candidate.paths, *(site_kind(p) for p in candidate.aliases)]
    return any(fnmatch.fnmatchcase(name, p) for name in names for p in patterns)


def parse_sites(sites, argument: str = "sites") -> list[str] | None:
    """`sites=`: None, a comma-separated string of globs, or a list/tuple of glob strings."""
    if sites is None:
        return None
    if isinstance(sites, str):
        items = sites.split(",")
    elif isinstance(sites, (list, tuple)) and all(isinstance(s, str) for s in sites):
        items = list(sites)
    else:
        raise TypeError(f"{argument}: got {sites!r} ({type(sites).__name__}); expected None, a comma-separated string "
                        f"of globs, or a list of glob strings")
    items = [s.strip() for s in items if s.strip()]
    return items or None
