"""Run generate on a Qwen2.5-VL-family model and measure what a user feels.

Prefill latency is the time to the first generated token (vision encoder included); decode
tokens/s is measured over the following tokens. Both come from a logits processor that stamps
the clock after every forward pass, so nothing is re-run to measure it.
"""
from __future__ import annotations

import resource
import sys
import time
from dataclasses import asdict, dataclass, field


@dataclass
class InferenceResult:
    text: list
    new_tokens: int
    load_s: float
    prefill_s: float
    decode_tokens_per_s: float
    peak_memory_mb: float
    device: str
    dtype: str
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        d = asdict(self)
        d.update(d.pop("extra"))
        return d


class _StepClock:
    """A LogitsProcessor that records the wall time at the end of every forward."""

    def __init__(self):
        self.stamps = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    if getattr(torch, "npu", None) is not None and torch.npu.is_available():
        return "npu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def peak_memory_mb(device: str) -> float:
    """Peak device memory for accelerators; the process's peak resident set on CPU."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    if device.startswith("npu"):
        return torch.npu.max_memory_allocated() / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024


def open_image(path):
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(path)
        img.load()
    except FileNotFoundError:
        raise FileNotFoundError(f"--image: no file at {path}") from None
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"--image: {path} is not a readable image ({type(e).__name__})") from None
    return img.convert("RGB")


def generate(model, processor, prompts, images, max_new_tokens: int):
    """Greedy generate; returns (decoded texts, new token count, prefill seconds, decode tok/s)."""
    import torch
    from transformers import LogitsProcessorList

    inputs = processor(prompts, images, model=model)
    inputs = {k: v.to(model.device) for k, v in inputs.items()}
    clock = _StepClock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                             logits_processor=LogitsProcessorList([clock]))
    new = out[:, inputs["input_ids"].shape[1]:]
    prefill = clock.stamps[0] - start
    steps = len(clock.stamps) - 1
    decode_tps = steps * new.shape[0] / (clock.stamps[-1] - clock.stamps[0]) if steps > 0 else 0.0
    return processor.decode(new), new.shape[1], prefill, decode_tps
