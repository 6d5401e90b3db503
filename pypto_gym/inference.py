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


def _npu_available() -> bool:
    import torch

    return getattr(torch, "npu", None) is not None and torch.npu.is_available()


def resolve_device(device: str) -> str:
    """`--device`: auto picks npu, then cuda, then cpu; a device that is not there is one clear error."""
    import importlib.util

    import torch

    if device == "auto":
        return "npu" if _npu_available() else "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        build = "without CUDA" if torch.version.cuda is None else f"with CUDA {torch.version.cuda}"
        raise ValueError(f"--device cuda: no CUDA device (torch {torch.__version__} was built {build})")
    if device == "npu" and not _npu_available():
        if importlib.util.find_spec("torch_npu") is None:
            raise ValueError("--device npu: torch_npu is not installed (it needs CANN: pip install "
                             "'pypto-gym[npu]' on an Ascend machine)")
        try:
            import torch_npu  # noqa: F401  (registers the npu device with torch)
        except Exception as e:  # noqa: BLE001 - without CANN the import itself fails
            raise ValueError(f"--device npu: torch_npu cannot be imported ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:120] if str(e) else ''})") from None
        if not _npu_available():
            raise ValueError("--device npu: torch_npu is imported but reports no NPU (torch.npu.is_available())")
    return device


def default_dtype(device: str) -> str:
    """bfloat16 where the hardware computes it natively (NPU, CUDA, a CPU with AVX512-BF16 or AMX), else
    float32: on a CPU without native bf16, torch's bf16 matmul is two orders of magnitude slower."""
    from .hardware import native_bf16

    return "bfloat16" if device != "cpu" or native_bf16() else "float32"


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


def check_new_tokens(model, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse a generation longer than the model's context (max_position_embeddings) before it starts: a huge
    max_new_tokens otherwise ran silently for minutes, then failed or wrapped its positions."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    context = getattr(config, "max_position_embeddings", None)
    if isinstance(context, int) and prompt_tokens + max_new_tokens > context:
        raise ValueError(f"--max-new-tokens: {max_new_tokens:,} new tokens after a prompt of {prompt_tokens:,} exceed "
                         f"the model's context of {context:,} positions (max_position_embeddings); expected at most "
                         f"{max(context - prompt_tokens, 0):,}")


def generate(model, processor, prompts, images, max_new_tokens: int):
    """Greedy generate; returns (decoded texts, new token count, prefill seconds, decode tok/s)."""
    import torch
    from transformers import LogitsProcessorList

    inputs = processor(prompts, images, model=model)
    check_new_tokens(model, inputs["input_ids"].shape[1], max_new_tokens)
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
