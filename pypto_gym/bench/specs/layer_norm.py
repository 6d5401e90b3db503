"""`bench ops` for layer_norm: Qwen3-VL-2B's vision LayerNorms (hidden 1024; a document page of ~4k patches, and a
merger's post-shuffle norm at 4096 wide) against HF's nn.LayerNorm and the copy floor."""
import torch

from ...ops.defs.layer_norm import LAYER_NORM
from . import BenchSpec, register


def _bench_shapes(quick, dtype):
    gen = torch.Generator().manual_seed(0)
    shapes = [(512, 1024), (4096, 1024)] if quick else [(512, 1024), (1024, 1024), (4096, 1024), (1024, 4096)]
    out = []
    for rows, D in shapes:
        x = torch.randn(rows, D, generator=gen).to(dtype)
        g, b = (1 + 0.1 * torch.randn(D, generator=gen)).to(dtype), (0.1 * torch.randn(D, generator=gen)).to(dtype)
        out.append(("vision", rows, (x, g, b, 1e-6)))
    return out


def _hf(args):
    x, g, b, eps = args
    module = torch.nn.LayerNorm(x.shape[-1], eps=eps).to(x.dtype)
    module.weight.data, module.bias.data = g, b
    return lambda: module(x)


register(LAYER_NORM, BenchSpec(_bench_shapes, _hf, lambda a: a[0].clone, "clone()",
                               {"vs_compile": 1.0, "floor": 1.5, "min_tokens": 512}))
