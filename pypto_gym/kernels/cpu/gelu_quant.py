"""gelu_dynamic_quant and gelu_quant on the cpu backend: gelu_quant.cpp, one pass per row."""
from ...ops.defs.gelu_quant import GELU_DYNAMIC_QUANT, GELU_QUANT
from ...ops.quantize import QUANT_RANGES
from .norm_quant import static_scalars


@GELU_DYNAMIC_QUANT.impl("cpu")
def _(backend, x, smooth_scales, approximate, dst_type):
    return tuple(backend.ext.gelu_dynamic_quant(x, smooth_scales, approximate == "tanh", *QUANT_RANGES[dst_type]))


@GELU_QUANT.impl("cpu")
def _(backend, x, scale, offset, smooth_scales, approximate):
    return backend.ext.gelu_quant(x, smooth_scales, approximate == "tanh", *static_scalars(scale, offset))
