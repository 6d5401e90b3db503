"""Qwen3 (and Qwen3-VL's text model): q/k RMSNorm per head before RoPE, SwiGLU MLPs, no biases.

The shipped tiny checkpoint (modeling/tiny_qwen3) has Qwen3's structure at toy size: 4 layers,
hidden 128, 4 heads of 32 and 2 KV heads, a ChatML template; random weights from a fixed seed.
"""
from __future__ import annotations

from .common import (MODELING_DIR, TEXT_LINEARS_AFTER_NORM, TEXT_OWN_INPUT, TEXT_PROMPTS, TextProcessor,
                     build_text_tiny, from_pretrained)

NAME = "qwen3"
MODEL_TYPES = ("qwen3",)
MULTIMODAL = False
TINY_DIR = MODELING_DIR / "tiny_qwen3"
IMAGES: tuple = ()
CALIBRATION_PROMPTS = TEXT_PROMPTS
W8A8_LINEARS = TEXT_LINEARS_AFTER_NORM  # the linears that read each norm kind's rows
W8A8_OWN_INPUT = TEXT_OWN_INPUT  # ... and the one that quantises its own input
LEGACY_NAMES = ()  # checkpoint tensor names are the module paths
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def load(path=TINY_DIR, dtype="auto", device="cpu"):
    from transformers import AutoModelForCausalLM

    return from_pretrained(AutoModelForCausalLM, path, dtype, device), TextProcessor(path)


def build_tiny(out=TINY_DIR, seed: int = 0) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    build_text_tiny(out, Qwen3Config, dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                           max_position_embeddings=4096, rms_norm_eps=1e-6,
                                           tie_word_embeddings=True),
                    SPECIAL_TOKENS, "<|im_end|>", "<|endoftext|>", CHAT_TEMPLATE, "Qwen2Tokenizer", Qwen3ForCausalLM,
                    seed)
