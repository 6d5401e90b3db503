"""decoder_attention on the pypto backend: attention.py's online softmax over key tiles (no cube tile splits K).

Each (batch, KV head) pair holds that KV head's query heads as rows: at a decode step (S = 1) its G heads (padded to 16
rows), in a prefill chunks of tokens x G heads (up to 64 rows, row = token * G + head), each row with its own bias (the
causal future and a padding mask masked; keys padded to whole tiles masked).
"""
import torch

from ...ops.defs.decoder_attention import DECODER_ATTENTION
from .attention import MAX_ROWS, key_tile, tiled_attention
from .backend import MASKED


def _pair_shape(q, k) -> tuple[int, int, int, int]:
    """(tokens per pair, pairs per (batch, KV head), rows per pair padded to 16, head_dim padded to 16)."""
    S, G = q.shape[2], q.shape[1] // k.shape[1]
    St = max(1, min(S, MAX_ROWS // G))
    return St, -(-S // St), -(-(St * G) // 16) * 16, -(-q.shape[3] // 16) * 16


def _pypto_supports(backend, q, k, v, scale, is_causal, attn_mask, decode_gqa):
    if q.shape[1] // k.shape[1] > MAX_ROWS:
        return f"{q.shape[1] // k.shape[1]} query heads per KV head: the kernel holds up to {MAX_ROWS} rows"
    _, _, R, D16 = _pair_shape(q, k)
    _, why = key_tile(k.shape[2], R, D16, q.element_size(), True)
    if why:
        return why
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
    St, chunks, R, D16 = _pair_shape(q, k)
    tile, _ = key_tile(Skv, R, D16, q.element_size(), True)
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
