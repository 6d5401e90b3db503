"""linear: y = x W^T (+ b), as `nn.Linear` computes it; what a patched site's linears (the MLP's projections, the
attentions' q/k/v/o or qkv/proj) run where the cpu backend adds their bias in the GEMM's epilogue.

On the CPU, `F.linear(x, W, b)` first copies `b` into every row of the output and then has oneDNN accumulate
`x W^T` onto it: a pass over the output before the GEMM. Through this op a site's linears are counted per backend,
recorded by ShapeRecorder and timed by `bench ops` like every fused op. The golden is `F.linear` itself, so the
`torch` backend is bit-identical to the module; outputs are judged relative to their row's scale (kind `mixture`).
"""
import torch
import torch.nn.functional as F

from ..args import FLOAT_DTYPES, Output, Tensor
from ..op import Op


def linear(x, weight, bias=None):
    """x @ weight^T + bias, exactly `F.linear` (nn.Linear's forward)."""
    return F.linear(x, weight, bias)


LINEAR = Op(linear, [
    Tensor("x", "*R K", FLOAT_DTYPES, case="hidden_states"),
    Tensor("weight", "N K", None, like="x", case="weight"),
    Tensor("bias", "N", None, like="x", optional=True, gen="small"),
], [Output("y", "mixture")], min_dims={"K": 1, "N": 1},
    examples=({"R": (2, 5), "K": 64, "N": 48}, {"R": (37,), "K": 80, "N": 24, "bias": None},
              {"R": (3,), "K": 33, "N": 16, "dtype": torch.float16}, {"R": (4,), "K": 40, "N": 8, "dtype": torch.float32}))
