"""The Qwen2-VL family: the Qwen2.5-VL decoder's structure with a LayerNorm / QuickGELU vision tower.

Its text norms, MLPs and rotary embeddings are patched like Qwen2.5-VL's, and its vision LayerNorms by the layer_norm
rule; under W8A8 its vision linears quantise their own input (its norms hand over no int8 rows: the LayerNorm vision
table of models/common.py, Qwen3-VL's too). It shares Qwen2.5-VL's processor (the same image tokens and chat
template) and ships no tiny checkpoint of its own (tests build one from a config).
"""
from . import qwen2_5_vl
from .common import (LAYER_NORM_VISION_OWN_INPUT, TEXT_OWN_INPUT, check_model_dir, check_tokenizer_files,
                     from_pretrained)
from .family import Family


def load(path, dtype="auto", device="cpu"):
    from transformers import Qwen2VLForConditionalGeneration

    p = check_model_dir(path)
    check_tokenizer_files(p)
    return from_pretrained(Qwen2VLForConditionalGeneration, p, dtype, device), qwen2_5_vl.Processor(p)


FAMILY = Family(name="qwen2_vl", model_types=("qwen2_vl",), multimodal=True, load=load,
                images=qwen2_5_vl.IMAGES, calibration_prompts=qwen2_5_vl.CALIBRATION_PROMPTS,
                w8a8_own_input={**TEXT_OWN_INPUT, **LAYER_NORM_VISION_OWN_INPUT}, legacy_names=qwen2_5_vl.LEGACY_NAMES)
