"""rope and qk_norm_rope (SPEC 10): the rotary embedding of q and k in one call, and Qwen3's per-head
q/k RMSNorm fused in front of it.

rope(q, k, cos, sin) = (q*cos + rotate_half(q)*sin, k*cos + rotate_half(k)*sin), the half-rotation
(NeoX) layout HF's Llama/Qwen families use, with:
- q and k of different head counts (GQA: 16 and 2 heads for GutenOCR-3B), any layout HF hands over:
  cos and sin get a singleton heads dim at `unsqueeze_dim` and broadcast ([B, H, S, D] text with
  [B, S, D] cos at unsqueeze_dim=1; [S, H, D] vision with [S, D] cos at unsqueeze_dim=-2);
- partial rotary: cos's last dim E may be less than D; the first E dims rotate, the rest pass through;
- MRoPE (transformers 4.57's `apply_multimodal_rotary_pos_emb`): with `mrope_section` (t, h, w) cos
  and sin are the un-merged (3, B, S, E) planes, and the section selection happens inside the op;
  transformers 5.x merges them once per forward and hands over the merged (B, S, E) form.
- cast modes: `hf` rounds as HF's text function does (each product and the sum in the promoted dtype
  of q and cos; also vLLM's `forward_native` and CUDA rotary, which round every product in the model dtype);
  `fp32` upcasts q, k, cos and sin, computes in fp32 and rounds once to q's and k's dtypes (HF's
  `apply_rotary_pos_emb_vision`, torch_npu's kernels, vLLM's C++ CPU rotary). The torch backend is
  bit-identical to the HF function of each form.

rotary_embedding(positions, query, key, cos_sin_cache, head_size, ...): the same rotation in vLLM's (and
torch_npu's `npu_mrope`) form: cos and sin read at each token's position from a [max_position, rot] cache
whose halves are cos and sin (MRoPE: section i of the half from the i-th row of [3, T] positions), query
and key as [T, heads * head_size]; `hf` rounds cos/sin to the query's dtype and every product there (vLLM's
`forward_native`), `fp32` computes in fp32 and rounds once (vLLM's C++ CPU op). It is what vLLM's RotaryEmbedding
(fp32) and MRotaryEmbedding (hf) run (vllm/providers.py), in place: its cpu kernel writes the rotated heads over the inputs
(`Op.call(..., into=)`), as vLLM's own CPU kernel does, without a gathered cos/sin table or new tensors.

qk_norm_rope(q, k, q_weight, k_weight, cos, sin, ...) = rope(rms_norm(q), rms_norm(k), cos, sin): the
norm over each head's D values with each its own gamma and eps, as Qwen3's q_norm/k_norm run before
the rotation; q and k are the un-normalised projections (any layout: the norm is per head vector, so
HF's transpose between norm and rope commutes with it). `hf` rounds the norm as HF's RMSNorm and the
rotation as HF's text function; `fp32` keeps the normalised values in fp32 into the rotation and
rounds once (vllm-ascend's fused qkv_rmsnorm_rope).
"""
import math

import torch

from ..args import FLOAT_DTYPES, ArgValueError, Bool, Choice, Float, Int, Ints, Output, Tensor
from ..op import Backward, Op
from .rms_norm import rms_norm

CAST_MODES = ("hf", "fp32")
MODES = {"hf": 0, "fp32": 1}  # the codes the cpu kernels take for a cast mode


def rotate_half(x):
    """HF's rotate_half: [x1, x2] -> [-x2, x1] over the last dim."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def merge_sections(planes, mrope_section):
    """4.57's MRoPE section merge: column chunk i (sections repeated for both halves) from plane i % 3."""
    chunks = planes.split(list(mrope_section) * 2, dim=-1)
    return torch.cat([m[i % 3] for i, m in enumerate(chunks)], dim=-1)


def _embed(x, cos, sin):
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return (x * cos) + (rotate_half(x) * sin)
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    return torch.cat(((x_rot * cos) + (rotate_half(x_rot) * sin), x_pass), dim=-1)


