"""What a PyPTO kernel's tiles may hold on the chip, checked before anything compiles.

PyPTO 0.2.0's SIM proves the tiled graph but never runs the device compiler, so a tile the chip cannot hold passes
every CPU test and fails on the first NPU run. Every launch states its tiles (`Budget`) and `problem` checks them
against PyPTO r0.2.0's documented rules; the attention ops choose their key tile with it and decline a call no tile
fits, naming the rule. The rules, each from its page in hicann/pypto r0.2.0 `docs/`:
- `api/config/pypto-set_cube_tile_shapes.md`: K and N tiles 32-byte aligned (16 elements for fp32 inputs);
  CeilAlign(m,16) * CeilAlign(k,16) * sizeof(a) <= L0A, CeilAlign(n,16) * CeilAlign(k,16) * sizeof(b) <= L0B,
  CeilAlign(m,16) * CeilAlign(n,16) * 4 <= L0C, (A's + B's L1 tiles) <= L1. The kernels here hold the whole K and N of
  a matmul in one L0 tile (PyPTO 0.2.0's matmul verifies exactly only so), L1 tile = L0 tile.
- `api/operation/pypto-matmul.md`: a `pypto.view` feeds a matmul only in 2-D, its inner axis 32-byte aligned and its
  outer axis 16 elements; an ND inner axis at most 65535. (No 3-D view: the kernels cut batches into 2-D matmuls.)
- `api/operation/pypto-concat.md`: 2 to 128 inputs, and the tile does not split the concatenated axis.
- `tutorials/debug/performance.md` ("Vector 初始 Tiling"): an operation's inputs and output are allocated in UB
  together: here `live` fp32 tiles (two operands and a result, the widest elementwise step of these kernels).
Buffer sizes: `framework/src/platform/parser/simulation_platform/platform_config/A2A3.ini` (Ascend910B; the A3
series has the same AI core). PyPTO r0.2.0 supports the A2/A3 series only (its product tables).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Chip:
    """One AI core's buffers, in bytes."""

    name: str
    l0a: int
    l0b: int
    l0c: int
    l1: int
    ub: int


A2A3 = Chip("Atlas A2/A3", l0a=65536, l0b=65536, l0c=131072, l1=524288, ub=196608)
LIVE_FP32_TILES = 3  # two operands and a result of one elementwise step, all fp32, in UB together
MAX_CONCAT = 128  # pypto.concat's documented input count
MAX_INNER = 65535  # pypto.matmul: an ND operand's inner axis


@dataclass(frozen=True)
class Matmul:
    """One pypto.matmul as a kernel sets it: m rows, the whole K and the whole N each in one L0 tile, operands of
    `in_bytes` (the output accumulates in fp32); `what` names it in a refusal."""

    what: str
    m: int
    k: int
    n: int
    in_bytes: int


@dataclass(frozen=True)
class Budget:
    """A launch's tiles: its matmuls, its vector tile shapes, the inputs of its one concat (0: none)."""

    matmuls: tuple = ()
    vector: tuple = ()
    concat: int = 0
    live: int = LIVE_FP32_TILES


def _up(v: int, a: int) -> int:
    return -(-v // a) * a


def matmul_problem(mm: Matmul, chip: Chip = A2A3) -> str | None:
    """Why the chip cannot run this matmul's tile (set_cube_tile_shapes' and matmul's rules), None if it can."""
    for axis, v in (("K", mm.k), ("N", mm.n)):
        aligned = v % 16 == 0 if mm.in_bytes == 4 else v * mm.in_bytes % 32 == 0
        if not aligned:
            return f"{mm.what}: its {axis} tile {v} is not 32-byte aligned (set_cube_tile_shapes)"
    for axis, v in (("M", mm.m), ("K", mm.k), ("N", mm.n)):
        if v % 16:
            return f"{mm.what}: its {axis} {v} is not a multiple of 16 (a 2-D view into pypto.matmul)"
        if v > MAX_INNER:
            return f"{mm.what}: its {axis} {v} exceeds the {MAX_INNER} of an ND operand's inner axis (pypto.matmul)"
    m, k, n = _up(mm.m, 16), _up(mm.k, 16), _up(mm.n, 16)
    needs = (("L0A", m * k * mm.in_bytes, chip.l0a), ("L0B", n * k * mm.in_bytes, chip.l0b),
             ("L0C", m * n * 4, chip.l0c), ("L1", (m + n) * k * mm.in_bytes, chip.l1))
    for buffer, need, size in needs:
        if need > size:
            return (f"{mm.what}: {buffer} needs {need} bytes (M {mm.m}, K {mm.k}, N {mm.n}, {mm.in_bytes}-byte "
                    f"operands), {chip.name} has {size} (set_cube_tile_shapes)")
    return None


def vector_problem(shape: tuple, live: int = LIVE_FP32_TILES, chip: Chip = A2A3) -> str | None:
    """Why a vector tile of this shape does not fit UB with `live` fp32 tiles of it, None if it does (the last axis
    padded to 32 bytes, as PyPTO lays it out)."""
    elems = math.prod(shape[:-1]) * _up(shape[-1], 8)
    if elems * 4 * live > chip.ub:
        return (f"a vector tile {'x'.join(map(str, shape))} needs {elems * 4 * live} bytes of UB ({live} fp32 tiles "
                f"live), {chip.name} has {chip.ub}")
    return None


def problem(budget: Budget, chip: Chip = A2A3) -> str | None:
    """The first documented rule this launch's tiles break on `chip`, None if none."""
    for mm in budget.matmuls:
        why = matmul_problem(mm, chip)
        if why:
            return why
    if budget.vector:
        why = vector_problem(tuple(budget.vector), budget.live, chip)
        if why:
            return why
    if budget.concat > MAX_CONCAT:
        return f"{budget.concat} tensors into one pypto.concat (at most {MAX_CONCAT})"
    return None


class BudgetError(ValueError):
    """A launch whose tiles the chip cannot hold: refused before compiling (the op's `supports` declines first)."""
