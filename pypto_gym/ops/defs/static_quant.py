"""static_quant (SPEC 15): static per-tensor int8 of a linear's input that no fused op produced.

y = clamp(rint(n / f32(scale) + f32(offset)), -128, 127) with n = f32(x) (* f32(smooth_scales), SmoothQuant's
1/s for the linear's input channels, as dynamic_quant takes it) (ops/quantize.py `quantize_static`): one scale
and one integer offset fixed offline by calibration, msModelSlim's W8A8 activation rule and torch_npu's
npu_quantize with div_mode=True (which has no smooth scale: a checkpoint folds it into the source's weights).
What a static int8 o_proj and down_proj run on their float input (the norms' static forms produce the other
linears' codes directly); no gradient.
"""
import torch

from ..args import Output, Tensor
from ..op import Op
from ..quantize import quantize_static
from .norm_quant import STATIC_OFFSET, STATIC_SCALE


def static_quant(x, scale, offset=None, smooth_scales=None):
    """Static per-tensor int8 of f32(x) (* smooth_scales) under `scale` and `offset` -> y int8. No gradient."""
    n = x.to(torch.float32)
    if smooth_scales is not None:
        n = n * smooth_scales.reshape(x.shape[-1]).to(torch.float32)
    return quantize_static(n, scale, offset)


STATIC_QUANT = Op(static_quant, [
    Tensor("x", "*R D"), STATIC_SCALE, STATIC_OFFSET,
    Tensor("smooth_scales", "D", None, floats=True, optional=True, flat=True, gen="smooth"),
], [Output("y", "codes")], min_dims={"D": 1},
    examples=({"R": (2, 5), "D": 2048}, {"R": (3,), "D": 1280, "offset": None, "smooth_scales": None},
              {"R": (7,), "D": 40, "dtype": torch.float16}, {"R": (4,), "D": 33, "dtype": torch.float32}))
