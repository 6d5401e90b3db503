"""swiglu and silu_and_mul on the pypto backend: gate * sigmoid(gate) * up (PyPTO 0.2.0 has sigmoid, not silu).

Tiles hold whole rows: a tile that cuts a row gives results PyPTO's own compiled-level check rejects (every split of
[64, 11008] and of [256, 3420] tried), so rows wider than the unified buffer holds are not taken.
"""
from ...ops.defs.swiglu import SILU_AND_MUL, SWIGLU
from .backend import UB_BYTES, Tiles, rows
from .budget import Budget, vector_problem

LIVE_FP32 = 4  # gate, its sigmoid, their product, up


def swiglu_tiles(R: int, I: int) -> Tiles | None:
    """Whole rows, as many as fit the unified buffer (up to 4); None when one row does not fit."""
    cols = -(-I // 16) * 16
    if vector_problem((1, cols), LIVE_FP32):
        return None
    per_row = 4 * LIVE_FP32 * cols
    rows_ = 1
    while rows_ < 4 and rows_ < R and 2 * rows_ * per_row <= UB_BYTES:
        rows_ *= 2
    return Tiles(rows_, cols)


def _pypto_supports(backend, gate, *rest):
    if swiglu_tiles(1, gate.shape[-1]) is None:
        return f"a row of {gate.shape[-1]} does not fit PyPTO's unified buffer (whole-row tiles only)"
    return backend.runs_on(gate)


def swiglu_kernel(pypto):
    from . import lib as pl

    def swiglu(gate: pypto.Tensor(), up: pypto.Tensor(), out: pypto.Tensor(), hf, rows, cols):
        pypto.set_vec_tile_shapes(rows, cols)
        g = pl.f32(gate)
        s = g * pypto.sigmoid(g)
        if hf == 1 and gate.dtype != pl.FP32:  # HF rounds silu's result to the input dtype before the multiply
            s = pl.f32(pypto.cast(s, gate.dtype))
        out[:] = pl.to(s * pl.f32(up), out.dtype)
    return swiglu


@SWIGLU.impl("pypto", supports=_pypto_supports)
def _swiglu(backend, gate, up, cast_mode):
    y = SWIGLU.empty_outputs(gate, up, cast_mode)
    if gate.numel():
        I = gate.shape[-1]
        tiles = swiglu_tiles(gate.numel() // I, I)
        backend.launch("swiglu", swiglu_kernel, gate, [rows(gate), rows(up)], [y.view(-1, I)],
                       [int(cast_mode == "hf")], tiles=tiles, budget=Budget(vector=tiles.shape, live=LIVE_FP32))
    return y


@SILU_AND_MUL.impl("pypto", supports=lambda backend, x, cast_mode: _pypto_supports(backend, x.chunk(2, dim=-1)[0]))
def _(backend, x, cast_mode):
    return _swiglu(backend, *x.chunk(2, dim=-1), cast_mode)
