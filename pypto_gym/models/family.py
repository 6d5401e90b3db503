"""A model family as data: what pypto-gym needs to know of one, and the table every text-only family fills in.

The patcher finds sites by structure and math, never by class name, so a family holds only what cannot be found
that way: how to load a checkpoint and build its tiny one, its default capture and calibration inputs, and W8A8's
tables (which linears read each norm kind's rows; which linears quantise their own input and where their smooth
scale folds). A text-only family with a ChatML- or Llama-style template is one `text_family(...)` call.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .common import (MODELING_DIR, TEXT_LINEARS_AFTER_NORM, TEXT_OWN_INPUT, TEXT_PROMPTS, TextProcessor,
                     build_text_tiny, from_pretrained)


@dataclass(frozen=True)
class Family:
    """One model family.

    `load(path, dtype, device) -> (model, processor)`; `build_tiny(out)` writes the tiny checkpoint shipped in
    `tiny_dir` (None: the family ships none); `random_model(config_path, num_layers, vision_depth, dtype) -> (model,
    processor)` builds one at a real config's dimensions with random weights (`--config`; None: not for this
    family). `w8a8_linears`: norm kind -> linears (relative to the norm's parent) that read its rows;
    `w8a8_own_input`: linear path suffix -> (where its smooth scale folds, fold kind) or None (quant/fold.py).
    `legacy_names`: regex renames of older checkpoint tensor names to module paths. `text_only_config(config)`: the
    config of a text-only model (a ForCausalLM) that computes this family's decoder as it runs a text-only prompt,
    under `model.*` where this family's is under `model.language_model.*` (`export --text-only`: what vLLM's text
    engines serve); None: no such export."""

    name: str
    model_types: tuple[str, ...]
    multimodal: bool
    load: Callable
    tiny_dir: Path | None = None
    build_tiny: Callable | None = None
    random_model: Callable | None = None
    images: tuple = ()
    calibration_prompts: list[str] = field(default_factory=lambda: list(TEXT_PROMPTS))
    w8a8_linears: dict = field(default_factory=lambda: dict(TEXT_LINEARS_AFTER_NORM))
    w8a8_own_input: dict = field(default_factory=lambda: dict(TEXT_OWN_INPUT))
    legacy_names: tuple = ()
    text_only_config: Callable | None = None


def text_family(name: str, model_class: str, config_class: str, tiny: dict, special_tokens: list[str], eos: str,
                pad: str, chat_template: str, tokenizer_class: str) -> Family:
    """A text-only family of transformers' `model_class` (a ForCausalLM): loaded with AutoModelForCausalLM and a
    TextProcessor, its tiny checkpoint (modeling/tiny_<name>) built from `config_class(**tiny)` with a tokenizer
    trained on the shipped corpus; the decoder's W8A8 tables and text calibration prompts."""
    tiny_dir = MODELING_DIR / f"tiny_{name}"

    def load(path=tiny_dir, dtype="auto", device="cpu"):
        from transformers import AutoModelForCausalLM

        return from_pretrained(AutoModelForCausalLM, path, dtype, device), TextProcessor(path)

    def build_tiny(out=tiny_dir, seed: int = 0) -> None:
        import transformers

        build_text_tiny(Path(out), getattr(transformers, config_class), tiny, special_tokens, eos, pad, chat_template,
                        tokenizer_class, getattr(transformers, model_class), seed)

    return Family(name=name, model_types=(name,), multimodal=False, load=load, tiny_dir=tiny_dir,
                  build_tiny=build_tiny)
