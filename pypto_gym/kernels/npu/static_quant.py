"""static_quant on the npu backend: torch_npu.npu_quantize.

npu_quantize(x, scales, zero_points, dtype, axis, div_mode): torch.qint8 codes, axis -1, div_mode=True divides by
the scale (our rule, bit for bit: vllm-ascend's div_mode=False multiplies by a reciprocal, which rounds differently);
with div_mode=True the page documents float32 (bfloat16 on A2/A3) scales and int8/uint8/int32 zero points, so the
scale goes in as float32 and the offset as int32, repeated to D (norm_quant.py's npu_static_params).
"""
import torch

from ...ops.args import dtype_name
from ...ops.defs.static_quant import STATIC_QUANT
from .norm_quant import npu_static_params, npu_static_supports

NAME = "npu_quantize"


def npu_quantize_supports(backend, x, scale, offset, smooth_scales):
    if smooth_scales is not None:
        return (f"{NAME} has no smooth scale (a checkpoint folds it into the source's weights); smooth_scales "
                f"{dtype_name(smooth_scales.dtype)} given")
    return npu_static_supports(NAME, backend, x, scale, offset)


@STATIC_QUANT.impl("npu", supports=npu_quantize_supports)
def npu_quantize(backend, x, scale, offset, smooth_scales):
    scales, zeros = npu_static_params(NAME, x, scale, offset)
    return backend.torch_npu().npu_quantize(x, scales, zeros, torch.qint8, -1, True)
