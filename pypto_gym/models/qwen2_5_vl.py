"""Everything pypto-gym knows about the Qwen2.5-VL family (Qwen2.5-VL, GutenOCR-3B).

Kept in one place: the special tokens and chat template of the embedded checkpoint, its tiny
config, the GutenOCR-3B random-weight builder, and the loader used by the scripts. The patcher
itself is model-agnostic (it finds norms by structure and math, not by class name).
"""
from __future__ import annotations

import copy
import importlib
import json
import os
from pathlib import Path

MODELING_DIR = Path(importlib.import_module("pypto_gym.modeling").__file__).parent  # modeling/, installed too
TINY_DIR = MODELING_DIR / "tiny_qwen2_5_vl"
GUTENOCR_CONFIG = MODELING_DIR / "gutenocr_3b" / "config.json"
SAMPLE_IMAGE = TINY_DIR / "sample.png"
DOCUMENT_IMAGE = MODELING_DIR / "gutenocr_3b" / "document.png"

# W8A8: the linears that read each norm kind's output rows directly, relative to the norm's parent
# ("<lm_head>": the model's output embedding), so the norm can hand them int8 rows. Qwen2/2.5/3
# decoders share the text names; the vision names are Qwen2.5-VL's blocks.
LINEARS_AFTER_NORM = {
    "text.input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "text.post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
    "text.norm": ("<lm_head>",),
    "vision.norm1": ("attn.qkv",),
    "vision.norm2": ("mlp.gate_proj", "mlp.up_proj"),
}
# ...and those that read a norm's output regrouped (the merger folds 4 rows of 1280 into one of 5120):
# their rows are not the norm's rows, so they quantise their input themselves.
LINEARS_AFTER_REGROUPED_NORM = {"vision.merger.ln_q": ("mlp.0",)}

SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]

# Qwen2-VL's chat template (the one Qwen2.5-VL and GutenOCR-3B ship).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_config_dict(vocab_size: int, token_ids: dict) -> dict:
    """The embedded checkpoint: GutenOCR-3B's config scaled down, same structure and eps.

    4 text layers (hidden 128, 4 heads, 2 KV heads) and 4 vision blocks (hidden 64) keep every
    norm kind present (vision norm1/norm2, merger ln_q, text input/post-attention, final norm)
    while the checkpoint stays well under a megabyte.
    """
    cfg = json.loads(GUTENOCR_CONFIG.read_text())
    cfg.update({
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "max_window_layers": 4, "vocab_size": vocab_size, "sliding_window": 4096,
        "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
        "bos_token_id": token_ids["<|endoftext|>"], "eos_token_id": token_ids["<|im_end|>"],
        "pad_token_id": token_ids["<|endoftext|>"],
        "vision_start_token_id": token_ids["<|vision_start|>"],
        "vision_end_token_id": token_ids["<|vision_end|>"],
        "vision_token_id": token_ids["<|vision_pad|>"],
        "image_token_id": token_ids["<|image_pad|>"], "video_token_id": token_ids["<|video_pad|>"],
    })
    cfg["vision_config"] = dict(cfg["vision_config"], depth=4, hidden_size=64, intermediate_size=128,
                                num_heads=4, out_hidden_size=128, fullatt_block_indexes=[1, 3])
    return cfg


def build_random_model(config_path=GUTENOCR_CONFIG, num_layers: int | None = None,
                       vision_depth: int | None = None, dtype="bfloat16", seed: int = 0,
                       token_ids: dict | None = None):
    """A model at a real architecture's dimensions with random weights (no download).

    ``num_layers``/``vision_depth`` reduce the depth (shapes per layer stay the real ones), so
    shape capture and benchmarks run at GutenOCR-3B's D=2048 / 1280 on a laptop. ``token_ids``
    (from `Processor.token_ids()`) re-points the special-token ids at the tokenizer in use, so the
    embedded tokenizer can drive a model with GutenOCR-3B's vocabulary.
    """
    import torch
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    path = Path(config_path)
    if not path.is_file():
        raise FileNotFoundError(f"--config: no config file at {path}")
    raw = json.loads(path.read_text())
    raw = copy.deepcopy(raw)
    if num_layers is not None:
        raw["num_hidden_layers"] = num_layers
        raw["max_window_layers"] = min(raw.get("max_window_layers", num_layers), num_layers)
    if vision_depth is not None:
        vc = raw["vision_config"]
        vc["depth"] = vision_depth
        vc["fullatt_block_indexes"] = [i for i in vc.get("fullatt_block_indexes", []) if i < vision_depth] \
            or [vision_depth - 1]
    raw.update(token_ids or {})
    config = AutoConfig.for_model(**raw)
    torch.manual_seed(seed)
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)  # build directly in the target dtype: half the peak memory
    try:
        model = Qwen2_5_VLForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(prev)
    # the config's own torch_dtype (bfloat16) wins over the default for the text model: cast the rest
    return model.to(torch_dtype).eval()


