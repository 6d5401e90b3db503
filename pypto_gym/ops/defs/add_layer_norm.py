"""add_layer_norm: the residual add fused into the next LayerNorm (Qwen3-VL's vision block: `h = h + attn(...)`,
then `norm2(h)`), as add_rms_norm fuses it into an RMSNorm.

(y, x_out) = (F.layer_norm(x1 + x2), x1 + x2): x_out is the sum rounded to the inputs' dtype, the next residual, and
the norm reads that rounded sum, as HF's block does (its add is a tensor of the model's dtype before norm2 sees it).
The golden is HF's two steps themselves, so the `torch` backend is bit-identical to the block.
"""
import torch

from ..args import FLOAT_DTYPES, Float, Output, Tensor
from ..op import Op
from .layer_norm import VECTOR, layer_norm


def add_layer_norm(x1, x2, gamma=None, beta=None, eps=1e-5):
    """(layer_norm(x1 + x2), x1 + x2): the block's residual add, then its LayerNorm on the rounded sum."""
    x_out = x1 + x2
    return layer_norm(x_out, gamma, beta, eps), x_out


ADD_LAYER_NORM = Op(add_layer_norm, [
    Tensor("x1", "*R D", FLOAT_DTYPES),
    Tensor("x2", "*R D", None, like="x1"),
    Tensor("gamma", "D", case="weight", gen="weight", **VECTOR),
    Tensor("beta", "D", gen="small", **VECTOR),
    Float("eps", default=1e-5, low=0.0, low_open=True),
], [Output("y"), Output("x_out")], min_dims={"D": 1},
    examples=({"R": (2, 5), "D": 64, "eps": 1e-6}, {"R": (7,), "D": 1027}, {"R": (3,), "D": 33, "gamma": None,
                                                                           "beta": None},
              {"R": (2, 3), "D": 40, "dtype": torch.float16}, {"R": (4,), "D": 96, "dtype": torch.float32},
              {"R": (5,), "D": 72, "gamma_dtype": torch.float32, "beta_dtype": torch.float32}))
