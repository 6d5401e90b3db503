"""decoder_attention on the cpu backend."""
from ...ops.defs.decoder_attention import DECODER_ATTENTION, decoder_attention


@DECODER_ATTENTION.impl("cpu")
def _(backend, q, k, v, scale, is_causal, attn_mask, decode_gqa):
    """torch's own scaled_dot_product_attention (its flash-attention CPU kernel, GQA without copies): HF's sdpa
    is already one fused attention per layer on the CPU; no kernel of ours is written for it."""
    return decoder_attention(q, k, v, scale, is_causal, attn_mask, decode_gqa)
