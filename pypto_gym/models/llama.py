"""Llama (Llama 2/3 and the many models with its structure): RMSNorms, SwiGLU MLPs, RoPE, no biases.

The shipped tiny checkpoint (modeling/tiny_llama) has Llama's structure at toy size: 4 layers,
hidden 128, 4 heads and 2 KV heads, untied embeddings, a Llama-3 style chat template; random
weights from a fixed seed.
"""
from __future__ import annotations

from .common import (MODELING_DIR, TEXT_LINEARS_AFTER_NORM, TEXT_OWN_INPUT, TEXT_PROMPTS, TextProcessor,
                     build_text_tiny, from_pretrained)

NAME = "llama"
MODEL_TYPES = ("llama",)
MULTIMODAL = False
TINY_DIR = MODELING_DIR / "tiny_llama"
IMAGES: tuple = ()
CALIBRATION_PROMPTS = TEXT_PROMPTS
W8A8_LINEARS = TEXT_LINEARS_AFTER_NORM  # the linears that read each norm kind's rows
W8A8_OWN_INPUT = TEXT_OWN_INPUT  # ... and the one that quantises its own input
LEGACY_NAMES = ()  # checkpoint tensor names are the module paths
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHAT_TEMPLATE = ("<|begin_of_text|>{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
                 "<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>{% endfor %}"
                 "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def load(path=TINY_DIR, dtype="auto", device="cpu"):
    from transformers import AutoModelForCausalLM

    return from_pretrained(AutoModelForCausalLM, path, dtype, device), TextProcessor(path)


def build_tiny(out=TINY_DIR, seed: int = 0) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    build_text_tiny(out, LlamaConfig, dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                           num_attention_heads=4, num_key_value_heads=2,
                                           max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=500000.0,
                                           tie_word_embeddings=False),
                    SPECIAL_TOKENS, "<|eot_id|>", "<|begin_of_text|>", CHAT_TEMPLATE, "PreTrainedTokenizerFast",
                    LlamaForCausalLM, seed)
