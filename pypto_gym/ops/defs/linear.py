"""linear: y = act(x W^T (+ b)), as `nn.Linear` (then the module's GELU) computes it; what a patched site's linears
(the MLP's projections, the attentions' q/k/v/o or qkv/proj) run where the cpu backend adds their bias in the GEMM's
epilogue, and a GELU MLP's first linear with its activation (`gelu`: erf, `nn.GELU()`; `gelu_tanh`: HF's
`gelu_pytorch_tanh`, Qwen3-VL's vision MLP) in the same epilogue.

On the CPU, `F.linear(x, W, b)` first copies `b` into every row of the output and then has oneDNN accumulate
`x W^T` onto it: a pass over the output before the GEMM; a GELU after it is one more pass each way over a tensor
four times the width of the block (in bf16 eager at Qwen3-VL-2B's vision MLP, 2944 x 4096: 27 ms of a 39 ms fc1).
Through this op a site's linears are counted per backend, recorded by ShapeRecorder and timed by `bench ops` like
every fused op. The golden is `F.linear` then `F.gelu` itself, so the `torch` backend is bit-identical to the
module (two roundings: the linear's output, then the GELU's); outputs are judged relative to their row's scale (kind
`mixture`).
"""
import torch
import torch.nn.functional as F

from ..args import FLOAT_DTYPES, Choice, Output, Tensor
from ..op import Op

ACTIVATIONS = {"none": None, "gelu": "none", "gelu_tanh": "tanh"}  # activation -> F.gelu's `approximate`


def linear(x, weight, bias=None, activation="none"):
    """act(x @ weight^T + bias): `F.linear` (nn.Linear's forward), then `F.gelu` for a GELU activation."""
    y = F.linear(x, weight, bias)
    return y if activation == "none" else F.gelu(y, approximate=ACTIVATIONS[activation])


LINEAR = Op(linear, [
    Tensor("x", "*R K", FLOAT_DTYPES, case="hidden_states"),
    Tensor("weight", "N K", None, like="x", case="weight"),
    Tensor("bias", "N", None, like="x", optional=True, gen="small"),
    Choice("activation", tuple(ACTIVATIONS), default="none", kw_only=True),
], [Output("y", "mixture")], min_dims={"K": 1, "N": 1},
    examples=({"R": (2, 5), "K": 64, "N": 48}, {"R": (37,), "K": 80, "N": 24, "bias": None},
              {"R": (3,), "K": 33, "N": 16, "dtype": torch.float16}, {"R": (4,), "K": 40, "N": 8, "dtype": torch.float32},
              {"R": (2, 9), "K": 64, "N": 96, "activation": "gelu_tanh"}, {"R": (6,), "K": 48, "N": 32, "activation": "gelu"},
              {"R": (5,), "K": 32, "N": 16, "bias": None, "activation": "gelu_tanh"}))
