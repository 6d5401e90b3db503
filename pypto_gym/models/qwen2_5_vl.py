"""The Qwen2.5-VL family (Qwen2.5-VL, GutenOCR-3B): loader and processor, the tiny checkpoint, the
GutenOCR-3B random-weight builder, W8A8 linear tables and calibration prompts.

The patcher itself is model-agnostic (it finds sites by structure and math, not by class name);
what lives here is what only this family needs: its special tokens and chat template, the image
half of its processor, where its norms' int8 rows go, and how to build it without a download.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

from .common import (MODELING_DIR, TEXT_LINEARS_AFTER_NORM, TEXT_OWN_INPUT, check_model_dir, check_tokenizer_files,
                     from_pretrained, randomise_norms, save_tokenizer, save_weights, train_tokenizer)
from .family import Family

TINY_DIR = MODELING_DIR / "tiny_qwen2_5_vl"
GUTENOCR_CONFIG = MODELING_DIR / "gutenocr_3b" / "config.json"
SAMPLE_IMAGE = TINY_DIR / "sample.png"
DOCUMENT_IMAGE = MODELING_DIR / "gutenocr_3b" / "document.png"
IMAGES = (SAMPLE_IMAGE, DOCUMENT_IMAGE)  # capture and calibration inputs: a text line, a document page
CALIBRATION_PROMPTS = ["Read the text in the image.", "What is written in this document?",
                       "Transcribe every line of the page.", "Describe the layout of this image."]

# W8A8: the linears that read each norm kind's output rows directly, relative to the norm's parent, so
# the norm can hand them int8 rows: the decoder's, and Qwen2.5-VL's vision blocks.
_W8A8_LINEARS = {
    **TEXT_LINEARS_AFTER_NORM,
    "vision.norm1": ("attn.qkv",),
    "vision.norm2": ("mlp.gate_proj", "mlp.up_proj"),
}
# ...and, by path suffix, those whose input no fused op produces, which quantise it themselves
# (dynamic_quant), each with where its smooth scale folds (quant/fold.py): o_proj and the vision
# attn.proj (after attention: v_proj's rows, qkv's v third), the merger's mlp.0 (ln_q's rows regrouped,
# 4 of 1280 as one of 5120: ln_q's weight) and mlp.2 (after its GELU: nowhere, so it is not smoothed).
_W8A8_OWN_INPUT = {**TEXT_OWN_INPUT, "attn.proj": ("attn.qkv", "v_third"), "merger.mlp.0": ("merger.ln_q", "tiled"),
                  "merger.mlp.2": None}

# Checkpoint tensor names in the layout transformers 4.x wrote (and 5.x's save_pretrained still writes, and
# llm-compressor then keeps) -> the module paths transformers 5.x loads them into (its conversion mapping).
LEGACY_NAMES = ((r"^visual\.", "model.visual."), (r"^model\.(?!language_model\.|visual\.)", "model.language_model."))

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


def random_model(config_path=GUTENOCR_CONFIG, num_layers: int | None = None, vision_depth: int | None = None,
                 dtype="bfloat16", seed: int = 0):
    """(model, processor): a model at a real architecture's dimensions with random weights (no download),
    driven by the embedded tokenizer.

    ``num_layers``/``vision_depth`` reduce the depth (shapes per layer stay the real ones), so
    shape capture and benchmarks run at GutenOCR-3B's D=2048 / 1280 on a laptop. The special-token
    ids are re-pointed at the embedded tokenizer, so it can drive a model with GutenOCR-3B's vocabulary.
    """
    raw = read_config(config_path)
    if num_layers is not None:
        raw["num_hidden_layers"] = num_layers
        raw["max_window_layers"] = min(raw.get("max_window_layers", num_layers), num_layers)
    if vision_depth is not None:
        vc = raw["vision_config"]
        vc["depth"] = vision_depth
        vc["fullatt_block_indexes"] = [i for i in vc.get("fullatt_block_indexes", []) if i < vision_depth] \
            or [vision_depth - 1]
    processor = Processor(TINY_DIR)
    raw.update(processor.token_ids())
    return build_random(raw, "Qwen2_5_VLForConditionalGeneration", dtype, seed), processor


def read_config(config_path) -> dict:
    """A config.json for random_model, refused naming --config when it is not there."""
    path = Path(config_path)
    if not path.is_file():
        raise FileNotFoundError(f"--config: no config file at {path}")
    return copy.deepcopy(json.loads(path.read_text()))


def build_random(raw: dict, model_class: str, dtype="bfloat16", seed: int = 0):
    """transformers' `model_class` of config `raw` with random weights from `seed`, built in `dtype`."""
    import torch
    import transformers
    from transformers import AutoConfig

    config = AutoConfig.for_model(**raw)
    torch.manual_seed(seed)
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)  # build directly in the target dtype: half the peak memory
    try:
        model = getattr(transformers, model_class)(config)
    finally:
        torch.set_default_dtype(prev)
    # the config's own torch_dtype (bfloat16) wins over the default for the text model: cast the rest
    return model.to(torch_dtype).eval()


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

    def save_pretrained(self, out) -> None:
        """The tokenizer and image-processor files, as this class and AutoProcessor read them back."""
        self.tokenizer.save_pretrained(out)
        self.image_processor.save_pretrained(out)

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


