"""swiglu_dynamic_quant and dequant_swiglu_quant on the npu backend: torch_npu.npu_swiglu_quant and
npu_dequant_swiglu_quant.

npu_swiglu_quant(x, *, smooth_scales, offsets, group_index, activate_left, quant_mode, group_list_type,
dst_type) -> (y, scale): x [..., 2N] (gate first with activate_left=True: its default False activates the
right half), fp16/bf16/fp32, more than one dim, last dim even and <= 8192 (so GutenOCR-3B's 11008-wide
text MLP does not fit; its 3420-wide vision MLP does); smooth_scales fp32 [G, N] (one group here: [1, N]);
quant_mode=1 is dynamic.
It computes in fp32: our fp32 mode (hf mode's two roundings to bf16 move ~3% of the codes by one, measured
on the first example, so hf mode on a half dtype is not taken). Its scale is
the multiplier 127 / row_max (CANN 8.3 and later documents Y = Cast(Y_tmp * scale)): ours is its
reciprocal, the row_max / 127 quant_matmul's pertoken_scale takes. int4 packs two codes per int8 in an
order the documentation does not give: not mapped.

npu_dequant_swiglu_quant(x, *, weight_scale, activation_scale, bias, quant_scale, quant_offset, group_index,
activate_left, quant_mode, ...) -> (y, scale), Atlas A2/A3: x int32 [T, 2H] (2-D), weight_scale fp32 [1, 2H],
activation_scale fp32 [T, 1], bias int32 only (added before the dequantisation: a float bias is not
mapped), quant_scale [1, H], quant_mode=1 dynamic, int8 out; scale = row_max / 127 (ours). It writes
y = round(n * (127 / row_max)) where we divide by the scale: a code apart at rare ties.
"""
import torch

from ...ops.args import dtype_name
from ...ops.defs.swiglu_quant import DEQUANT_SWIGLU_QUANT, SWIGLU_DYNAMIC_QUANT
from .backend import needs
from .swiglu import merged_halves

NPU_MAX_LAST_DIM = 8192


def _npu_supports(backend, gate, up, smooth_scales, cast_mode, dst_type):
    name = "npu_swiglu_quant"
    if gate.dim() < 2:
        return f"{name}: x must have more than one dim, got {gate.dim()}"
    if not gate.numel():
        return f"{name}: empty tensors are not supported"
    if 2 * gate.shape[-1] > NPU_MAX_LAST_DIM:
        return f"{name}: last dim 2 x {gate.shape[-1]} > {NPU_MAX_LAST_DIM}"
    if dst_type != "int8":
        return f"{name}: dst_type {dst_type} is not mapped (only int8)"
    if cast_mode == "hf" and gate.dtype != torch.float32:
        return (f"{name} computes in fp32: cast_mode 'hf' (rounded to {dtype_name(gate.dtype)} twice) is not its "
                f"arithmetic")
    if backend.series_of(gate) != "a2_a3":
        return f"{name}: supported on Atlas A2/A3 chips only"
    if gate.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"{name}: dtype {dtype_name(gate.dtype)} not supported"
    return None


@SWIGLU_DYNAMIC_QUANT.impl("npu", supports=needs("npu_swiglu_quant")(_npu_supports))
def _(backend, gate, up, smooth_scales, cast_mode, dst_type):
    merged = merged_halves(gate, up)
    if merged is None:
        merged = torch.cat([gate, up], dim=-1)
    # smooth_scales' documented shapes are [G, N] and [G] (G groups): without group_index one group, [1, N]
    smooth = None if smooth_scales is None else smooth_scales.reshape(1, gate.shape[-1])
    y, multiplier = backend.torch_npu().npu_swiglu_quant(merged, smooth_scales=smooth, activate_left=True,
                                                         quant_mode=1, dst_type=torch.int8)
    return y, (1.0 / multiplier).reshape(gate.shape[:-1])


def _npu_dequant_supports(backend, x, weight_scale, activation_scale, bias, quant_scale, activate_left, dst_type):
    name = "npu_dequant_swiglu_quant"
    if not x.numel():
        return f"{name}: empty tensors are not supported"
    if bias is not None:
        return f"{name}: bias {dtype_name(bias.dtype)}: only an int32 bias (added before dequantisation) is documented"
    if dst_type != "int8":
        return f"{name}: dst_type {dst_type} is not mapped (only int8)"
    if backend.series_of(x) != "a2_a3":
        return f"{name}: supported on Atlas A2/A3 chips only"
    return None


@DEQUANT_SWIGLU_QUANT.impl("npu", supports=needs("npu_dequant_swiglu_quant")(_npu_dequant_supports))
def _(backend, x, weight_scale, activation_scale, bias, quant_scale, activate_left, dst_type):
    N = x.shape[-1]
    y, scale = backend.torch_npu().npu_dequant_swiglu_quant(
        x.reshape(-1, N), weight_scale=weight_scale.reshape(1, N), activation_scale=activation_scale.reshape(-1, 1),
        quant_scale=None if quant_scale is None else quant_scale.reshape(1, N // 2), activate_left=activate_left,
        quant_mode=1)
    return y.reshape(*x.shape[:-1], N // 2), scale.reshape(x.shape[:-1])

