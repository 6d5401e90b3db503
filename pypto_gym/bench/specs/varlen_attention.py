"""`bench ops` for varlen_attention: GutenOCR-3B's document page's window block against HF's per-window loop and one
padded batched sdpa."""
import torch
import torch.nn.functional as F

from ...ops.defs.varlen_attention import VARLEN_ATTENTION, varlen_attention, windows
from . import BenchSpec, register

# GutenOCR-3B's document page (728x1008 pixels, patch 14: 52 x 72 patches): Qwen2.5-VL's windows are 112 pixels
# (4 x 4 merged tokens of 2 x 2 patches = 64 patches), the page's right column half as wide (32 patches):
# 9 rows of 6 x 64 + 32 = 63 windows, 3744 patches
PAGE_WINDOWS = windows(([64] * 6 + [32]) * 9)
PAGE_T, VISION_HEADS, VISION_D = 3744, 16, 80


def _bench_shapes(quick, dtype):
    """The document page's window block: 63 windows of up to 64 patches."""
    gen = torch.Generator().manual_seed(0)
    qkv = [torch.randn(PAGE_T, VISION_HEADS, VISION_D, generator=gen).to(dtype) for _ in range(3)]
    return [("vision", PAGE_T, (*qkv, PAGE_WINDOWS, VISION_D ** -0.5, "hf"))]


def padded_batch(args):
    """One batched sdpa over the windows padded to the longest (keys past a window's end masked): the loop's
    alternative without a fused kernel. Padding happens here, outside the timed call."""
    q, k, v, cu, scale = args[:5]
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    L = max(lengths)
    batch = [torch.zeros(len(lengths), q.shape[1], L, q.shape[2], dtype=q.dtype) for _ in range(3)]
    mask = torch.zeros(len(lengths), 1, 1, L, dtype=torch.bool)
    for w, (a, n) in enumerate(zip(cu[:-1], lengths)):
        for b, t in zip(batch, (q, k, v)):
            b[w, :, :n] = t[a:a + n].transpose(0, 1)
        mask[w, ..., :n] = True
    return lambda: F.scaled_dot_product_attention(*batch, attn_mask=mask, scale=scale)


register(VARLEN_ATTENTION, BenchSpec(_bench_shapes, lambda a: (lambda: varlen_attention(*a)), lambda a: (lambda: a[0].clone()),
                                     "clone() of q", {"vs_hf": 5.0, "vs_padded_sdpa": 1.5},
                                     alternatives={"padded_sdpa": padded_batch}))
