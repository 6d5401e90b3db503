"""linear on the npu backend: F.linear (torch_npu's matmul, the bias added in it), then, for a GELU activation,
torch_npu.npu_gelu in the form asked.

Why npu_gelu and not torch's gelu: npu_gelu's page notes that torch's own gelu on an NPU ignores `approximate` and
computes the tanh form, so a model's erf GELU (a patch merger's nn.GELU()) run as its module computes the tanh form
there; this call computes the form the model asks. No fused linear + GELU is documented for it (npu_ffn's
activation "gelu" names no form), so these are two kernels. npu_gelu's limits (gelu_quant.py) decline a GELU call.
"""
import torch.nn.functional as F

from ...ops.defs.linear import ACTIVATIONS, LINEAR
from .gelu_quant import npu_gelu, npu_gelu_supports


@LINEAR.impl("npu", supports=lambda backend, x, weight, bias, activation:
             None if activation == "none" else npu_gelu_supports(backend, x))
def _(backend, x, weight, bias, activation):
    y = F.linear(x, weight, bias)
    return y if activation == "none" else npu_gelu(backend, y, ACTIVATIONS[activation])
