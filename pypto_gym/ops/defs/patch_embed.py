"""patch_embed: a vision tower's patch embedding, the Conv3d whose kernel is its stride (Qwen2-VL, Qwen2.5-VL).

HF hands the tower its pixels as flattened patches, x [N, C*T*P*P] (channels, the temporal pair, the patch's rows
and columns), and runs `proj`, an nn.Conv3d with kernel = stride = (T, P, P) and no padding, on x viewed [N, C, T,
P, P]: each output sees exactly one patch, so the convolution is one GEMM, x @ weight.view(O, -1)^T. torch's CPU
conv3d does not know that: on GutenOCR-3B's document page (3744 patches of 1176 values -> 1280) it took 413 ms in
bf16 where the GEMM takes 4 ms (fp32: 215 vs 31 ms), 41 % of the patched vision tower. vLLM (`Conv3dLayer`) and
transformers' own load-time fusion (`fusion_config={"patch_embeddings": True}`) run the GEMM; this op lets a
patched, already loaded model do the same without touching its weights or state dict.

The golden is HF's forward (the conv3d), so the `torch` backend is bit-identical to HF; the GEMM sums the same
products in another order (within precision, kind `mixture`).
"""
import math

import torch
import torch.nn.functional as F

from ..args import FLOAT_DTYPES, ArgValueError, Output, Tensor
from ..op import Op


def patch_embed(x, weight, bias=None):
    """conv3d of each patch row of x [N, K] with weight [O, C, T, H, W] (kernel = stride, K = C*T*H*W) -> [N, O]."""
    kernel = tuple(weight.shape[2:])
    y = F.conv3d(x.view(-1, *weight.shape[1:]), weight, bias, stride=kernel)
    return y.view(-1, weight.shape[0])


def _check(ctx, x, weight, bias):
    K, patch = ctx.dims["K"], [ctx.dims[d] for d in ("C", "T", "H", "W")]
    if K != math.prod(patch):
        raise ArgValueError("x", f"rows of K={K} values; expected one patch of C*T*H*W = "
                                 f"{' * '.join(map(str, patch))} = {math.prod(patch)} (weight's shape)")


PATCH_EMBED = Op(patch_embed, [
    Tensor("x", "N K", FLOAT_DTYPES, case="hidden_states"),
    Tensor("weight", "O C T H W", None, like="x"),
    Tensor("bias", "O", None, like="x", optional=True, gen="small"),
], [Output("y", "mixture")], check=_check, min_dims={"K": 1, "O": 1},
    examples=({"N": 12, "K": 96, "O": 16, "C": 3, "T": 2, "H": 4, "W": 4, "bias": None},
              {"N": 5, "K": 24, "O": 7, "C": 2, "T": 1, "H": 3, "W": 4, "dtype": torch.float32},
              {"N": 9, "K": 48, "O": 8, "C": 3, "T": 1, "H": 4, "W": 4, "dtype": torch.float16}))


def as_linear(x, weight, bias):
    """The GEMM the convolution is: the weight viewed [O, C*T*H*W] (no copy), one `F.linear` (oneDNN on the CPU,
    the cube unit's matmul through torch_npu on an NPU): what the cpu and npu backends both run."""
    return F.linear(x, weight.reshape(weight.shape[0], -1), bias)
