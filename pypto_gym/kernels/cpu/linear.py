"""linear on the cpu backend: oneDNN's matmul adding the bias in its epilogue, as the product is written.

`torch.ops.mkldnn._linear_pointwise` (what inductor's oneDNN fusion calls), on the weight as it is (no prepacked
copy), where F.linear would first copy the bias into every row of the output: on the document page's vision block
(3744 rows; qkv, proj, gate, up, down) that copy was ~15 % of the five GEMMs' time (bf16, Intel AMX: 110 vs 94 ms).
Its outputs equalled F.linear's bit for bit on every shape tried (both are oneDNN's bf16 matmul rounding fp32 sums
once), so it is taken for bf16 with a bias where oneDNN runs bf16 matmuls; every other call is F.linear itself
(fp32 was slower through the op at the page's shapes and not bit-equal; without a bias there is nothing to fuse).
"""
import torch
import torch.nn.functional as F

from ... import hardware
from ...ops.defs.linear import LINEAR


@LINEAR.impl("cpu")
def _(backend, x, weight, bias):
    if bias is not None and x.dtype == torch.bfloat16 and x.dim() >= 2 and x.numel() and hardware.onednn_bf16():
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
