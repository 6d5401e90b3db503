"""Model families: what pypto-gym knows per family, one module each, found from `config.model_type`.

Every family module provides: NAME, MODEL_TYPES, MULTIMODAL, TINY_DIR (its shipped tiny checkpoint,
or None), IMAGES and CALIBRATION_PROMPTS (default capture and calibration inputs), W8A8_LINEARS
(which linears read each norm kind's rows) and W8A8_OWN_INPUT (path suffixes of the linears that quantise
their own input -> where their smooth scale folds, or None), LEGACY_NAMES (regex renames of older checkpoint
tensor names to module paths), `load(path, dtype, device) -> (model,
processor)`, and, with a tiny checkpoint, `build_tiny(out)`. Families: Qwen2.5-VL (with GutenOCR-3B),
Qwen2-VL, Qwen3, Llama.
"""
from __future__ import annotations

from . import llama, qwen2_5_vl, qwen2_vl, qwen3
from .common import model_type

FAMILIES = {f.NAME: f for f in (qwen2_5_vl, qwen2_vl, qwen3, llama)}
DEFAULT = qwen2_5_vl  # the embedded checkpoint the scripts run without --model


def family(model_type_name: str):
    """The family module of a `config.model_type`; refused naming the type and the known ones."""
    for f in FAMILIES.values():
        if model_type_name in f.MODEL_TYPES:
            return f
    known = ", ".join(t for f in FAMILIES.values() for t in f.MODEL_TYPES)
    raise ValueError(f"model_type {model_type_name!r} is not a family pypto-gym knows ({known})")


def family_of(model):
    """The family of a loaded model (from its config), or None for a model of no known family."""
    name = getattr(getattr(model, "config", None), "model_type", None)
    return next((f for f in FAMILIES.values() if name in f.MODEL_TYPES), None)


def load(path=None, dtype="auto", device="cpu"):
    """(model, processor, family) for a checkpoint directory of any known family (default: the embedded one)."""
    f = DEFAULT if path is None else family(model_type(path))
    model, processor = f.load(f.TINY_DIR if path is None else path, dtype, device)
    return model, processor, f


def tiny_families():
    """The families that ship a tiny checkpoint (and a committed case file captured from it)."""
    return [f for f in FAMILIES.values() if f.TINY_DIR is not None]
