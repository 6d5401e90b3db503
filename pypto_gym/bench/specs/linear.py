"""`bench ops` for linear: the document page's vision-block linears (3744 patches, GutenOCR-3B's 1280-wide tower)
and Qwen3-VL-2B's vision MLP fc1 with its tanh GELU (2944 patches, 1024 -> 4096), against what HF runs (nn.Linear's
F.linear, which copies the bias into the output before the GEMM; then the GELU's own pass) and the bare GEMM."""
import torch

from ...ops.defs.linear import LINEAR, linear
from . import BenchSpec, register

PAGE_PATCHES, VISION_HIDDEN, VISION_INTERMEDIATE = 3744, 1280, 3420
LINEARS = {"qkv": (VISION_HIDDEN, 3 * VISION_HIDDEN, 0), "proj": (VISION_HIDDEN, VISION_HIDDEN, 0),
           "gate_proj": (VISION_HIDDEN, VISION_INTERMEDIATE, 0), "down_proj": (VISION_INTERMEDIATE, VISION_HIDDEN, 0),
           "qwen3_vl fc1 + gelu_tanh": (1024, 4096, 2944)}  # (K, N, rows: 0 for the GutenOCR-3B page's)


def _bench_shapes(quick, dtype):
    gen = torch.Generator().manual_seed(0)
    out = []
    for name in (["proj", "down_proj", "qwen3_vl fc1 + gelu_tanh"] if quick else list(LINEARS)):
        K, N, rows = LINEARS[name]
        rows = rows or PAGE_PATCHES
        x = torch.randn(rows, K, generator=gen).to(dtype)
        w = (torch.randn(N, K, generator=gen) * K ** -0.5).to(dtype)
        b = (torch.randn(N, generator=gen) * 0.1).to(dtype)
        out.append(("vision", rows, (x, w, b, "gelu_tanh" if "gelu" in name else "none")))
    return out


# the bias (and the GELU) in the epilogue: ~15 % off the page's bf16 GEMMs, ~2x on the GELU MLP's fc1, where oneDNN
# runs bf16 matmuls (kernels/cpu/linear.py); elsewhere the kernel is the golden, and the goal line says FAIL there
register(LINEAR, BenchSpec(_bench_shapes, lambda a: (lambda: linear(*a)), lambda a: (lambda: torch.mm(a[0], a[1].t())),
                           "the GEMM alone (torch.mm, no bias)", {"vs_hf": 1.05, "floor": 1.1, "min_tokens": 512}))
