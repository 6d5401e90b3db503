"""varlen_attention on the cpu backend: varlen_attention.cpp, every window and head in one call."""
from ...ops.defs.varlen_attention import MODES, VARLEN_ATTENTION


@VARLEN_ATTENTION.impl("cpu")
def _(backend, q, k, v, cu_seqlens, scale, cast_mode):
    return backend.ext.varlen_attention(q, k, v, list(cu_seqlens), float(scale), MODES[cast_mode])

