"""dynamic_quant on the cpu backend: dynamic_quant.cpp, one pass per row."""
from ...ops.defs.dynamic_quant import DYNAMIC_QUANT
from ...ops.quantize import QUANT_RANGES


@DYNAMIC_QUANT.impl("cpu")
def _(backend, x, smooth_scales, dst_type):
    return tuple(backend.ext.dynamic_quant(x, smooth_scales, *QUANT_RANGES[dst_type]))
