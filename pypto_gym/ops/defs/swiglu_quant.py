"""swiglu_dynamic_quant and dequant_swiglu_quant (SPEC 10): the W8A8 MLP's middle, quantised per row for down_proj.

a = swiglu(gate, up, cast_mode) as defs/swiglu.py computes it (`hf`: rounded to the input dtype twice,
exactly the tensor HF's down_proj would read; `fp32`: left in fp32, npu_swiglu_quant's arithmetic);
n = f32(a) * smooth_scales (SmoothQuant's 1/s for down_proj's input channels, fp32, optional);
(y, scale) = per-row symmetric int8/int4 of n, the rule every quantised op shares (ops/quantize.py):
scale = row_max|n| / qmax (fp32, shape gate.shape[:-1]), y = clamp(round(n / scale)), half to even.
So the int8 rows equal `quantize_rows(f32(act_fn(gate) * up) * smooth)`, which a W8A8 down_proj would
otherwise compute from a [tokens, I] tensor written out and read back. dequant_swiglu_quant starts a step
earlier, from the int32 output of one GEMM over the merged gate/up int8 weights (no float gate/up at all),
with npu_dequant_swiglu_quant's semantics. No gradient.
"""
import torch

from ..args import FLOAT_DTYPES, ArgValueError, Bool, Choice, Output, Tensor
from ..op import Op
from ..quantize import DST_TYPES, quantize_rows
from .swiglu import CAST_MODES


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


def dequant_swiglu_quant(x, weight_scale, activation_scale, bias=None, quant_scale=None, activate_left=False,
                         dst_type="int8"):
    """npu_dequant_swiglu_quant: x int32 [..., 2H] (x_q @ [w_gate; w_up]^T) -> f = f32(x) * weight_scale *
    activation_scale[..., None] (+ bias, fp32); silu of one half times the other (`activate_left`: the first
    half, gate first as our MLPs and vLLM order it; False, torch_npu's default, activates the second); times
    quant_scale; per-row int8/int4 -> (y [..., H], scale). The dequantisation's order is torch_npu's (weight
    scale first), not quant_matmul's."""
    H = x.shape[-1] // 2
    f = x.to(torch.float32) * weight_scale.to(torch.float32) * activation_scale.to(torch.float32).unsqueeze(-1)
    if bias is not None:
        f = f + bias.to(torch.float32)
    act, lin = (f[..., :H], f[..., H:]) if activate_left else (f[..., H:], f[..., :H])
    n = torch.nn.functional.silu(act) * lin
    if quant_scale is not None:
        n = n * quant_scale.reshape(H).to(torch.float32)
    return quantize_rows(n, dst_type)


def _halves(ctx, *args):
    N = ctx.dims["N"]
    if N % 2:
        raise ArgValueError("x", f"last dim {N} is odd; expected the two halves of a merged gate/up output")
    H = ctx.dims.get("H")
    if H is not None and H != N // 2:
        raise ArgValueError("quant_scale", f"has {H} channels; expected {N // 2} (half of x's last dim)")


def _accumulators(shape, gen):
    """int32 GEMM outputs: sums of products of int8 codes (|x| up to ~2^17 at K=2048), as float32 values."""
    return torch.randint(-2 ** 17, 2 ** 17, shape, generator=gen).to(torch.float32)


DEQUANT_SWIGLU_QUANT = Op(dequant_swiglu_quant, [
    Tensor("x", "*R N", (torch.int32,), gen=_accumulators),
    Tensor("weight_scale", "N", (torch.float32,), gen=lambda shape, gen: torch.rand(shape, generator=gen) * 1e-3),
    Tensor("activation_scale", "*R", (torch.float32,), gen=lambda shape, gen: torch.rand(shape, generator=gen) * 1e-2),
    Tensor("bias", "N", FLOAT_DTYPES, optional=True, gen="small"),
    Tensor("quant_scale", "H", (torch.float32,), optional=True, flat=True, gen="smooth"),
    Bool("activate_left", default=False, kw_only=True),
    Choice("dst_type", DST_TYPES, default="int8", kw_only=True),
], [Output("y", "codes"), Output("scale", "scale")], check=_halves, min_dims={"N": 2},
    examples=({"R": (2, 5), "N": 128, "H": 64, "activate_left": True},
              {"R": (3,), "N": 6840, "H": 3420, "bias": None},
              {"R": (1,), "N": 22016, "H": 11008, "activate_left": True, "bias": None},
              {"R": (4,), "N": 80, "H": 40, "quant_scale": None, "dst_type": "int4"}))

