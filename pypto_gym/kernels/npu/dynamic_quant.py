"""dynamic_quant on the npu backend: torch_npu.npu_dynamic_quant.

npu_dynamic_quant(x, *, smooth_scales, group_index, dst_type) -> (y, scale), Atlas A2/A3: x fp16/bf16, more than one
dim, smooth_scales of x's dtype [D]; int4 (dst_type=torch.quint4x2) packs eight codes per int32 and needs
D % 8 == 0; scale = row_max / 127 (or / 7), fp32, x's shape without the last dim: ours.
"""
import torch

from ...ops.args import dtype_name
from ...ops.defs.dynamic_quant import DYNAMIC_QUANT
from ...ops.quantize import unpack_int4_from_int32
from .backend import as_rows, quant_limits


def npu_dynamic_quant_supports(backend, x, smooth_scales, dst_type):
    name = "npu_dynamic_quant"
    if x.dim() < 2:
        return f"{name}: x must have more than one dim, got {x.dim()}"
    reason = quant_limits(name, x, dst_type, backend)
    if reason:
        return reason
    if smooth_scales is not None and smooth_scales.dtype != x.dtype:
        return f"{name}: smooth_scales {dtype_name(smooth_scales.dtype)} with x {dtype_name(x.dtype)} (one dtype)"
    return None


@DYNAMIC_QUANT.impl("npu", supports=npu_dynamic_quant_supports)
def npu_dynamic_quant(backend, x, smooth_scales, dst_type):
    smooth = None if smooth_scales is None else smooth_scales.reshape(x.shape[-1])
    y, scale = backend.torch_npu().npu_dynamic_quant(as_rows(x), smooth_scales=smooth,
                                                     dst_type=torch.quint4x2 if dst_type == "int4" else torch.int8)
    if dst_type == "int4":
        y = unpack_int4_from_int32(y)
    return y.reshape(x.shape), scale.reshape(x.shape[:-1])
