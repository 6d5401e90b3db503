"""`bench ops` for linear: the document page's vision-block linears (3744 patches, GutenOCR-3B's 1280-wide tower),
against HF's nn.Linear (F.linear, which copies the bias into the output before the GEMM) and the bare GEMM."""
import torch
import torch.nn.functional as F

from ...ops.defs.linear import LINEAR
from . import BenchSpec, register

PAGE_PATCHES, VISION_HIDDEN, VISION_INTERMEDIATE = 3744, 1280, 3420
LINEARS = {"qkv": (VISION_HIDDEN, 3 * VISION_HIDDEN), "proj": (VISION_HIDDEN, VISION_HIDDEN),
           "gate_proj": (VISION_HIDDEN, VISION_INTERMEDIATE), "down_proj": (VISION_INTERMEDIATE, VISION_HIDDEN)}


def _bench_shapes(quick, dtype):
    gen = torch.Generator().manual_seed(0)
    out = []
    for name in (["proj", "down_proj"] if quick else list(LINEARS)):
        K, N = LINEARS[name]
        x = torch.randn(PAGE_PATCHES, K, generator=gen).to(dtype)
        w = (torch.randn(N, K, generator=gen) * K ** -0.5).to(dtype)
        b = (torch.randn(N, generator=gen) * 0.1).to(dtype)
        out.append(("vision", PAGE_PATCHES, (x, w, b)))
    return out


# the bias in the epilogue: ~15 % off the page's bf16 GEMMs where oneDNN runs bf16 matmuls (kernels/cpu/linear.py);
# elsewhere the kernel is F.linear itself, and the goal line says FAIL there, as it should
register(LINEAR, BenchSpec(_bench_shapes, lambda a: (lambda: F.linear(*a)), lambda a: (lambda: torch.mm(a[0], a[1].t())),
                           "the GEMM alone (torch.mm, no bias)", {"vs_hf": 1.05, "floor": 1.1, "min_tokens": 512}))
