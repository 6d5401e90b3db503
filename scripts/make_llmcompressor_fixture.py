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
paths are below.
"""
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


def main() -> None:
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(SOURCE)
    model = AutoModelForImageTextToText.from_pretrained(SOURCE, dtype=torch.float32)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": p}]}],
                                           tokenize=False, add_generation_prompt=True) for p in PROMPTS]
    enc = [tokenizer(t) for t in texts]
    data = Dataset.from_list([{"input_ids": e["input_ids"], "attention_mask": e["attention_mask"]} for e in enc])
    # the decoder's mappings (llm-compressor's defaults also match the vision tower's gate/up, which has no
    # post_attention_layernorm, and refuse): q/k/v after input_layernorm, gate/up after post_attention_layernorm
    text = "re:.*language_model.*"
    mappings = [[[f"{text}q_proj", f"{text}k_proj", f"{text}v_proj"], "re:.*input_layernorm"],
                [[f"{text}gate_proj", f"{text}up_proj"], "re:.*post_attention_layernorm"]]
    recipe = [SmoothQuantModifier(smoothing_strength=0.5, mappings=mappings),
              QuantizationModifier(targets="Linear", scheme="W8A8", ignore=["lm_head", "re:.*visual.*"])]
    oneshot(model=model, processor=tokenizer, dataset=data, recipe=recipe, max_seq_length=64,
            num_calibration_samples=len(PROMPTS))
    OUT.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(OUT, save_compressed=True)
    tokenizer.save_pretrained(OUT)
    for name in ("preprocessor_config.json",):  # the image processor's file, as the source checkpoint has it
        (OUT / name).write_bytes((SOURCE / name).read_bytes())
    print(f"written to {OUT}")


if __name__ == "__main__":
    main()
