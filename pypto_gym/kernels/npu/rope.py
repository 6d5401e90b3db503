"""rope, qk_norm_rope and rotary_embedding on the npu backend: torch_npu.npu_apply_rotary_pos_emb / npu_rotary_mul,
npu_rms_norm, npu_mrope.

Both compute x*cos + rotate_half(x)*sin ("half" mode) in one kernel and round once: our fp32 mode, with
q, k, cos and sin cast to fp32 first (hf mode with fp32 inputs or an fp32 cos is the same math). hf mode
on fp16/bf16 is not mapped: HF rounds both products before the sum, and where they nearly cancel one
rounding differs from that by far more than an ulp of the result (SPEC 5 fails), so it runs elsewhere. The layout
is BSND (B = O, S = I, N = heads), or [1, O, H, D] when there is no S dim (vision [S, H, D]): documented BNSD limits
(B*N <= 8*S) rule BNSD out at decode and in vision.
- npu_apply_rotary_pos_emb(query, key, cos, sin, layout="BSND", rotary_mode="half") rotates q and k in
  one launch, in place (on copies here, so the op stays out-of-place); B and S of cos must equal q's;
  used as vllm-ascend does, for full rotary with head_dim 128 or 64.
- npu_rotary_mul(x, r1, r2, rotary_mode="half") otherwise, once for q and once for k: 4-D, cos/sin as
  1S1D or BS1D, D < 896 and even, B and N < 1000 (Atlas A2/A3, jit_compile=False); older series: D = 128.
  head_dim 80 (the vision tower) only fits this one. Partial rotary: the rotated part, then a cat.
rope does not use npu_mrope: it gathers cos/sin from a position-indexed cache inside the kernel, whereas HF
hands the attention cos/sin already computed; MRoPE's section merge runs first (two cats, as 5.x does).
rotary_embedding, whose cos/sin do come from such a cache, is npu_mrope.
"""

import torch

from ...ops.args import dtype_name
from ...ops.defs.rope import QK_NORM_ROPE, ROPE, ROTARY_EMBEDDING, like, merge_sections
from ..rope_layout import Layout, angles_not_float, out_dtypes
from .backend import converted_once, needs
from .rms_norm import unit_gamma

NPU_LIMIT = 1000


def _npu_rope_layout(lay):
    """(x -> BSND view, cos/sin shape) for the canonical layout."""
    if lay.I == 1:
        return (lambda x4: x4.reshape(1, lay.O, x4.shape[1], x4.shape[3])), (1, lay.Oc, 1, lay.E)
    return (lambda x4: x4.permute(0, 2, 1, 3)), (lay.Oc, lay.I, 1, lay.E)


def _npu_rope_supports(backend, q, k, cos, sin, mrope_section, unsqueeze_dim, cast_mode):
    E = cos.shape[-1]
    reason = angles_not_float(cos)
    if reason:
        return reason
    if cast_mode == "hf" and torch.promote_types(q.dtype, cos.dtype) != torch.float32:
        return (f"hf mode on {dtype_name(q.dtype)}: torch_npu's rope kernels round once, HF rounds each product "
                f"(cast_mode='fp32' maps onto them)")
    if not q.numel() or not k.numel() or not cos.numel():
        return "npu_rotary_mul / npu_apply_rotary_pos_emb: empty tensors are not supported"
    lay = Layout(q.to("meta"), k.to("meta"), cos.to("meta"), sin.to("meta"), mrope_section, unsqueeze_dim)
    B, S = (1, lay.O) if lay.I == 1 else (lay.O, lay.I)
    if B >= NPU_LIMIT or max(lay.Hq, lay.Hk) >= NPU_LIMIT:
        return f"npu_rotary_mul: B={B} or N={max(lay.Hq, lay.Hk)} not below {NPU_LIMIT}"
    if backend.series_of(q) == "a2_a3":
        if E >= 896:
            return f"npu_rotary_mul: rotary dim {E} not below 896"
    elif E != 128:
        return f"npu_rotary_mul: rotary dim {E} must be 128 outside Atlas A2/A3"
    return None


def _npu_rotate(backend, lay, cast_mode, out_dtypes):
    tnpu = backend.torch_npu()
    compute = torch.float32 if cast_mode == "fp32" else torch.promote_types(lay.q.dtype, lay.cos.dtype)
    bsnd, angle_shape = _npu_rope_layout(lay)
    c, s = (t[0].reshape(angle_shape).to(compute) for t in (lay.cos, lay.sin))
    xs = [bsnd(x4).to(compute) for x4 in (lay.q, lay.k)]
    if lay.E == lay.D and lay.D in (64, 128):
        if c.shape[0] != xs[0].shape[0]:
            c, s = (t.expand(xs[0].shape[0], *t.shape[1:]).contiguous() for t in (c, s))
        ys = tnpu.npu_apply_rotary_pos_emb(*(x.clone(memory_format=torch.contiguous_format) for x in xs), c, s,
                                           layout="BSND")  # rotary_mode's default "half": the keyword is newer
    else:
        ys = []
        for x in xs:
            y = tnpu.npu_rotary_mul(x[..., :lay.E].contiguous(), c, s)  # rotary_mode's default: "half"
            ys.append(y if lay.E == lay.D else torch.cat((y, x[..., lay.E:]), dim=-1))
    return [y.to(dt) for y, dt in zip(ys, out_dtypes)]


def _from_bsnd(lay, y, target):
    """A BSND result back in the op's output shape (the BSND memory HF's layout and the golden have)."""
    y4 = y.reshape(lay.O, lay.I, -1, lay.D).permute(0, 2, 1, 3) if lay.I > 1 else y.reshape(lay.O, -1, 1, lay.D)
    return y4.reshape(target.shape)


