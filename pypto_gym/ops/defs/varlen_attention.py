"""varlen_attention (SPEC 14): softmax(q k^T * scale) v inside each window of `cu_seqlens`, all windows and heads in
one call: the attention of a Qwen2.5-VL / Qwen2-VL vision block.

q, k, v are [T, H, D] (the T tokens of every window, one after another); window w is tokens
cu_seqlens[w]..cu_seqlens[w+1], attending to itself only, no mask inside it. HF's vision attention (sdpa and eager)
splits q, k and v by those lengths and calls the attention once per window: about 60 calls per block for a
document page, 1,700 per image, each a few small kernels. The full-attention blocks are the same op with one
window per image.

- `hf` (default): HF's per-window loop itself, `F.scaled_dot_product_attention` per window (HF's default
  `sdpa` implementation): bit-identical to HF on the `torch` backend.
- `fp32`: the same in fp32, rounded once.

cu_seqlens is a list of ints (HF's tensor `.tolist()`, as HF's own loop does to split): the windows are the
op's shape, recorded in case files, and what the NPU's fused attention takes as `actual_seq_lengths`.
"""
import torch
import torch.nn.functional as F

from ..args import FLOAT_DTYPES, ArgValueError, Choice, Float, Ints, Output, Tensor
from ..op import Op

CAST_MODES = ("hf", "fp32")
MODES = {"hf": 0, "fp32": 1}  # the codes the cpu kernel takes for a cast mode


def varlen_attention(q, k, v, cu_seqlens, scale, cast_mode="hf"):
    """softmax(q k^T * scale) v per window of cu_seqlens; `hf` as HF's per-window sdpa loop, `fp32` in fp32."""
    dtype = q.dtype
    if cast_mode == "fp32":
        q, k, v = q.float(), k.float(), v.float()
    outs = []
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):  # as HF: [1, H, L, D] views of one window each
        window = [t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        outs.append(F.scaled_dot_product_attention(*window, scale=scale)[0].transpose(0, 1))
    y = torch.cat(outs) if outs else q.new_empty(q.shape)
    return y.to(dtype).contiguous()


def _check(ctx, q, k, v, cu_seqlens, scale, cast_mode):
    T = q.shape[0]
    if not cu_seqlens or cu_seqlens[0] != 0 or cu_seqlens[-1] != T or \
            any(b < a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])):
        shown = list(cu_seqlens) if len(cu_seqlens) <= 8 else [*cu_seqlens[:4], "...", *cu_seqlens[-2:]]
        raise ArgValueError("cu_seqlens", f"{shown}; expected window bounds rising from 0 to T = {T}", "value")


def windows(sizes) -> list[int]:
    """cu_seqlens for windows of these sizes."""
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    return bounds


VARLEN_ATTENTION = Op(varlen_attention, [
    Tensor("q", "T H D", FLOAT_DTYPES, case="query"),
    Tensor("k", "T H D", None, like="q", case="key"),
    Tensor("v", "T H D", None, like="q", case="value"),
    Ints("cu_seqlens"),
    Float("scale", low=0.0, low_open=True),
    Choice("cast_mode", CAST_MODES, default="hf", kw_only=True),
], [Output("out", "mixture")], check=_check, min_dims={"D": 1, "H": 1},
    examples=({"T": 10, "H": 2, "D": 16, "cu_seqlens": [0, 4, 10], "scale": 0.25},
              {"T": 200, "H": 3, "D": 80, "cu_seqlens": [0, 64, 128, 130, 130, 200], "scale": 80 ** -0.5},
              {"T": 150, "H": 2, "D": 24, "cu_seqlens": [0, 150], "scale": 0.2, "cast_mode": "fp32"},
              {"T": 7, "H": 1, "D": 5, "cu_seqlens": [0, 3, 7], "scale": 0.4, "dtype": torch.float16},
              {"T": 83, "H": 2, "D": 7, "cu_seqlens": [0, 3, 83], "scale": 0.3},
              {"T": 70, "H": 2, "D": 32, "cu_seqlens": [0, 70], "scale": 0.17, "dtype": torch.float32}))
