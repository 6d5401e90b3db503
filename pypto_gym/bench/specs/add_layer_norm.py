"""`bench ops` for add_layer_norm: Qwen3-VL-2B's vision block residual add + norm2 (hidden 1024; a document page of
~4k patches), against HF's add then nn.LayerNorm and the copy floor (two inputs read, two outputs written)."""
import torch

from ...ops.defs.add_layer_norm import ADD_LAYER_NORM
from . import BenchSpec, register


def _bench_shapes(quick, dtype):
    gen = torch.Generator().manual_seed(0)
    out = []
    for rows in ([512, 4096] if quick else [512, 1024, 4096]):
        x1, x2 = (torch.randn(rows, 1024, generator=gen).to(dtype) for _ in range(2))
        g, b = (1 + 0.1 * torch.randn(1024, generator=gen)).to(dtype), (0.1 * torch.randn(1024, generator=gen)).to(dtype)
        out.append(("vision", rows, (x1, x2, g, b, 1e-6)))
    return out


def _hf(args):
    x1, x2, g, b, eps = args
    module = torch.nn.LayerNorm(x1.shape[-1], eps=eps).to(x1.dtype)
    module.weight.data, module.bias.data = g, b

    def block():
        h = x1 + x2
        return module(h), h
    return block


def _floor(args):
    x1, x2 = args[0], args[1]
    return lambda: (x1.clone(), x2.clone())


register(ADD_LAYER_NORM, BenchSpec(_bench_shapes, _hf, _floor, "clone() of both inputs",
                                   {"vs_hf": 1.0, "vs_compile": 1.0, "floor": 1.5, "min_tokens": 512}))