def load(path=TINY_DIR, dtype="auto", device="cpu"):
    """Load a Qwen2.5-VL-family checkpoint (embedded, GutenOCR-3B or any local download) offline."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    p = check_model_dir(path)
    check_tokenizer_files(p)
    try:
        processor = Processor(p)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model: could not load the processor of {p}: {str(e).splitlines()[0]}") from None
    return from_pretrained(Qwen2_5_VLForConditionalGeneration, p, dtype, device), processor


IMAGE_PROCESSOR = {  # Qwen2.5-VL's preprocessor_config.json (a Qwen3-VL family overrides patch size and mean/std)
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
    "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
    "rescale_factor": 1 / 255, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711], "patch_size": 14, "temporal_patch_size": 2,
    "merge_size": 2, "min_pixels": 56 * 56, "max_pixels": 1280 * 28 * 28, "resample": 3,
}


def write_vl_tiny(out, config_for, model_class: str, image_processor: dict, seed: int = 0) -> None:
    """A tiny vision-language checkpoint of this processor's kind (Qwen2.5-VL's tokens and chat template): a BPE
    tokenizer trained on the shipped corpus, `config_for(vocab_size, token_ids)` as config.json, random weights of
    transformers' `model_class` from `seed`, the image processor's config. Running it twice gives identical files."""
    import torch
    import transformers
    from transformers import AutoConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(SPECIAL_TOKENS, "<|im_end|>", "<|endoftext|>", CHAT_TEMPLATE)
    save_tokenizer(tokenizer, out, "Qwen2Tokenizer")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    cfg = config_for(len(tokenizer), ids)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"], "do_sample": False}, indent=2) + "\n")
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(AutoConfig.from_pretrained(out)).to(torch.bfloat16).eval()
    randomise_norms(model)
    save_weights(model, out, skip={"lm_head.weight"})
    (out / "preprocessor_config.json").write_text(json.dumps({**IMAGE_PROCESSOR, **image_processor}, indent=2) + "\n")


def build_tiny(out=TINY_DIR, seed: int = 0) -> None:
    """The embedded checkpoint: GutenOCR-3B's config scaled down (same structure and eps), a BPE tokenizer
    trained on the shipped corpus, random weights from `seed`, the sample images. Running it twice gives
    identical files."""
    write_vl_tiny(out, tiny_config_dict, "Qwen2_5_VLForConditionalGeneration", {}, seed)
    _render_sample_image(Path(out) / "sample.png")
    _render_document_image(DOCUMENT_IMAGE)


def _render_sample_image(path: Path) -> None:
    """A small rendered line of text: the kind of input an OCR model reads."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (224, 56), "white")
    ImageDraw.Draw(img).text((8, 20), "pypto-gym RMSNorm 2048", fill="black")
    img.save(path, optimize=False)


def _render_document_image(path: Path) -> None:
    """A page-sized scan (728x1008, 936 merged vision tokens): the prefill shapes of real OCR."""
    from PIL import Image, ImageDraw

    from .common import CORPUS

    img = Image.new("RGB", (728, 1008), "white")
    draw = ImageDraw.Draw(img)
    lines = [line for line in CORPUS.read_text().splitlines() if line.strip()]
    for i in range(60):
        draw.text((24, 24 + 16 * i), lines[i % len(lines)][:110], fill="black")
    img.save(path, optimize=False)


FAMILY = Family(name="qwen2_5_vl", model_types=("qwen2_5_vl",), multimodal=True, load=load, tiny_dir=TINY_DIR,
                build_tiny=build_tiny, random_model=random_model, images=IMAGES,
                calibration_prompts=CALIBRATION_PROMPTS,
                w8a8_linears=_W8A8_LINEARS, w8a8_own_input=_W8A8_OWN_INPUT, legacy_names=LEGACY_NAMES)
