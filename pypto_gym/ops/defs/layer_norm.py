"""layer_norm: the LayerNorm with a bias Qwen3-VL's vision tower runs (every block's norm1 and norm2, the patch
mergers' norm): y = (x - mean(x)) / sqrt(var(x) + eps) * gamma + beta over the last dim, the variance biased.

The golden is `F.layer_norm` itself, as `nn.LayerNorm` runs it, so the `torch` backend is bit-identical to HF's
module; torch computes a 16-bit row in fp32 and rounds once to x's dtype, and the kernels do the same arithmetic
in their own order (within an ulp or two of the output; SPEC 5's rule). gamma and beta are optional (a LayerNorm
without elementwise affine) and may be any float dtype (an fp32 LayerNorm in a bf16 model: torch's mixed form, the
output in x's dtype).
"""
import torch
import torch.nn.functional as F

from ..args import FLOAT_DTYPES, Float, Output, Tensor
from ..op import Op


def layer_norm(x, gamma=None, beta=None, eps=1e-5):
    """F.layer_norm over the last dim: (x - mean) / sqrt(var + eps) * gamma + beta (nn.LayerNorm's forward)."""
    D = x.shape[-1]
    return F.layer_norm(x, (D,), None if gamma is None else gamma.reshape(D), None if beta is None else beta.reshape(D),
                        eps)


VECTOR = dict(floats=True, optional=True, flat=True)
LAYER_NORM = Op(layer_norm, [
    Tensor("x", "*R D", FLOAT_DTYPES, case="hidden_states"),
    Tensor("gamma", "D", case="weight", gen="weight", **VECTOR),
    Tensor("beta", "D", gen="small", **VECTOR),
    Float("eps", default=1e-5, low=0.0, low_open=True),
], [Output("y", case="output")], min_dims={"D": 1},
    examples=({"R": (2, 5), "D": 64, "eps": 1e-6}, {"R": (7,), "D": 1027}, {"R": (3,), "D": 33, "gamma": None,
                                                                           "beta": None},
              {"R": (2, 3), "D": 40, "dtype": torch.float16}, {"R": (4,), "D": 96, "dtype": torch.float32},
              {"R": (5,), "D": 72, "gamma_dtype": torch.float32, "beta_dtype": torch.float32}))
