"""swiglu_dynamic_quant (SPEC 10): the W8A8 MLP's middle, silu(gate) * up quantised per row for down_proj.

a = swiglu(gate, up, cast_mode) as defs/swiglu.py computes it (`hf`: rounded to the input dtype twice,
exactly the tensor HF's down_proj would read; `fp32`: left in fp32, npu_swiglu_quant's arithmetic);
n = f32(a) * smooth_scales (SmoothQuant's 1/s for down_proj's input channels, fp32, optional);
(y, scale) = per-row symmetric int8/int4 of n, the rule every quantised op shares (ops/quantize.py):
scale = row_max|n| / qmax (fp32, shape gate.shape[:-1]), y = clamp(round(n / scale)), half to even.
So the int8 rows equal `quantize_rows(f32(act_fn(gate) * up) * smooth)`, which a W8A8 down_proj would
otherwise compute from a [tokens, I] tensor written out and read back. No gradient.
"""
import torch

from ..args import FLOAT_DTYPES, Choice, Output, Tensor, dtype_name
from ..quantize import DST_TYPES, QUANT_RANGES, quantize_rows
from ..op import Op
from .swiglu import CAST_MODES, MODES, merged_halves


def swiglu_dynamic_quant(gate, up, smooth_scales=None, cast_mode="hf", dst_type="int8"):
    """silu(gate) * up (rounded as `cast_mode` says), times the smooth scale, per-row int8/int4 -> (y, scale)."""
    if cast_mode == "hf":
        n = (torch.nn.functional.silu(gate) * up).to(torch.float32)
    else:
        g = gate.to(torch.float32)
        n = torch.nn.functional.silu(g) * up.to(torch.float32)
    if smooth_scales is not None:
        n = n * smooth_scales.reshape(gate.shape[-1]).to(torch.float32)
    return quantize_rows(n, dst_type)


SWIGLU_DYNAMIC_QUANT = Op(swiglu_dynamic_quant, [
    Tensor("gate", "*R I", FLOAT_DTYPES),
    Tensor("up", "*R I", None, like="gate"),
    Tensor("smooth_scales", "I", (torch.float32,), optional=True, flat=True, gen="smooth"),
    Choice("cast_mode", CAST_MODES, default="hf", kw_only=True),
    Choice("dst_type", DST_TYPES, default="int8", kw_only=True),
], [Output("y", "codes"), Output("scale", "scale")], min_dims={"I": 1},
    examples=({"R": (2, 5), "I": 64}, {"R": (3,), "I": 3420, "cast_mode": "fp32"},
              {"R": (1, 1), "I": 11008, "smooth_scales": None}, {"R": (7,), "I": 33, "dtype": torch.float16},
              {"R": (4,), "I": 40, "dtype": torch.float32, "dst_type": "int4"}))


@SWIGLU_DYNAMIC_QUANT.impl("cpu")
def _(backend, gate, up, smooth_scales, cast_mode, dst_type):
    return tuple(backend.ext.swiglu_quant(gate, up, smooth_scales, MODES[cast_mode], *QUANT_RANGES[dst_type]))


# npu_swiglu_quant(x, *, smooth_scales, offsets, group_index, activate_left, quant_mode, group_list_type,
# dst_type) -> (y, scale): x [..., 2N] (gate first with activate_left=True: its default False activates the
# right half), fp16/bf16/fp32, more than one dim, last dim even and <= 8192 (so GutenOCR-3B's 11008-wide
# text MLP does not fit; its 3420-wide vision MLP does); smooth_scales fp32 [N]; quant_mode=1 is dynamic.
# It computes in fp32: our fp32 mode (hf mode's two roundings to bf16 move ~3% of the codes by one, measured
# on the first example, so hf mode on a half dtype is not taken). Its scale is
# the multiplier 127 / row_max (CANN 8.3 and later documents Y = Cast(Y_tmp * scale)): ours is its
# reciprocal, the row_max / 127 quant_matmul's pertoken_scale takes. int4 packs two codes per int8 in an
# order the documentation does not give: not mapped.
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


@SWIGLU_DYNAMIC_QUANT.impl("npu", supports=_npu_supports)
def _(backend, gate, up, smooth_scales, cast_mode, dst_type):
    merged = merged_halves(gate, up)
    if merged is None:
        merged = torch.cat([gate, up], dim=-1)
    smooth = None if smooth_scales is None else smooth_scales.reshape(gate.shape[-1])
    y, multiplier = backend.torch_npu().npu_swiglu_quant(merged, smooth_scales=smooth, activate_left=True,
                                                         quant_mode=1, dst_type=torch.int8)
    return y, (1.0 / multiplier).reshape(gate.shape[:-1])


SWIGLU_DYNAMIC_QUANT.not_on("pypto", "no PyPTO kernel yet: swiglu's whole-row tiles at 11008 wide already take "
                                     "172 KB of the 192 KB unified buffer, and the quantised row needs more live "
                                     "buffers")
