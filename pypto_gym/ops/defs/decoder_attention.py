"""decoder_attention (SPEC 14): a text decoder layer's attention over HF's KV cache, as transformers' `sdpa`
attention function computes it: softmax(q k^T * scale + mask) v per query head, GQA (several query heads per KV
head), causal prefill or a masked / unmasked decode step.

q is [B, Hq, S, D] (the S new tokens), k and v are [B, Hkv, Skv, D] (the cache after this step's update), Hq a
multiple of Hkv; the output is [B, S, Hq, D] (what HF's attention interface returns, before `o_proj`). The mask is
what transformers' `sdpa_mask` builds: None, or bool [B, 1, S, Skv] with True where a query may attend (padding in
a batch, a chunked prefill). `is_causal` is the module's flag: it applies when there is no mask and S > 1, top-left
aligned (HF crops the keys to S when a static cache hands it more).

How HF hands GQA to torch's sdpa (transformers 5.x, `integrations/sdpa_attention.py`; the golden follows it step
by step, so the `torch` backend is bit-identical to HF): no mask -> `enable_gqa`; a masked decode step (S = 1) ->
the query heads of each KV head packed as rows (`pack_gqa`, 5.x) or the KV heads repeated (`repeat_kv`, 4.57; in
fp32 and fp16 the two round differently, so `decode_gqa` says which transformers' form to follow); a masked
prefill -> `repeat_kv`.

The KV length is a shape: captured into case files like every op, so the 1k and 4k KV decode steps of a
document's answer are cases.
"""
import torch
import torch.nn.functional as F

from ..args import FLOAT_DTYPES, ArgValueError, Bool, Choice, Float, Output, Tensor
from ..op import Op

DECODE_GQA = ("pack", "repeat")


def _repeat_kv(t, groups):
    B, H, S, D = t.shape
    return t[:, :, None].expand(B, H, groups, S, D).reshape(B, H * groups, S, D)


def decoder_attention(q, k, v, scale, is_causal, attn_mask=None, decode_gqa="pack"):
    """HF's sdpa attention function on these arguments: [B, S, Hq, D]."""
    B, Hq, S, D = q.shape
    groups = Hq // k.shape[1]
    gqa = {}
    if groups > 1:
        if attn_mask is None and k.shape[-1] == v.shape[-1] <= 256:
            gqa["enable_gqa"] = True
        elif S == 1 and decode_gqa == "pack":  # one query row per head: the heads of a KV head as its rows
            q = q.reshape(B, Hq // groups, groups, D)
        else:
            k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
    causal = bool(is_causal and S > 1 and attn_mask is None)
    if causal and k.shape[2] > S:  # HF: an empty static cache's keys beyond the prompt are cropped
        k, v = k[:, :, :S], v[:, :, :S]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, is_causal=causal, **gqa)
    return out.reshape(out.shape[0], -1, S, v.shape[-1]).transpose(1, 2).contiguous()


def padded_causal_mask(shape, gen):
    """A mask as transformers builds it for a left-padded batch: query i of sequence b sees keys pad_b ... its own
    position (Skv - S + i); pad_b <= Skv - S, so every query sees at least one key."""
    B, _, S, Skv = shape
    pad = torch.randint(0, Skv - S + 1, (B,), generator=gen)
    j, i = torch.arange(Skv), torch.arange(S)
    return (j >= pad[:, None, None, None]) & (j <= i[:, None] + Skv - S)


def _check(ctx, q, k, v, scale, is_causal, attn_mask, decode_gqa):
    Hq, Hkv = q.shape[1], k.shape[1]
    if Hq % Hkv:
        raise ArgValueError("k", f"{Hkv} KV heads for {Hq} query heads; expected Hq a multiple of Hkv")
    if is_causal and attn_mask is None and 1 < q.shape[2] and k.shape[2] < q.shape[2]:
        raise ArgValueError("k", f"{k.shape[2]} keys for {q.shape[2]} causal queries; expected at least as many keys")


DECODER_ATTENTION = Op(decoder_attention, [
    Tensor("q", "B Hq S D", FLOAT_DTYPES, case="query"),
    Tensor("k", "B Hkv Skv D", None, like="q", case="key"),
    Tensor("v", "B Hkv Skv D", None, like="q", case="value"),
    Float("scale", low=0.0, low_open=True),
    Bool("is_causal"),
    Tensor("attn_mask", "B 1 S Skv", (torch.bool,), optional=True, gen=padded_causal_mask, case="attention_mask"),
    Choice("decode_gqa", DECODE_GQA, default="pack", kw_only=True),
], [Output("out", "mixture")], check=_check, min_dims={"D": 1, "Hq": 1, "Hkv": 1, "S": 1, "Skv": 1},
    examples=({"B": 1, "Hq": 4, "Hkv": 2, "S": 9, "Skv": 9, "D": 32, "attn_mask": None, "scale": 32 ** -0.5,
               "is_causal": True},
              {"B": 2, "Hq": 16, "Hkv": 2, "S": 1, "Skv": 300, "D": 128, "scale": 128 ** -0.5, "is_causal": True},
              {"B": 1, "Hq": 16, "Hkv": 2, "S": 1, "Skv": 1024, "D": 128, "attn_mask": None, "scale": 128 ** -0.5,
               "is_causal": True},
              {"B": 2, "Hq": 6, "Hkv": 3, "S": 5, "Skv": 12, "D": 16, "scale": 0.25, "is_causal": True,
               "dtype": torch.float16},
              {"B": 2, "Hq": 8, "Hkv": 2, "S": 1, "Skv": 40, "D": 64, "scale": 0.125, "is_causal": True,
               "dtype": torch.float32, "decode_gqa": "repeat"},
              {"B": 1, "Hq": 2, "Hkv": 2, "S": 7, "Skv": 7, "D": 24, "attn_mask": None, "scale": 0.2,
               "is_causal": False, "dtype": torch.float32},
              {"B": 3, "Hq": 6, "Hkv": 2, "S": 1, "Skv": 70, "D": 24, "scale": 0.2, "is_causal": True,
               "dtype": torch.float16}))
