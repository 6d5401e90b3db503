"""What `bench ops` times per op: one module per op definition, found by import like ops/defs.

Each module registers a BenchSpec per op (`register(OP, BenchSpec(...))`); `SPECS[op name]` is read by
bench/ops_bench.py (the rows and goals) and bench/pypto_layer.py (HF's kernels, costed on PyPTO's NPU model).
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class BenchSpec:
    """How `bench ops` times an op against what a CPU user runs instead.

    shapes(quick, dtype) -> [(phase, tokens, args)]: the model's real shapes and layouts. hf(args) -> a callable
    running what HF eager runs (also compiled, as the torch.compile row). floor(args) -> a callable moving
    the same bytes with trivial math (`floor_name` says which). unfused(args, backend): the op's parts on
    that backend's kernels, where fusing is the claim. goals: "vs_hf" (every row), "decode_vs_hf", and
    "vs_compile" and "floor" (rows of at least "min_tokens" tokens). hf_kernels(args) -> [(label, kind,
    inputs, output shape, output dtype, scalars)]: each kernel HF eager launches for one call, as a kind of
    baseline kernel (bench/pypto_kernels.py: cast, mul, add, mean, add_scalar, rsqrt, neg, cat, silu) that
    `bench pypto` and `bench layer` cost on PyPTO's NPU model next to the fused op. alternatives: {name:
    fn(args) -> callable}, other ways a CPU user could compute the op (varlen attention: one padded batched sdpa),
    each timed beside it, with goal "vs_<name>"."""

    shapes: Callable
    hf: Callable
    floor: Callable
    floor_name: str
    goals: dict
    unfused: Callable | None = None
    hf_kernels: Callable | None = None
    alternatives: dict | None = None


SPECS: dict[str, BenchSpec] = {}  # op name -> its spec, in op definition order once all are loaded


def register(op, spec: BenchSpec) -> None:
    if op.name in SPECS:
        raise ValueError(f"bench spec for {op.name!r} registered twice")
    SPECS[op.name] = spec


for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    importlib.import_module(f"{__name__}.{_info.name}")