def rope(q, k, cos, sin, mrope_section=(), unsqueeze_dim=1, cast_mode="hf"):
    """(q_embed, k_embed) = (q*cos + rotate_half(q)*sin, k*cos + rotate_half(k)*sin), cos/sin unsqueezed at
    `unsqueeze_dim` (merged from their (3, ..., E) planes first when `mrope_section` is given); `hf` rounds
    as HF's text function, `fp32` as its vision function (fp32 throughout, one rounding)."""
    if mrope_section:
        cos, sin = merge_sections(cos, mrope_section), merge_sections(sin, mrope_section)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    if cast_mode == "fp32":
        cos, sin = cos.float(), sin.float()
        return like(q, _embed(q.float(), cos, sin).to(q.dtype)), like(k, _embed(k.float(), cos, sin).to(k.dtype))
    return like(q, _embed(q, cos, sin)), like(k, _embed(k, cos, sin))


def like(x, y):
    """y laid out as torch.empty_like(x): x's strides when x is dense (HF's [B, H, S, D] views of [B, S, H, D]
    projections), else contiguous. The layout every backend gives (so the custom op's fake kernel, this
    golden, tells torch.compile the truth); for HF's layouts it is the one HF's own functions return."""
    out = torch.empty_like(x, dtype=y.dtype)
    return out.copy_(y) if out.stride() != y.stride() else y


def qk_norm_rope(q, k, q_weight, k_weight, cos, sin, mrope_section=(), q_eps=1e-6, k_eps=1e-6, unsqueeze_dim=1,
                 cast_mode="hf"):
    """rope(rms_norm(q, q_weight, q_eps), rms_norm(k, k_weight, k_eps), cos, sin): Qwen3's per-head q/k norm
    and the rotation in one call; `hf` rounds each step as HF, `fp32` rounds once at the end."""
    if cast_mode == "fp32":
        qn, kn = _norm_f32(q, q_weight, q_eps), _norm_f32(k, k_weight, k_eps)
        qe, ke = rope(qn, kn, cos, sin, mrope_section, unsqueeze_dim=unsqueeze_dim, cast_mode="fp32")
        return like(q, qe.to(q.dtype)), like(k, ke.to(k.dtype))
    qe, ke = rope(rms_norm(q, q_weight, q_eps, "hf"), rms_norm(k, k_weight, k_eps, "hf"), cos, sin, mrope_section,
                  unsqueeze_dim=unsqueeze_dim, cast_mode="hf")
    return like(q, qe), like(k, ke)


def _norm_f32(x, gamma, eps):
    """The fp32 norm without its final rounding: the fused op keeps it in fp32 into the rotation."""
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * gamma.reshape(x.shape[-1]).float()


# ---- validation: the shapes HF's functions accept ----------------------------------------------------
def merged_shape(cos, mrope_section):
    return tuple(cos.shape[1:]) if mrope_section else tuple(cos.shape)


def check_layout(q, k, cos, mrope_section, unsqueeze_dim):
    """Refuse what HF's function would refuse or broadcast into another shape, naming the argument."""
    E = cos.shape[-1]
    if E % 2:
        raise ArgValueError("cos", f"rotary dim E={E} (shape {tuple(cos.shape)}); expected an even E")
    if E > q.shape[-1]:
        raise ArgValueError("cos", f"rotary dim E={E} exceeds the head dim D={q.shape[-1]} of q")
    if mrope_section:
        if cos.dim() < 2 or cos.shape[0] != 3:
            raise ArgValueError("cos", f"shape {tuple(cos.shape)}; with mrope_section expected the (3, ..., E) "
                                       f"t/h/w planes")
        if 2 * sum(mrope_section) != E:
            raise ArgValueError("mrope_section", f"{list(mrope_section)} sums to {sum(mrope_section)}; expected "
                                                 f"E/2 = {E // 2} (cos's last dim {E})", "value")
    merged = merged_shape(cos, mrope_section)
    n = len(merged) + 1
    if not -n <= unsqueeze_dim < n:
        raise ArgValueError("unsqueeze_dim", f"got {unsqueeze_dim}; expected a dim in [{-n}, {n - 1}] of cos's "
                                             f"{len(merged)}-d merged shape {merged}", "value")
    u = unsqueeze_dim % n
    cos_u = (*merged[:u], 1, *merged[u:-1])
    for name, x in (("q", q), ("k", k)):
        lead = tuple(x.shape[:-1])
        try:
            ok = torch.broadcast_shapes(lead, cos_u) == lead
        except RuntimeError:
            ok = False
        if not ok:
            raise ArgValueError(name, f"shape {tuple(x.shape)} does not broadcast with cos {tuple(cos.shape)} "
                                      f"unsqueezed at {unsqueeze_dim} (leading dims {cos_u})")


