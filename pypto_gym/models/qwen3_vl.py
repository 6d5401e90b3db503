"""The Qwen3-VL family (Qwen3-VL, FireRed-OCR-2B and the other document models built on it): a vision tower of
LayerNorms with a bias and GELU MLPs, full attention per image, DeepStack mergers feeding the first decoder layers;
Qwen3's decoder (q/k norms) with interleaved MRoPE.

It shares Qwen2.5-VL's processor (the same image tokens and chat template; its image processor at patch 16). The
shipped tiny checkpoint (modeling/tiny_qwen3_vl) is Qwen3-VL-2B's config (modeling/qwen3_vl_2b, the published
dimensions) scaled down: 4 text layers (hidden 128, 4 heads of 32, 2 KV heads), 4 vision blocks (hidden 64, 4 heads of
16) with DeepStack taps after blocks 1 and 2; random weights from a fixed seed. Under W8A8 the decoder is Qwen3's
(its norms and MLPs hand over int8 rows); every vision linear quantises its own input (no LayerNorm or GELU kernel
here writes int8 rows), its smooth scale folding into the LayerNorm (weight and bias) or qkv that writes those rows.
"""
from __future__ import annotations

import json

from . import qwen2_5_vl
from .common import (LAYER_NORM_VISION_OWN_INPUT, MODELING_DIR, TEXT_OWN_INPUT, check_model_dir, check_tokenizer_files,
                     from_pretrained)
from .family import Family

TINY_DIR = MODELING_DIR / "tiny_qwen3_vl"
QWEN3_VL_2B_CONFIG = MODELING_DIR / "qwen3_vl_2b" / "config.json"  # FireRed-OCR-2B's base, at its real dimensions
IMAGE_PROCESSOR = {"processor_class": "Qwen3VLProcessor", "patch_size": 16, "image_mean": [0.5, 0.5, 0.5],
                   "image_std": [0.5, 0.5, 0.5], "min_pixels": 64 * 64, "max_pixels": 1024 * 32 * 32}


def tiny_config_dict(vocab_size: int, token_ids: dict) -> dict:
    """Qwen3-VL-2B's config scaled down: every site kind present (vision LayerNorms and GELU MLPs, the merger and the
    DeepStack mergers, the patch embedding; text q/k norms, interleaved MRoPE sections summing to head_dim / 2)."""
    cfg = json.loads(QWEN3_VL_2B_CONFIG.read_text())
    cfg.update(image_token_id=token_ids["<|image_pad|>"], video_token_id=token_ids["<|video_pad|>"],
               vision_start_token_id=token_ids["<|vision_start|>"], vision_end_token_id=token_ids["<|vision_end|>"])
    cfg["text_config"] = dict(
        cfg["text_config"], hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, vocab_size=vocab_size,
        rope_scaling={"mrope_interleaved": True, "mrope_section": [6, 5, 5], "rope_type": "default"},
        bos_token_id=token_ids["<|endoftext|>"], eos_token_id=token_ids["<|im_end|>"],
        pad_token_id=token_ids["<|endoftext|>"])
    cfg["vision_config"] = dict(cfg["vision_config"], depth=4, hidden_size=64, intermediate_size=128, num_heads=4,
                                out_hidden_size=128, num_position_embeddings=64, deepstack_visual_indexes=[1, 2])
    return cfg


def load(path=TINY_DIR, dtype="auto", device="cpu"):
    """Load a Qwen3-VL-family checkpoint (the embedded one or any local download) offline."""
    from transformers import Qwen3VLForConditionalGeneration

    p = check_model_dir(path)
    check_tokenizer_files(p)
    return from_pretrained(Qwen3VLForConditionalGeneration, p, dtype, device), qwen2_5_vl.Processor(p)


def random_model(config_path=QWEN3_VL_2B_CONFIG, num_layers: int | None = None, vision_depth: int | None = None,
                 dtype="bfloat16", seed: int = 0):
    """(model, processor): a Qwen3-VL at a real config's dimensions with random weights, driven by the embedded
    tokenizer (qwen2_5_vl.random_model's rule: fewer layers or blocks, each at its real shapes; the DeepStack taps
    past the kept blocks dropped)."""
    raw = qwen2_5_vl.read_config(config_path)
    if num_layers is not None:
        raw["text_config"]["num_hidden_layers"] = num_layers
    if vision_depth is not None:
        vc = raw["vision_config"]
        vc["depth"] = vision_depth
        vc["deepstack_visual_indexes"] = [i for i in vc.get("deepstack_visual_indexes", []) if i < vision_depth]
    processor = qwen2_5_vl.Processor(TINY_DIR)  # the embedded tokenizer, and the image processor at patch 16
    ids = processor.token_ids()
    raw.update({k: ids[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                    "vision_end_token_id")})
    raw["text_config"].update({k: ids[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    return qwen2_5_vl.build_random(raw, "Qwen3VLForConditionalGeneration", dtype, seed), processor


def text_only_config(config):
    """Qwen3's config of this model's decoder: on a text-only prompt the three MRoPE position rows are equal, so the
    interleaved sections read one position and the rotary is Qwen3's at the same rope_theta; no DeepStack features
    are added; the layers (q/k norms, SwiGLU MLP) are Qwen3's."""
    from transformers import Qwen3Config

    text = config.text_config.to_dict()
    rope = text.get("rope_parameters") or {}  # transformers 5.x; 4.57 keeps rope_theta on the config
    theta = rope.get("rope_theta", text.get("rope_theta"))
    keep = set(Qwen3Config().to_dict()) - {"architectures", "model_type", "transformers_version", "dtype",
                                             "torch_dtype", "rope_parameters", "rope_scaling", "rope_theta",
                                             "layer_types", "tie_word_embeddings"}
    return Qwen3Config(**{k: v for k, v in text.items() if k in keep}, rope_theta=theta,
                       tie_word_embeddings=config.tie_word_embeddings, architectures=["Qwen3ForCausalLM"],
                       dtype=text.get("dtype") or text.get("torch_dtype"))


def build_tiny(out=TINY_DIR, seed: int = 0) -> None:
    """The tiny checkpoint (module docstring); its images are Qwen2.5-VL's (modeling/tiny_qwen2_5_vl)."""
    qwen2_5_vl.write_vl_tiny(out, tiny_config_dict, "Qwen3VLForConditionalGeneration", IMAGE_PROCESSOR, seed)


FAMILY = Family(name="qwen3_vl", model_types=("qwen3_vl",), multimodal=True, load=load, tiny_dir=TINY_DIR,
                build_tiny=build_tiny, random_model=random_model, images=qwen2_5_vl.IMAGES,
                calibration_prompts=qwen2_5_vl.CALIBRATION_PROMPTS,
                w8a8_own_input={**TEXT_OWN_INPUT, **LAYER_NORM_VISION_OWN_INPUT}, text_only_config=text_only_config)
