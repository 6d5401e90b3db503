"""swiglu and silu_and_mul on the cpu backend: swiglu.cpp, one pass over both inputs (silu_and_mul makes its two
halves in C++)."""
from ...ops.defs.swiglu import MODES, SILU_AND_MUL, SWIGLU


@SWIGLU.impl("cpu")
def _(backend, gate, up, cast_mode):
    return backend.ext.swiglu(gate, up, MODES[cast_mode])


@SILU_AND_MUL.impl("cpu")
def _(backend, x, cast_mode):
    return backend.ext.silu_and_mul(x, MODES[cast_mode])

