"""swiglu_dynamic_quant and dequant_swiglu_quant on the cpu backend: swiglu_quant.cpp, one pass per row."""
from ...ops.defs.swiglu import MODES
from ...ops.defs.swiglu_quant import DEQUANT_SWIGLU_QUANT, SWIGLU_DYNAMIC_QUANT
from ...ops.quantize import QUANT_RANGES


@SWIGLU_DYNAMIC_QUANT.impl("cpu")
def _(backend, gate, up, smooth_scales, cast_mode, dst_type):
    return tuple(backend.ext.swiglu_quant(gate, up, smooth_scales, MODES[cast_mode], *QUANT_RANGES[dst_type]))


@DEQUANT_SWIGLU_QUANT.impl("cpu")
def _(backend, x, weight_scale, activation_scale, bias, quant_scale, activate_left, dst_type):
    return tuple(backend.ext.dequant_swiglu_quant(x, weight_scale, activation_scale, bias, quant_scale, activate_left,
                                                  *QUANT_RANGES[dst_type]))