def _check_rope(ctx, q, k, cos, sin, mrope_section, unsqueeze_dim, cast_mode):
    check_layout(q, k, cos, mrope_section, unsqueeze_dim)


def _check_qk_norm_rope(ctx, q, k, qw, kw, cos, sin, mrope_section, q_eps, k_eps, unsqueeze_dim, cast_mode):
    check_layout(q, k, cos, mrope_section, unsqueeze_dim)


def _rope_grads(names):
    """Gradients by differentiating the golden (the rotation is linear in q and k, so this is exact and
    cheap): one formula for every form, MRoPE and partial rotary included, and cos/sin when they need it."""
    def grads(saved, out_grads):
        args = [saved[n] for n in names]
        leaves = [a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                  for a in args]
        with torch.enable_grad():
            outs = OPS_BY_GRAD[names].golden(*leaves)
        pairs = [(o, g) for o, g in zip(outs, out_grads) if g is not None]
        wrt = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
        by_leaf = dict(zip(map(id, wrt), got))
        return {n: by_leaf.get(id(t)) for n, t in zip(names, leaves)}
    return grads


ANGLE = "angle"
ROPE_NAMES = ("q", "k", "cos", "sin", "mrope_section", "unsqueeze_dim", "cast_mode")
QK_NAMES = ("q", "k", "q_weight", "k_weight", "cos", "sin", "mrope_section", "q_eps", "k_eps", "unsqueeze_dim",
            "cast_mode")
# q [B, H, S, D] as HF's text attention hands it over, k with fewer heads; vision [S, H, D] with fp32 cos;
# MRoPE planes; partial rotary; decode
ROPE_EXAMPLES = ({"Q": (1, 4, 5), "K": (1, 2, 5), "C": (1, 5), "D": 64, "E": 64},
                 {"Q": (7, 4), "K": (7, 4), "C": (7,), "D": 80, "E": 80, "unsqueeze_dim": -2, "cast_mode": "fp32",
                  "cos_dtype": torch.float32},
                 {"Q": (1, 4, 6), "K": (1, 2, 6), "C": (3, 1, 6), "D": 32, "E": 32, "mrope_section": [4, 6, 6]},
                 {"Q": (2, 3, 1), "K": (2, 1, 1), "C": (2, 1), "D": 48, "E": 32, "dtype": torch.float16},
                 {"Q": (1, 2, 3), "K": (1, 2, 3), "C": (1, 3), "D": 16, "E": 16, "dtype": torch.float32})

ROPE = Op(rope, [
    Tensor("q", "*Q D", FLOAT_DTYPES, case="query"),
    Tensor("k", "*K D", None, like="q", case="key"),
    Tensor("cos", "*C E", floats=True, gen=ANGLE),
    Tensor("sin", "*C E", None, like="cos", gen=ANGLE),
    Ints("mrope_section", default=()),
    Int("unsqueeze_dim", default=1, low=-8, high=8, kw_only=True),
    Choice("cast_mode", CAST_MODES, default="hf", kw_only=True),
], [Output("q_embed", "rotation"), Output("k_embed", "rotation")], check=_check_rope, min_dims={"D": 2, "E": 2},
    backward=Backward(ROPE_NAMES, _rope_grads(ROPE_NAMES)), examples=ROPE_EXAMPLES)

