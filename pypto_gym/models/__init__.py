"""Model families: what pypto-gym knows per family (a `Family`, models/family.py), one module each, found from
`config.model_type`. Families: Qwen2.5-VL (with GutenOCR-3B), Qwen2-VL, Qwen3-VL, Qwen3, Llama.
"""
from __future__ import annotations

from . import llama, qwen2_5_vl, qwen2_vl, qwen3, qwen3_vl
from .common import model_type
from .family import Family

FAMILIES: dict[str, Family] = {m.FAMILY.name: m.FAMILY for m in (qwen2_5_vl, qwen2_vl, qwen3_vl, qwen3, llama)}
DEFAULT = qwen2_5_vl.FAMILY  # the embedded checkpoint the scripts run without --model


def family(model_type_name: str) -> Family:
    """The family of a `config.model_type`; refused naming the type and the known ones."""
    for f in FAMILIES.values():
        if model_type_name in f.model_types:
            return f
    known = ", ".join(t for f in FAMILIES.values() for t in f.model_types)
    raise ValueError(f"model_type {model_type_name!r} is not a family pypto-gym knows ({known})")


def family_of(model) -> Family | None:
    """The family of a loaded model (from its config), or None for a model of no known family."""
    name = getattr(getattr(model, "config", None), "model_type", None)
    return next((f for f in FAMILIES.values() if name in f.model_types), None)


def load(path=None, dtype="auto", device="cpu"):
    """(model, processor, family) for a checkpoint directory of any known family (default: the embedded one)."""
    f = DEFAULT if path is None else family(model_type(path))
    model, processor = f.load(f.tiny_dir if path is None else path, dtype, device)
    return model, processor, f


def tiny_families() -> list[Family]:
    """The families that ship a tiny checkpoint (and a committed case file captured from it)."""
    return [f for f in FAMILIES.values() if f.tiny_dir is not None]
