"""varlen_attention on the npu backend: one npu_fused_infer_attention_score call in the TND layout.

q, k, v [T, N, D] go as they are, the windows as actual_seq_lengths (cumulative ends, empty windows dropped: the
form vllm-ascend's AscendMMEncoderAttention passes for Qwen2.5-VL's vision attention), no mask, sparse_mode 0,
pre/next tokens unbounded. The TND layout takes a head dim of 128, or 192 for q and k (its page's TND constraints):
a smaller D is zero-padded to 128 (Qwen2.5-VL's 80, Qwen3-VL's 64; vllm-ascend pads the same way), one between 128
and 192 to 192, and the output sliced back (zero columns change neither q k^T nor the value rows' first D columns);
a larger D is declined, as are more than 4096 sequences. torch_npu 7.x keyword names (`scale`; 6.0's was
`scale_value`).
"""
import torch
import torch.nn.functional as F

from ...ops.args import dtype_name
from ...ops.defs.varlen_attention import VARLEN_ATTENTION
from .backend import FIA, FIA_MAX_TND_SEQUENCES, FIA_TND_D, fia_limits

FIA_ALL_TOKENS = 2 ** 31 - 1


def fia_tnd_dim(D: int) -> int | None:
    """The head dim the TND call runs at: D padded to 128 or 192, None above 192."""
    return next((d for d in FIA_TND_D if D <= d), None)


def _npu_supports(backend, q, k, v, cu_seqlens, scale, cast_mode):
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"{FIA}: query {dtype_name(q.dtype)} (float16, bfloat16 or int8 only)"
    if not q.numel():
        return f"{FIA}: empty tensors are not supported"
    if backend.series_of(q) != "a2_a3":
        return f"{FIA}: supported on Atlas A2/A3 chips only"
    D = q.shape[-1]
    if fia_tnd_dim(D) is None:
        return f"{FIA}: head dim {D} in the TND layout (128, or 192 for q and k; a smaller one is padded)"
    sequences = sum(1 for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]) if b > a)
    if sequences > FIA_MAX_TND_SEQUENCES:
        return f"{FIA}: {sequences} sequences in the TND layout (at most {FIA_MAX_TND_SEQUENCES})"
    return fia_limits(sequences, q.shape[1], q.shape[1], 2, fia_tnd_dim(D), 0, q.dtype)


@VARLEN_ATTENTION.impl("npu", supports=_npu_supports)
def _(backend, q, k, v, cu_seqlens, scale, cast_mode):
    T, H, D = q.shape
    pad = fia_tnd_dim(D) - D
    q, k, v = [F.pad(t, (0, pad)) if pad else t.contiguous() for t in (q, k, v)]
    ends = [b for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]) if b > a]
    out, _ = backend.torch_npu().npu_fused_infer_attention_score(
        q, k, v, actual_seq_lengths=ends, actual_seq_lengths_kv=ends, num_heads=H, num_key_value_heads=H,
        input_layout="TND", scale=float(scale), sparse_mode=0, pre_tokens=FIA_ALL_TOKENS, next_tokens=FIA_ALL_TOKENS)
    return out[..., :D].contiguous() if pad else out
