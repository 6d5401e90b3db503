"""Writes tests/fixtures/llmcompressor_w8a8/: the embedded tiny Qwen2.5-VL quantised by llm-compressor itself.

Its recipe for W8A8 with SmoothQuant (SmoothQuantModifier, then QuantizationModifier with the W8A8
preset: int8 per-channel weights, int8 dynamic per-token activations; lm_head and the vision tower
left float, as llm-compressor's Qwen2.5-VL examples do), calibrated on the family's calibration
prompts, on the CPU, saved compressed. The test suite loads it onto pypto-gym's fused kernels
(tests/test_export.py).

llm-compressor 0.14 pins transformers <= 5.17 and compressed-tensors 0.19, so it runs in its own
environment:

    python3 -m venv .venv-llmc
    .venv-llmc/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1 "transformers==5.17.*"
    .venv-llmc/bin/python scripts/make_llmcompressor_fixture.py

It imports nothing of pypto_gym (whose requirements that environment does not meet): the prompts and
paths are below. `bench w8a8 --llmcompressor PYTHON` runs it on the bench's own models with
`--source DIR --out DIR --inputs FILE.pt`: the float model the bench saved, and the very calibration
batches pypto-gym's calibration ran (a torch.save'd list of the processor's tensors, images included),
so the two SmoothQuant rows of the bench's table are calibrated on the same inputs.
"""
import argparse
from pathlib import Path

import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from llmcompressor.modifiers.smoothquant import SmoothQuantModifier
from transformers import AutoModelForImageTextToText, AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "modeling" / "tiny_qwen2_5_vl"
OUT = ROOT / "tests" / "fixtures" / "llmcompressor_w8a8"
PROMPTS = ["Read the text in the image.", "What is written here?", "Transcribe the page.",
           "Describe the layout of this image.", "Write a sentence about tensors.", "Count from one to ten.",
           "What is an RMS norm?", "Describe the weather in one line."]


def _text_dataset(tokenizer):
    """The family's calibration prompts, text only, tokenized as the chat template has them (the fixture)."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": p}]}],
                                           tokenize=False, add_generation_prompt=True) for p in PROMPTS]
    enc = [tokenizer(t) for t in texts]
    return Dataset.from_list([{"input_ids": e["input_ids"], "attention_mask": e["attention_mask"]} for e in enc]), None


def _saved_dataset(path):
    """Calibration batches pypto-gym's processor made (input_ids, attention_mask, pixel_values, image_grid_thw),
    one per sample, with a collator that gives them back as the model's tensors."""
    batches = torch.load(path)
    dtypes = {k: v.dtype for k, v in batches[0].items()}
    data = Dataset.from_list([{k: v.tolist() for k, v in b.items()} for b in batches])

    def collate(rows):
        assert len(rows) == 1
        return {k: torch.tensor(v, dtype=dtypes[k]) for k, v in rows[0].items()}

    return data, collate


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, default=SOURCE, help="a float Qwen2.5-VL checkpoint directory")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--inputs", type=Path, default=None,
                    help="calibration batches (torch.save'd list of dicts of tensors); default: the text prompts")
    ap.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant's smoothing strength")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.source)
    model = AutoModelForImageTextToText.from_pretrained(args.source, dtype=torch.float32)
    data, collate = _text_dataset(tokenizer) if args.inputs is None else _saved_dataset(args.inputs)
    # the decoder's mappings (llm-compressor's defaults also match the vision tower's gate/up, which has no
    # post_attention_layernorm, and refuse): q/k/v after input_layernorm, gate/up after post_attention_layernorm
    text = "re:.*language_model.*"
    mappings = [[[f"{text}q_proj", f"{text}k_proj", f"{text}v_proj"], "re:.*input_layernorm"],
                [[f"{text}gate_proj", f"{text}up_proj"], "re:.*post_attention_layernorm"]]
    recipe = [SmoothQuantModifier(smoothing_strength=args.alpha, mappings=mappings),
              QuantizationModifier(targets="Linear", scheme="W8A8", ignore=["lm_head", "re:.*visual.*"])]
    if collate is None:
        oneshot(model=model, processor=tokenizer, dataset=data, recipe=recipe, max_seq_length=64,
                num_calibration_samples=len(data))
    else:  # whole multimodal batches, one sample each; the basic pipeline runs the model as it is (no tracing)
        oneshot(model=model, processor=tokenizer, dataset=data, recipe=recipe, data_collator=collate,
                num_calibration_samples=len(data), pipeline="basic")
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)
    for name in ("preprocessor_config.json",):  # the image processor's file, as the source checkpoint has it
        if (args.source / name).is_file():
            (args.out / name).write_bytes((args.source / name).read_bytes())
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
