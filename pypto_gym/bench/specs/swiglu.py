"""`bench ops` for swiglu: GutenOCR-3B's MLP middles against HF's act_fn(gate) * up."""
import torch
import torch.nn.functional as F

from ...ops.defs.swiglu import SWIGLU
from . import BenchSpec, register


def _bench_shapes(quick, dtype):
    """GutenOCR-3B's intermediates: text 11008 wide (decode, prefill), vision 3420 wide."""
    shapes = [("decode", (1, 1, 11008)), ("prefill", (1, 512, 11008))]
    shapes += [] if quick else [("prefill", (1, 4096, 11008))]
    shapes += [("vision", (3744, 3420))]
    gen = torch.Generator().manual_seed(0)
    return [(phase, shape[-2], ((torch.randn(shape, generator=gen) * 2).to(dtype),
                                torch.randn(shape, generator=gen).to(dtype), "hf")) for phase, shape in shapes]


def _hf_kernels(args):
    """HF's MLP middle: act_fn(gate), then * up, each over the whole intermediate."""
    gate, up = (a.reshape(-1, a.shape[-1]) for a in args[:2])
    return [("act_fn(gate)", "silu", [gate], gate.shape, gate.dtype, ()), ("* up", "mul", [gate, up], gate.shape,
                                                                           gate.dtype, ())]


register(SWIGLU, BenchSpec(_bench_shapes, lambda a: (lambda: F.silu(a[0]) * a[1]), lambda a: (lambda: torch.add(a[0], a[1])),
                           "torch.add(gate, up)", {"vs_hf": 2.0, "vs_compile": 1.2, "floor": 1.3, "min_tokens": 512},
                           hf_kernels=_hf_kernels))
