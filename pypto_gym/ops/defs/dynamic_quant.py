"""dynamic_quant (SPEC 11): per-token symmetric int8/int4 of a linear's input that no fused op produced.

n = f32(x) * f32(smooth_scales) (SmoothQuant's 1/s for the linear's input channels, optional, any
float dtype: x's for torch_npu's npu_dynamic_quant, fp32 where rows escaped a producer with an fp32
one); (y, scale) = the per-row rule every quantised op shares (ops/quantize.py): scale = row_max|n| /
qmax (fp32, shape x.shape[:-1]), y = clamp(round(n / scale)), half to even. What an int8 o_proj, the
vision attn.proj and the merger's linears run on their float input; no gradient.
"""
import torch

from ..args import Choice, Output, Tensor
from ..op import Op
from ..quantize import DST_TYPES, quantize_rows


def dynamic_quant(x, smooth_scales=None, dst_type="int8"):
    """f32(x) * smooth_scales, per-row symmetric int8/int4 -> (y, scale). No gradient."""
    n = x.to(torch.float32)
    if smooth_scales is not None:
        n = n * smooth_scales.reshape(x.shape[-1]).to(torch.float32)
    return quantize_rows(n, dst_type)


DYNAMIC_QUANT = Op(dynamic_quant, [
    Tensor("x", "*R D"),
    Tensor("smooth_scales", "D", None, floats=True, optional=True, flat=True, gen="smooth"),
    Choice("dst_type", DST_TYPES, default="int8", kw_only=True),
], [Output("y", "codes"), Output("scale", "scale")], min_dims={"D": 1},
    examples=({"R": (2, 5), "D": 2048}, {"R": (3,), "D": 1280, "smooth_scales": None},
              {"R": (7,), "D": 40, "dtype": torch.float16, "dst_type": "int4"}, {"R": (4,), "D": 33,
                                                                                  "dtype": torch.float32}))
