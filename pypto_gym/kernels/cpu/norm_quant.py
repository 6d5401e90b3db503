"""The norm + quant ops on the cpu backend: norm_quant.cpp, the norm and the quantisation in one pass per row."""
import torch

from ...ops.defs.norm_quant import (
    ADD_RMS_NORM_DYNAMIC_QUANT,
    ADD_RMS_NORM_QUANT,
    RMS_NORM_DYNAMIC_QUANT,
    RMS_NORM_QUANT,
)
from ...ops.quantize import QUANT_RANGES


@RMS_NORM_DYNAMIC_QUANT.impl("cpu")
def _(backend, x, gamma, smooth_scales, beta, eps, dst_type):
    y, _, _, scale, _ = backend.ext.quant(x, None, gamma, smooth_scales, None, beta, eps, *QUANT_RANGES[dst_type])
    return y, scale


@ADD_RMS_NORM_DYNAMIC_QUANT.impl("cpu")
def _(backend, x1, x2, gamma, smooth_scale1, smooth_scale2, beta, eps, dst_type):
    return tuple(backend.ext.quant(x1, x2, gamma, smooth_scale1, smooth_scale2, beta, eps, *QUANT_RANGES[dst_type]))


def static_scalars(scale, offset) -> tuple:
    """The static scale and offset as the fp32 values the golden computes with (one host read each)."""
    return float(scale.reshape(()).to(torch.float32)), 0.0 if offset is None else float(offset.reshape(()).float())


@RMS_NORM_QUANT.impl("cpu")
def _(backend, x, gamma, scale, offset, beta, eps):
    return backend.ext.quant_static(x, None, gamma, beta, eps, *static_scalars(scale, offset))[0]


@ADD_RMS_NORM_QUANT.impl("cpu")
def _(backend, x1, x2, gamma, scale, offset, beta, eps):
    return tuple(backend.ext.quant_static(x1, x2, gamma, beta, eps, *static_scalars(scale, offset)))