def _npu_rope(backend, q, k, xq, xk, cos, sin, mrope_section, unsqueeze_dim, cast_mode):
    """xq, xk (q and k, or their norms) rotated on npu; outputs in q's and k's dtypes and layouts."""
    if mrope_section:
        cos, sin = merge_sections(cos, mrope_section), merge_sections(sin, mrope_section)
    lay = Layout(xq, xk, cos, sin, (), unsqueeze_dim)
    yq, yk = _npu_rotate(backend, lay, cast_mode, out_dtypes(q, k, cos, cast_mode))
    return like(q, _from_bsnd(lay, yq, q)), like(k, _from_bsnd(lay, yk, k))


@ROPE.impl("npu", supports=_npu_rope_supports)
def _(backend, q, k, cos, sin, mrope_section, unsqueeze_dim, cast_mode):
    return _npu_rope(backend, q, k, q, k, cos, sin, mrope_section, unsqueeze_dim, cast_mode)


def _npu_qk_supports(backend, q, k, qw, kw, cos, sin, mrope_section, q_eps, k_eps, unsqueeze_dim, cast_mode):
    return _npu_rope_supports(backend, q, k, cos, sin, mrope_section, unsqueeze_dim, cast_mode)


# No torch_npu op takes a per-head norm and the rotation together: npu_rms_norm (each head vector a row)
# then the rope mapping above; in fp32 mode the normalised values stay fp32 into the rotation.
@QK_NORM_ROPE.impl("npu", supports=_npu_qk_supports)
def _(backend, q, k, q_weight, k_weight, cos, sin, mrope_section, q_eps, k_eps, unsqueeze_dim, cast_mode):
    tnpu = backend.torch_npu()
    D = q.shape[-1]

    def norm(x, w, eps):
        if cast_mode == "fp32":
            y, _ = tnpu.npu_rms_norm(x.reshape(-1, D).float(), w.reshape(D).float(), epsilon=eps)
        else:  # HF: x * r rounded to x's dtype before the weight
            y, _ = tnpu.npu_rms_norm(x.reshape(-1, D), unit_gamma(D, x.dtype, x.device), epsilon=eps)
            y = w.reshape(D) * y
        return y.reshape(x.shape)

    qn, kn = norm(q, q_weight, q_eps), norm(k, k_weight, k_eps)
    return _npu_rope(backend, q, k, qn, kn, cos, sin, mrope_section, unsqueeze_dim, cast_mode)


# npu: torch_npu.npu_mrope(positions, query, key, cos_sin_cache, head_size, mrope_section=, rotary_mode="half")
# (aclnnRopeWithSinCosCache) is this op: positions (T,) or (3, T), query [T, Hq * head_size]; Atlas A2/A3 only.
# Its rounding is not documented as the query dtype's per product: 16-bit hf calls are declined as for rope.
# Its page's limits (torch_npu-npu_mrope.md, 约束说明): mrope_section one of four documented splits (or none);
# head_size and rotary_dim multiples of 16 in fp32 (32 in fp16/bf16): the call is made in fp32. Interleaved MRoPE
# (Qwen3-VL's) is its cache_mode="interleave" (op-plugin 26.0.0 and later; not with [16, 16, 16, 16]): its page's
# formula takes rows 1 and 2 at columns 1::3 and 2::3 up to 3 x mrope_section[1] both, vLLM's up to 3 x section[1]
# and 3 x section[2]: the same where the two sections are equal, as in every documented split, so only those map.
NPU_MROPE_SECTIONS = ([16, 24, 24], [24, 20, 20], [8, 12, 12], [16, 16, 16, 16])


def _npu_rotary_supports(backend, positions, query, key, cache, head_size, mrope_section, cast_mode,
                         mrope_interleaved):
    reason = angles_not_float(cache)
    if reason:
        return reason
    if backend.series_of(query) != "a2_a3":
        return "npu_mrope: Atlas A2/A3 only"
    if list(mrope_section) and list(mrope_section) not in NPU_MROPE_SECTIONS:
        return f"npu_mrope: mrope_section {list(mrope_section)} is not one of the documented {NPU_MROPE_SECTIONS}"
    if mrope_interleaved and len(mrope_section) != 3:
        return f"npu_mrope: cache_mode 'interleave' is documented for 3 sections, not {list(mrope_section)}"
    rotary_dim = cache.shape[-1]
    if head_size % 16 or rotary_dim % 16:
        return f"npu_mrope: head_size {head_size} and rotary_dim {rotary_dim} must be multiples of 16 (fp32)"
    if cast_mode == "hf" and query.dtype != torch.float32:
        return (f"hf mode on {dtype_name(query.dtype)}: npu_mrope's rounding is not vLLM's per-product rounding "
                f"(cast_mode='fp32' maps onto it)")
    return None


@ROTARY_EMBEDDING.impl("npu", supports=needs("npu_mrope")(_npu_rotary_supports))
def _(backend, positions, query, key, cos_sin_cache, head_size, mrope_section, cast_mode, mrope_interleaved):
    T = positions.shape[-1]
    q2, k2 = (x.reshape(T, -1).float() for x in (query, key))
    cache = converted_once(cos_sin_cache, "fp32", lambda c: c.float())  # once per cache and version, not per call
    newer = {"cache_mode": "interleave"} if mrope_interleaved else {}  # a keyword older releases lack
    yq, yk = backend.torch_npu().npu_mrope(positions.to(torch.int64), q2, k2, cache, head_size,
                                           mrope_section=list(mrope_section) or None, **newer)  # rotary_mode "half"
    return yq.to(query.dtype).reshape(query.shape), yk.to(key.dtype).reshape(key.shape)

