"""decoder_attention on the npu backend: npu_fused_infer_attention_score in the BNSD layout with the documented GQA
argument (num_key_value_heads); a causal prefill as sparse_mode 3 with the 2048 x 2048 upper-triangular mask the docs
ask for, a padding mask passed inverted (FIA masks where True); S = 1 takes its incremental (decode) branch."""
import functools

import torch

from ...ops.args import dtype_name
from ...ops.defs.decoder_attention import DECODER_ATTENTION
from .backend import FIA, fia_limits

FIA_CAUSAL = 2048
# inner_precise 2: high precision with the row-invalid correction its page asks for where a mask row is all masked
# (a left-padded batch's padding rows; corrected rows are zeros, as torch's sdpa gives); a decode step takes 0 or 1
FIA_ROW_CORRECTION = 2


@functools.lru_cache(maxsize=8)
def _fia_causal_mask(device) -> torch.Tensor:
    """The documented sparse_mode 3 mask, made once per device (a prefill calls FIA once per layer)."""
    return torch.ones(FIA_CAUSAL, FIA_CAUSAL, dtype=torch.bool, device=device).triu(1)


def _npu_supports(backend, q, k, v, scale, is_causal, attn_mask, decode_gqa):
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"{FIA}: query {dtype_name(q.dtype)} (float16, bfloat16 or int8 only)"
    if backend.series_of(q) != "a2_a3":
        return f"{FIA}: supported on Atlas A2/A3 chips only"
    B, N, S, D = q.shape
    return fia_limits(B, N, k.shape[1], S, D, k.shape[2], q.dtype)


@DECODER_ATTENTION.impl("npu", supports=_npu_supports)
def _(backend, q, k, v, scale, is_causal, attn_mask, decode_gqa):
    B, Hq, S, D = q.shape
    kw = {}
    if is_causal and S > 1 and attn_mask is None:
        k, v = k[:, :, :S], v[:, :, :S]
        kw = {"atten_mask": _fia_causal_mask(q.device), "sparse_mode": 3}
    elif attn_mask is not None:  # a prefill's padding mask can leave a row no key: the page's correction for it
        kw = {"atten_mask": ~attn_mask, "sparse_mode": 0, **({"inner_precise": FIA_ROW_CORRECTION} if S > 1 else {})}
    out, _ = backend.torch_npu().npu_fused_infer_attention_score(
        q.contiguous(), k.contiguous(), v.contiguous(), num_heads=Hq, num_key_value_heads=k.shape[1],
        input_layout="BNSD", scale=float(scale), **kw)
    return out.transpose(1, 2).contiguous()