def check_model_dir(path) -> Path:
    """Refuse a missing or incomplete checkpoint directory with a one-line message."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"--model: {p} is not a directory")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"--model: {p} has no config.json")
    try:
        json.loads((p / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--model: {p / 'config.json'} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        raise FileNotFoundError(f"--model: {p} has no *.safetensors weights")
    return p


class Processor:
    """Tokenizer + PIL image processor: Qwen2.5-VL's processor without its video half.

    transformers' ``AutoProcessor`` also builds the video processor, which needs torchvision;
    this toolkit feeds only images and text, so it does the processor's two jobs itself: expand
    each ``<|image_pad|>`` to the image's merged patch count and, where the installed
    transformers wants it (5.x), mark image tokens in ``mm_token_type_ids`` for M-RoPE.
    """

    def __init__(self, path):
        from transformers import AutoImageProcessor, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.image_processor = AutoImageProcessor.from_pretrained(path)
        self.image_token = "<|image_pad|>"
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.image_token)

    def token_ids(self) -> dict:
        """Special-token ids of this tokenizer under the config keys Qwen2.5-VL uses."""
        ids = {t: self.tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
        return {"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
                "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
                "vision_token_id": ids["<|vision_pad|>"], "eos_token_id": ids["<|im_end|>"],
                "bos_token_id": ids["<|endoftext|>"], "pad_token_id": ids["<|endoftext|>"]}

    def chat_text(self, prompt: str, with_image: bool = True) -> str:
        content = ([{"type": "image"}] if with_image else []) + [{"type": "text", "text": prompt}]
        return self.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                  tokenize=False, add_generation_prompt=True)

    def __call__(self, prompts, images=None, model=None):
        """Batch of prompts (one image each, or none) -> model inputs, left-padded for generate."""
        import inspect

        import torch

        images = images or [None] * len(prompts)
        texts, out = [], {}
        pix = [im for im in images if im is not None]
        if pix:
            vis = self.image_processor(images=pix, return_tensors="pt")
            out.update(pixel_values=vis["pixel_values"], image_grid_thw=vis["image_grid_thw"])
        merge = self.image_processor.merge_size ** 2
        grids = iter(out.get("image_grid_thw", []))
        for prompt, image in zip(prompts, images):
            text = self.chat_text(prompt, with_image=image is not None)
            if image is not None:
                n = int(next(grids).prod()) // merge
                text = text.replace(self.image_token, self.image_token * n, 1)
            texts.append(text)
        self.tokenizer.padding_side = "left"
        enc = self.tokenizer(texts, return_tensors="pt", padding=True)
        out.update(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
        if model is not None and "mm_token_type_ids" in inspect.signature(model.forward).parameters:
            out["mm_token_type_ids"] = (enc["input_ids"] == self.image_token_id).to(torch.int32)
        return out

    def decode(self, ids):
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)


def load_model_and_processor(path=TINY_DIR, dtype="auto", device="cpu"):
    """Load a Qwen2.5-VL-family checkpoint (embedded, GutenOCR-3B or any local download) offline."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    p = check_model_dir(path)
    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    try:
        processor = Processor(p)
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(p, dtype=torch_dtype)
    except (OSError, ValueError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--model: could not load {p}: {first}") from None
    return model.to(device).eval(), processor
