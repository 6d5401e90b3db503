"""linear on the cpu backend: oneDNN's matmul adding the bias, and a GELU, in its epilogue as the product is written.

`torch.ops.mkldnn._linear_pointwise` (what inductor's oneDNN fusion calls), on the weight as it is (no prepacked
copy), where F.linear would first copy the bias into every row of the output: on the document page's vision block
(3744 rows; qkv, proj, gate, up, down) that copy was ~15 % of the five GEMMs' time (bf16, Intel AMX: 110 vs 94 ms).
Its outputs equalled F.linear's bit for bit on every shape tried (both are oneDNN's bf16 matmul rounding fp32 sums
once), so it is taken for bf16 with a bias where oneDNN runs bf16 matmuls; every other call without an activation is
F.linear itself (fp32 was slower through the op at the page's shapes and not bit-equal; without a bias there is
nothing to fuse). A GELU ("gelu" erf or "gelu_tanh") goes into the same epilogue, on the fp32 accumulator: one
rounding where the module rounds the linear's output and then the GELU's (at Qwen3-VL-2B's vision MLP fc1, 2944 x
1024 -> 4096 bf16 on AMX: 18.8 ms against 39.5 ms; 28 % of outputs one bf16 step apart, each side within one
rounding of the fp64 result), so within the precision rule, not bit-identical.
"""
import torch

from ... import hardware
from ...ops.defs.linear import ACTIVATIONS, LINEAR, linear


@LINEAR.impl("cpu")
def _(backend, x, weight, bias, activation):
    fused = bias is not None or activation != "none"
    if fused and x.dtype == torch.bfloat16 and x.dim() >= 2 and x.numel() and hardware.onednn_bf16():
        if activation == "none":
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "gelu", [], ACTIVATIONS[activation])
    return linear(x, weight, bias, activation)
