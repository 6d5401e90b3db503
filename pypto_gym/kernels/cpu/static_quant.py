"""static_quant on the cpu backend: static_quant.cpp, one pass per row."""
from ...ops.defs.static_quant import STATIC_QUANT
from .norm_quant import static_scalars


@STATIC_QUANT.impl("cpu")
def _(backend, x, scale, offset, smooth_scales):
    return backend.ext.static_quant(x, smooth_scales, *static_scalars(scale, offset))