QK_NORM_ROPE = Op(qk_norm_rope, [
    Tensor("q", "*Q D", FLOAT_DTYPES, case="query"),
    Tensor("k", "*K D", None, like="q", case="key"),
    Tensor("q_weight", "D", None, like="q", flat=True, gen="weight"),
    Tensor("k_weight", "D", None, like="q", flat=True, gen="weight"),
    Tensor("cos", "*C E", floats=True, gen=ANGLE),
    Tensor("sin", "*C E", None, like="cos", gen=ANGLE),
    Ints("mrope_section", default=()),
    Float("q_eps", default=1e-6, low=0.0),
    Float("k_eps", default=1e-6, low=0.0),
    Int("unsqueeze_dim", default=1, low=-8, high=8, kw_only=True),
    Choice("cast_mode", CAST_MODES, default="hf", kw_only=True),
], [Output("q_embed", "rotation"), Output("k_embed", "rotation")], check=_check_qk_norm_rope, min_dims={"D": 2, "E": 2},
    backward=Backward(QK_NAMES, _rope_grads(QK_NAMES)),
    examples=({"Q": (1, 4, 5), "K": (1, 2, 5), "C": (1, 5), "D": 64, "E": 64},
              {"Q": (1, 4, 3), "K": (1, 2, 3), "C": (1, 3), "D": 128, "E": 128, "cast_mode": "fp32"},
              {"Q": (1, 2, 1), "K": (1, 1, 1), "C": (1, 1), "D": 40, "E": 40, "dtype": torch.float16},
              {"Q": (1, 2, 4), "K": (1, 2, 4), "C": (1, 4), "D": 16, "E": 16, "dtype": torch.float32}))
OPS_BY_GRAD = {ROPE_NAMES: ROPE, QK_NAMES: QK_NORM_ROPE}


# ---- rotary_embedding: vLLM's form, cos/sin read from a position-indexed cache -----------------------------
def rotary_embedding(positions, query, key, cos_sin_cache, head_size, mrope_section=(), cast_mode="hf",
                     mrope_interleaved=False):
    """vLLM's neox rotary embedding: cos, sin = cos_sin_cache[positions].chunk(2) (MRoPE: section i of them from
    positions[i]; interleaved MRoPE, Qwen3-VL's: column j from row 1 or 2 where j % 3 is 1 or 2 within 3 x its
    section, row 0 elsewhere); each head's first rot = cos_sin_cache.shape[-1] dims rotated, (x1*cos - x2*sin,
    x2*cos + x1*sin), the rest passed through; `hf` in the query's dtype (cos and sin rounded to it first), `fp32` in
    fp32 with one rounding. Outputs shaped like query and key."""
    T = positions.shape[-1]
    cos, sin = cached_angles(positions, cos_sin_cache, mrope_section, mrope_interleaved)
    rot = 2 * cos.shape[-1]

    def one(x):
        x3 = x.reshape(T, -1, head_size)
        compute = torch.float32 if cast_mode == "fp32" else x.dtype
        c, s = cos.unsqueeze(-2).to(compute), sin.unsqueeze(-2).to(compute)
        x1, x2 = x3[..., :rot].to(compute).chunk(2, dim=-1)
        y = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
        return torch.cat((y, x3[..., rot:]), dim=-1).reshape(x.shape)
    return one(query), one(key)


def cached_angles(positions, cos_sin_cache, mrope_section, interleaved=False):
    """(cos, sin) halves [T, rot/2] at each token's position: vLLM's `cos_sin_cache[positions].chunk(2)`, MRoPE's
    section i taken from positions row i, or interleaved as vLLM's `apply_interleaved_rope` does (column j from row
    1 where j % 3 == 1 and j < 3 * section[1], from row 2 where j % 3 == 2 and j < 3 * section[2], else row 0)."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    if mrope_section and interleaved:
        planes = mrope_planes(mrope_section, cos.shape[-1], True, cos.device)
        cos, sin = (t.gather(0, planes.expand(1, t.shape[1], -1)).squeeze(0) for t in (cos, sin))
    elif mrope_section:
        cos, sin = (torch.cat([m[i] for i, m in enumerate(t.split(list(mrope_section), dim=-1))], dim=-1)
                    for t in (cos, sin))
    return cos, sin


def mrope_planes(mrope_section, half: int, interleaved: bool, device=None) -> torch.Tensor:
    """[1, 1, half] int64: the positions row (plane) each column of the angles' half reads."""
    j = torch.arange(half, device=device)
    if interleaved:
        s1, s2 = mrope_section[1], mrope_section[2]
        plane = torch.where((j % 3 == 1) & (j < 3 * s1), 1, torch.where((j % 3 == 2) & (j < 3 * s2), 2, 0))
    else:
        plane = torch.repeat_interleave(torch.arange(len(mrope_section), device=device),
                                        torch.tensor(list(mrope_section), device=device))
    return plane.reshape(1, 1, half)


