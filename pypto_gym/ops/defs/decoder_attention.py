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
import functools

import torch
import torch.nn.functional as F

from ..args import FLOAT_DTYPES, ArgValueError, Bool, Choice, Float, Output, Tensor, dtype_name
from ..backends.npu import FIA, fia_limits
from ..backends.pypto_attention import MAX_ROWS, key_tile, tiled_attention
from ..backends.pypto_backend import MASKED
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


@DECODER_ATTENTION.impl("cpu")
def _(backend, q, k, v, scale, is_causal, attn_mask, decode_gqa):
    """torch's own scaled_dot_product_attention (its flash-attention CPU kernel, GQA without copies): HF's sdpa
    is already one fused attention per layer on the CPU; no kernel of ours is written for it."""
    return decoder_attention(q, k, v, scale, is_causal, attn_mask, decode_gqa)


# ---- npu: npu_fused_infer_attention_score in the BNSD layout with the documented GQA argument
# (num_key_value_heads); a causal prefill as sparse_mode 3 with the 2048 x 2048 upper-triangular mask the docs ask
# for, a padding mask passed inverted (FIA masks where True); S = 1 takes its incremental (decode) branch.
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


# ---- pypto: pypto_attention's online softmax over key tiles (no cube tile splits K). Each (batch, KV head) pair
# holds that KV head's query heads as rows: at a decode step (S = 1) its G heads (padded to 16 rows), in a prefill
# chunks of tokens x G heads (up to 64 rows, row = token * G + head), each row with its own bias (the causal future
# and a padding mask masked; keys padded to whole tiles masked).


def _pypto_supports(backend, q, k, v, scale, is_causal, attn_mask, decode_gqa):
    if q.shape[1] // k.shape[1] > MAX_ROWS:
        return f"{q.shape[1] // k.shape[1]} query heads per KV head: the kernel holds up to {MAX_ROWS} rows"
    if attn_mask is not None and attn_mask.device.type != "meta" and not bool(attn_mask.any(-1).all()):
        return "a query row that the mask lets attend to no key (sdpa's answer for it is not a softmax)"
    return backend.runs_on(q)


def _row_bias(q, k, is_causal, attn_mask) -> tuple[torch.Tensor, int]:
    """The additive fp32 bias [B, S, Skv] each query token sees (the keys HF's sdpa call reads) and Skv."""
    B, _, S, _ = q.shape
    Skv = S if is_causal and S > 1 and attn_mask is None else k.shape[2]  # HF crops a static cache's keys to S
    if attn_mask is not None:
        allowed = attn_mask[:, 0]
    elif is_causal and S > 1:
        allowed = torch.ones(S, Skv, dtype=torch.bool, device=q.device).tril()[None]
    else:
        allowed = torch.ones(1, S, Skv, dtype=torch.bool, device=q.device)
    zero = torch.zeros((), dtype=torch.float32, device=q.device)
    return torch.where(allowed, zero, MASKED).expand(B, S, Skv), Skv


@DECODER_ATTENTION.impl("pypto", supports=_pypto_supports)
def _(backend, q, k, v, scale, is_causal, attn_mask, decode_gqa):
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    bias, Skv = _row_bias(q, k, is_causal, attn_mask)
    St = max(1, min(S, MAX_ROWS // G))  # tokens per pair
    chunks = -(-S // St)
    R, D16, tile = -(-(St * G) // 16) * 16, -(-D // 16) * 16, key_tile(Skv)
    S_pad = -(-Skv // tile) * tile
    # [B, Hkv, G, S, D] -> [B, Hkv, S, G, D]: a token's G heads on consecutive rows; tokens padded to whole chunks
    qt = q.reshape(B, Hkv, G, S, D).transpose(2, 3)
    qp = q.new_zeros(B, Hkv, chunks * St, G, D16)
    qp[:, :, :S, :, :D] = qt
    qp = qp.reshape(B * Hkv * chunks, St * G, D16)
    qp = torch.cat([qp, qp.new_zeros(qp.shape[0], R - St * G, D16)], 1) if R > St * G else qp
    kp, vp = (t.new_zeros(B, Hkv, S_pad, D16) for t in (k, v))
    kp[:, :, :Skv, :D], vp[:, :, :Skv, :D] = k[:, :, :Skv], v[:, :, :Skv]
    kp, vp = (t[:, :, None].expand(B, Hkv, chunks, S_pad, D16).reshape(-1, S_pad, D16) for t in (kp, vp))
    rb = torch.full((B, chunks * St, S_pad), MASKED, dtype=torch.float32, device=q.device)
    rb[:, :S, :Skv] = bias  # padded tokens attend to nothing real: their rows are cut off below
    rb[:, S:, :1] = 0.0  # ... but see one key, so their softmax stays finite
    if S == 1:  # one bias row per pair
        rb = rb[:, None].expand(B, Hkv, 1, S_pad).reshape(-1, 1, S_pad)
    else:  # a bias row per query row: each token's row repeated for its G heads, padded rows masked but one key
        rb = rb.reshape(B, 1, chunks, St, 1, S_pad).expand(B, Hkv, chunks, St, G, S_pad).reshape(-1, St * G, S_pad)
        if R > St * G:
            pad = torch.full((rb.shape[0], R - St * G, S_pad), MASKED, dtype=torch.float32, device=q.device)
            pad[..., 0] = 0.0
            rb = torch.cat([rb, pad], 1)
    o = tiled_attention(backend, "decoder_attention", qp, kp, vp, rb, scale, tile)
    o = o[:, :St * G, :D].reshape(B, Hkv, chunks * St, G, D)[:, :, :S]  # [B, Hkv, S, G, D]
    return o.permute(0, 2, 1, 3, 4).reshape(B, S, Hq, D).contiguous()
