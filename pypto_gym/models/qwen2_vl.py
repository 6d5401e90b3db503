"""The Qwen2-VL family: the Qwen2.5-VL decoder's structure with a LayerNorm / QuickGELU vision tower.

Its text norms, MLPs and rotary embeddings are patched like Qwen2.5-VL's; its vision LayerNorms and
GELU MLPs are skipped by the rules' probes, with the reason. It shares Qwen2.5-VL's processor (the
same image tokens and chat template) and ships no tiny checkpoint of its own (tests build one from a
config).
"""
from __future__ import annotations

from . import qwen2_5_vl
from .common import TEXT_LINEARS_AFTER_NORM, TEXT_OWN_INPUT, check_model_dir, check_tokenizer_files, from_pretrained

NAME = "qwen2_vl"
MODEL_TYPES = ("qwen2_vl",)
MULTIMODAL = True
TINY_DIR = None
IMAGES = qwen2_5_vl.IMAGES
CALIBRATION_PROMPTS = qwen2_5_vl.CALIBRATION_PROMPTS
W8A8_LINEARS = TEXT_LINEARS_AFTER_NORM  # the vision tower's norms are LayerNorms: no int8 rows there
W8A8_OWN_INPUT = TEXT_OWN_INPUT  # the vision tower stays float with its LayerNorms
LEGACY_NAMES = qwen2_5_vl.LEGACY_NAMES


def load(path, dtype="auto", device="cpu"):
    from transformers import Qwen2VLForConditionalGeneration

    p = check_model_dir(path)
    check_tokenizer_files(p)
    return from_pretrained(Qwen2VLForConditionalGeneration, p, dtype, device), qwen2_5_vl.Processor(p)