def _check_rotary_embedding(ctx, positions, query, key, cache, head_size, mrope_section, cast_mode,
                            mrope_interleaved):
    E = cache.shape[-1]
    if E % 2 or E > head_size:
        raise ArgValueError("cos_sin_cache", f"rotary dim {E} (shape {tuple(cache.shape)}); expected an even dim "
                                             f"<= head_size {head_size}")
    for name, x in (("query", query), ("key", key)):
        per_token = math.prod(x.shape[1:])
        if per_token % head_size:
            raise ArgValueError(name, f"shape {tuple(x.shape)}: {per_token} values per token are not whole heads "
                                      f"of head_size {head_size}")
    if positions.dim() == 2:
        if positions.shape[0] != 3 or not mrope_section:
            raise ArgValueError("positions", f"shape {tuple(positions.shape)}; expected (T,), or (3, T) with "
                                             f"mrope_section")
        if 2 * sum(mrope_section) != E or len(mrope_section) != 3:
            raise ArgValueError("mrope_section", f"{list(mrope_section)}; expected 3 sections summing to rot/2 = "
                                                 f"{E // 2}", "value")
    elif mrope_section:
        raise ArgValueError("mrope_section", f"{list(mrope_section)} with 1-d positions; expected () (sections "
                                             f"need (3, T) positions)", "value")
    if mrope_interleaved and not mrope_section:
        raise ArgValueError("mrope_interleaved", "True without mrope_section; expected sections to interleave",
                            "value")
    if positions.device.type == "cpu" and positions.numel():
        low, high = int(positions.min()), int(positions.max())
        if low < 0 or high >= cache.shape[0]:
            raise ArgValueError("positions", f"values {low}..{high}; expected rows of cos_sin_cache, 0.."
                                             f"{cache.shape[0] - 1}", "value")


def _positions(shape, gen):
    """Token positions of a case: below 16, which every cache the examples and vLLM use has rows for."""
    return torch.randint(0, 16, tuple(shape), generator=gen).float()


ROTARY_EXAMPLES = ({"P": (), "T": 5, "Q": (4 * 64,), "K": (2 * 64,), "M": 32, "E": 64, "head_size": 64},
                   {"P": (), "T": 3, "Q": (2 * 64,), "K": (64,), "M": 16, "E": 32, "head_size": 64,
                    "dtype": torch.float16},
                   {"P": (3,), "T": 6, "Q": (4 * 32,), "K": (2 * 32,), "M": 24, "E": 32, "head_size": 32,
                    "mrope_section": [4, 6, 6]},
                   {"P": (), "T": 4, "Q": (2 * 80,), "K": (2 * 80,), "M": 16, "E": 80, "head_size": 80,
                    "cast_mode": "fp32"},
                   {"P": (), "T": 2, "Q": (3, 16), "K": (1, 16), "M": 16, "E": 16, "head_size": 16,
                    "dtype": torch.float32, "cos_sin_cache_dtype": torch.float32},
                   {"P": (3,), "T": 7, "Q": (4 * 64,), "K": (2 * 64,), "M": 24, "E": 64, "head_size": 64,
                    "mrope_section": [12, 10, 10], "mrope_interleaved": True},
                   {"P": (3,), "T": 3, "Q": (2 * 32,), "K": (32,), "M": 16, "E": 32, "head_size": 32,
                    "mrope_section": [6, 5, 5], "mrope_interleaved": True, "cast_mode": "fp32"})


ROTARY_EMBEDDING = Op(rotary_embedding, [
    Tensor("positions", "*P T", (torch.int64, torch.int32), gen=_positions),
    Tensor("query", "T *Q", FLOAT_DTYPES),
    Tensor("key", "T *K", None, like="query"),
    Tensor("cos_sin_cache", "M E", floats=True, gen=ANGLE),
    Int("head_size", low=2, high=1 << 16),
    Ints("mrope_section", default=()),
    Choice("cast_mode", CAST_MODES, default="hf", kw_only=True),
    Bool("mrope_interleaved", default=False, kw_only=True),
], [Output("query_out", "rotation"), Output("key_out", "rotation")], check=_check_rotary_embedding,
    examples=ROTARY_EXAMPLES)

