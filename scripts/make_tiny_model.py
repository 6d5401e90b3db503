"""Build the embedded tiny Qwen2.5-VL checkpoint in ``modeling/tiny_qwen2_5_vl``.

The checkpoint lets every test and the demo run a *real* transformers Qwen2.5-VL model (same
classes, same processor, same chat template as Qwen2.5-VL / GutenOCR-3B) with no model hub:
a byte-level BPE tokenizer is trained offline on ``corpus.txt``, the weights are random from a
fixed seed, and the sample image is rendered with PIL. Running it twice gives identical files.

    python scripts/make_tiny_model.py [--out modeling/tiny_qwen2_5_vl]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pypto_gym.models.qwen2_5_vl import (  # noqa: E402
    SPECIAL_TOKENS,
    CHAT_TEMPLATE,
    DOCUMENT_IMAGE,
    TINY_DIR,
    tiny_config_dict,
)


def build_tokenizer(corpus: Path, vocab_size: int):
    """Train a byte-level BPE on the shipped corpus and wrap it as a Qwen2 fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(corpus)], trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )


def render_sample_image(path: Path) -> None:
    """A small rendered line of text: the kind of input an OCR model reads."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (224, 56), "white")
    ImageDraw.Draw(img).text((8, 20), "pypto-gym RMSNorm 2048", fill="black")
    img.save(path, optimize=False)


def render_document_image(path: Path, corpus: Path) -> None:
    """A page-sized scan (728x1008, 936 merged vision tokens): the prefill shapes of real OCR."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (728, 1008), "white")
    draw = ImageDraw.Draw(img)
    lines = [l for l in corpus.read_text().splitlines() if l.strip()]
    for i in range(60):
        draw.text((24, 24 + 16 * i), lines[i % len(lines)][:110], fill="black")
    img.save(path, optimize=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=TINY_DIR)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    import torch
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    print("[1/4] training tokenizer", flush=True)
    tokenizer = build_tokenizer(TINY_DIR / "corpus.txt", vocab_size=640)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    # Name the class both transformers 4.57 (Qwen2TokenizerFast) and 5.x resolve.
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg.pop("backend", None)
    tok_cfg["tokenizer_class"] = "Qwen2Tokenizer"
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}

    print("[2/4] writing config", flush=True)
    cfg = tiny_config_dict(vocab_size=len(tokenizer), token_ids=ids)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"], "do_sample": False,
    }, indent=2) + "\n")

    print("[3/4] building random weights (seed %d)" % args.seed, flush=True)
    torch.manual_seed(args.seed)
    config = AutoConfig.from_pretrained(out)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16).eval()
    with torch.no_grad():  # random (not ones) norm weights, so a wrong gamma shows up in tests
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".norm1." in name or ".norm2." in name or "ln_q" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    print("[4/4] image processor config and sample image", flush=True)
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
        "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
        "rescale_factor": 1 / 255, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2, "min_pixels": 56 * 56, "max_pixels": 1280 * 28 * 28, "resample": 3,
    }, indent=2) + "\n")
    render_sample_image(out / "sample.png")
    render_document_image(DOCUMENT_IMAGE, TINY_DIR / "corpus.txt")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
