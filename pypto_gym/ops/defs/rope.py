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

from ..args import FLOAT_DTYPES, ArgValueError, Choice, Float, Int, Ints, Output, Tensor, dtype_name
from ..backends.pypto_backend import UB_BYTES, Tiles
from ..op import Backward, BenchSpec, Op
from .rms_norm import hf_norm_kernels, rms_norm

CAST_MODES = ("hf", "fp32")
MODES = {"hf": 0, "fp32": 1}


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
def _merged_shape(cos, mrope_section):
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
    merged = _merged_shape(cos, mrope_section)
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

# ---- bench ops: GutenOCR-3B's attentions, as HF hands them over ------------------------------------------
def hf_text_layout(S, heads, kv_heads, D, dtype, gen):
    """q, k as HF's text attention makes them: [B, H, S, D] views of the [B, S, H, D] projections."""
    q = torch.randn(1, S, heads, D, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(1, S, kv_heads, D, generator=gen).to(dtype).transpose(1, 2)
    angles = torch.rand(1, S, D // 2, generator=gen) * 100
    emb = torch.cat((angles, angles), dim=-1)
    return q, k, emb.cos().to(dtype), emb.sin().to(dtype)


def _bench_shapes(quick, dtype):
    """Text q [1, 16, S, 128] with k [1, 2, S, 128] (S = 1, 512, 4096) and the vision tower's [3744, 16, 80]
    views of one qkv projection with fp32 cos/sin."""
    gen = torch.Generator().manual_seed(0)
    out = [("decode" if S == 1 else "prefill", S, (*hf_text_layout(S, 16, 2, 128, dtype, gen), [], 1, "hf"))
           for S in ([1, 512] if quick else [1, 512, 4096])]
    S = 3744
    q, k, _ = torch.randn(S, 3 * 16 * 80, generator=gen).to(dtype).reshape(S, 3, 16, 80).permute(1, 0, 2, 3).unbind(0)
    angles = torch.rand(S, 40, generator=gen) * 100
    emb = torch.cat((angles, angles), dim=-1)
    out.append(("vision", S, (q, k, emb.cos(), emb.sin(), [], -2, "fp32")))
    return out


def _hf_rope(args):
    """HF's text function (Llama's: the one Qwen2/2.5-VL 5.x and Qwen3 share), or its vision function."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision

    q, k, cos, sin, _, unsqueeze_dim, _ = args
    if unsqueeze_dim == -2:
        return lambda: apply_rotary_pos_emb_vision(q, k, cos, sin)
    return lambda: apply_rotary_pos_emb(q, k, cos, sin)


ROPE_GOALS = {"decode_vs_hf": 3.0, "vs_compile": 1.5, "min_tokens": 512}


def _hf_rotate_kernels(x3, cos3, dtype, name):
    """x * cos + rotate_half(x) * sin for one of q, k as [T, H, D]: mul, neg, cat, mul, add."""
    T, H, D = x3.shape
    return [(f"{name} * cos", "mul", [x3, cos3], (T, H, D), dtype, ()),
            (f"-{name}2", "neg", [x3[..., D // 2:]], (T, H, D // 2), dtype, ()),
            (f"cat(-{name}2, {name}1)", "cat", [x3], (T, H, D), dtype, ()),
            (f"rotate_half({name}) * sin", "mul", [x3, cos3], (T, H, D), dtype, ()),
            (f"{name}_embed = sum", "add", [x3, x3], (T, H, D), dtype, ())]


def _hf_kernels(args, norms=()):
    """HF's rotary functions kernel by kernel: 4.57's MRoPE section merge (a cat each for cos and sin), the vision
    function's casts to fp32 and back, and the five kernels per tensor of the rotation."""
    q, k, cos, sin, section, unsqueeze_dim, cast_mode = args
    merges = []
    if section:
        merged = merge_sections(cos, section)
        rows_ = merged.numel() // merged.shape[-1]
        merges = [(f"cat {n} sections", "cat", [torch.zeros(rows_, 1, merged.shape[-1])], (rows_, 1, merged.shape[-1]),
                   cos.dtype, ()) for n in ("cos", "sin")]
        cos = sin = merged
    lay = Layout(q, k, cos, sin, (), unsqueeze_dim)
    T = lay.O * lay.I
    dtype = torch.float32 if cast_mode == "fp32" else torch.promote_types(q.dtype, cos.dtype)
    q3, k3 = torch.zeros(T, lay.Hq, lay.D, dtype=dtype), torch.zeros(T, lay.Hk, lay.D, dtype=dtype)
    cos3 = torch.zeros(T, 1, lay.D, dtype=dtype)
    casts = back = []
    if cast_mode == "fp32" and q.dtype != torch.float32:
        casts = [("q.float()", "cast", [q3.to(q.dtype)], q3.shape, torch.float32, ()),
                 ("k.float()", "cast", [k3.to(k.dtype)], k3.shape, torch.float32, ())]
        back = [("q_embed.to(dtype)", "cast", [q3], q3.shape, q.dtype, ()),
                ("k_embed.to(dtype)", "cast", [k3], k3.shape, k.dtype, ())]
    return [*norms, *merges, *casts, *_hf_rotate_kernels(q3, cos3, dtype, "q"), *_hf_rotate_kernels(k3, cos3, dtype, "k"),
            *back]


def _hf_qk_kernels(args):
    q, k, qw, kw, cos, sin, section, _, _, unsqueeze_dim, cast_mode = args
    norms = hf_norm_kernels(q, qw, "q_norm: ") + hf_norm_kernels(k, kw, "k_norm: ")
    return _hf_kernels((q, k, cos, sin, section, unsqueeze_dim, cast_mode), norms)

ROPE = Op(rope, [
    Tensor("q", "*Q D", FLOAT_DTYPES, case="query"),
    Tensor("k", "*K D", None, like="q", case="key"),
    Tensor("cos", "*C E", floats=True, gen=ANGLE),
    Tensor("sin", "*C E", None, like="cos", gen=ANGLE),
    Ints("mrope_section", default=()),
    Int("unsqueeze_dim", default=1, low=-8, high=8, kw_only=True),
    Choice("cast_mode", CAST_MODES, default="hf", kw_only=True),
], [Output("q_embed", "rotation"), Output("k_embed", "rotation")], check=_check_rope, min_dims={"D": 2, "E": 2},
    backward=Backward(ROPE_NAMES, _rope_grads(ROPE_NAMES)), examples=ROPE_EXAMPLES,
    bench=BenchSpec(_bench_shapes, _hf_rope, lambda a: (lambda: (a[0].clone(), a[1].clone())), "clone() of q and k",
                    ROPE_GOALS, hf_kernels=_hf_kernels))

def _qk_bench_shapes(quick, dtype):
    """Qwen3-8B's attention: q [1, 32, S, 128], k [1, 8, S, 128], before their norms."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for S in ([1, 512] if quick else [1, 512, 4096]):
        q, k, cos, sin = hf_text_layout(S, 32, 8, 128, dtype, gen)
        weights = [(1 + 0.1 * torch.randn(128, generator=gen)).to(dtype) for _ in range(2)]
        out.append(("decode" if S == 1 else "prefill", S, (q, k, *weights, cos, sin, [], 1e-6, 1e-6, 1, "hf")))
    return out


def _hf_qk_norm_rope(args):
    """Qwen3's attention: its q_norm and k_norm modules, then the text function."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    q, k, qw, kw, cos, sin, _, q_eps, k_eps = args[:9]
    norms = []
    for w, eps in ((qw, q_eps), (kw, k_eps)):
        m = Qwen3RMSNorm(w.shape[0], eps=eps).to(w.dtype)
        m.weight.data = w
        norms.append(m)
    return lambda: apply_rotary_pos_emb(norms[0](q), norms[1](k), cos, sin)


def _unfused_qk_norm_rope(args, backend):
    """The two norms and the rotation as three calls of their own kernels."""
    q, k, qw, kw, cos, sin, sec, q_eps, k_eps, u, cast_mode = args
    norm = Op.registry["rms_norm"]

    def run():
        qn = norm.call((q, qw, q_eps, cast_mode), backend, None)
        kn = norm.call((k, kw, k_eps, cast_mode), backend, None)
        return ROPE.call((qn, kn, cos, sin, sec, u, cast_mode), backend, None)
    return run


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
              {"Q": (1, 2, 4), "K": (1, 2, 4), "C": (1, 4), "D": 16, "E": 16, "dtype": torch.float32}),
    bench=BenchSpec(_qk_bench_shapes, _hf_qk_norm_rope, lambda a: (lambda: (a[0].clone(), a[1].clone())),
                    "clone() of q and k", {"decode_vs_hf": 3.0, "vs_hf": 2.0}, unfused=_unfused_qk_norm_rope,
                    hf_kernels=_hf_qk_kernels))
OPS_BY_GRAD = {ROPE_NAMES: ROPE, QK_NAMES: QK_NORM_ROPE}


# ---- rotary_embedding: vLLM's form, cos/sin read from a position-indexed cache -----------------------------
def rotary_embedding(positions, query, key, cos_sin_cache, head_size, mrope_section=(), cast_mode="hf"):
    """vLLM's neox rotary embedding: cos, sin = cos_sin_cache[positions].chunk(2) (MRoPE: section i of them from
    positions[i]); each head's first rot = cos_sin_cache.shape[-1] dims rotated, (x1*cos - x2*sin, x2*cos +
    x1*sin), the rest passed through; `hf` in the query's dtype (cos and sin rounded to it first), `fp32` in fp32
    with one rounding. Outputs shaped like query and key."""
    T = positions.shape[-1]
    cos, sin = cached_angles(positions, cos_sin_cache, mrope_section)
    rot = 2 * cos.shape[-1]

    def one(x):
        x3 = x.reshape(T, -1, head_size)
        compute = torch.float32 if cast_mode == "fp32" else x.dtype
        c, s = cos.unsqueeze(-2).to(compute), sin.unsqueeze(-2).to(compute)
        x1, x2 = x3[..., :rot].to(compute).chunk(2, dim=-1)
        y = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
        return torch.cat((y, x3[..., rot:]), dim=-1).reshape(x.shape)
    return one(query), one(key)


def cached_angles(positions, cos_sin_cache, mrope_section):
    """(cos, sin) halves [T, rot/2] at each token's position: vLLM's `cos_sin_cache[positions].chunk(2)`, MRoPE's
    section i taken from positions row i."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    if mrope_section:
        cos, sin = (torch.cat([m[i] for i, m in enumerate(t.split(list(mrope_section), dim=-1))], dim=-1)
                    for t in (cos, sin))
    return cos, sin


def _check_rotary_embedding(ctx, positions, query, key, cache, head_size, mrope_section, cast_mode):
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
                    "dtype": torch.float32, "cos_sin_cache_dtype": torch.float32})


ROTARY_EMBEDDING = Op(rotary_embedding, [
    Tensor("positions", "*P T", (torch.int64, torch.int32), gen=_positions),
    Tensor("query", "T *Q", FLOAT_DTYPES),
    Tensor("key", "T *K", None, like="query"),
    Tensor("cos_sin_cache", "M E", floats=True, gen=ANGLE),
    Int("head_size", low=2, high=1 << 16),
    Ints("mrope_section", default=()),
    Choice("cast_mode", CAST_MODES, default="hf", kw_only=True),
], [Output("query_out", "rotation"), Output("key_out", "rotation")], check=_check_rotary_embedding,
    examples=ROTARY_EXAMPLES)


# ---- the canonical layout every kernel sees --------------------------------------------------------------
def _as4(x, n, u):
    """(x as [O, H, I, D], whether that is a view): O the dims before the heads dim, I those between it and D."""
    a = u + x.dim() - n
    shape = (math.prod(x.shape[:a]), x.shape[a], math.prod(x.shape[a + 1:-1]), x.shape[-1])
    try:
        return x.view(shape), True
    except RuntimeError:
        return x.reshape(shape), False


class Layout:
    """One call in the layout every kernel reads: q and k as [O, H, I, D] (views for every layout HF hands
    over) and cos/sin as [P, Oc, I, E], P = 3 MRoPE planes or 1, Oc = O, or 1 when cos is shared across
    the leading dims (batch 1, or HF's vision [S, D]). What no kernel reads directly is copied into that
    layout (`copied` says so): a q or k no view reaches, a cos shared over some leading dims only."""

    def __init__(self, q, k, cos, sin, mrope_section, unsqueeze_dim):
        merged = _merged_shape(cos, mrope_section)
        n = len(merged) + 1
        u = unsqueeze_dim % n
        self.n, self.u = n, u
        self.P = 3 if mrope_section else 1
        (self.q, q_view), (self.k, k_view) = _as4(q, n, u), _as4(k, n, u)
        self.copied = not (q_view and k_view)
        self.O, self.Hq, self.I, self.D = self.q.shape
        self.Hk = self.k.shape[1]
        a = u + q.dim() - n  # q's heads dim
        outer, inner = tuple(merged[:u]), tuple(merged[u:-1])
        q_outer, q_inner = tuple(q.shape[:a]), tuple(q.shape[a + 1:-1])
        self.E = E = cos.shape[-1]
        if inner == q_inner and math.prod(outer) == 1:
            self.Oc = 1
        elif inner == q_inner and outer == q_outer:
            self.Oc = self.O
        else:
            self.Oc, self.copied = self.O, True
            full = (self.P, *q_outer, *q_inner, E)
            cos, sin = (t.reshape(self.P, *[1] * (a - u), *merged).expand(full).contiguous() for t in (cos, sin))
        self.cos = cos.reshape(self.P, self.Oc, self.I, E)
        self.sin = sin.reshape(self.P, self.Oc, self.I, E)
        self._pending = []

    def targets(self, oq, ok):
        """[O, H, I, D] views of the outputs for a kernel to write (an output no view reaches gets a stand-in,
        copied back by `finish`)."""
        views = []
        for t in (oq, ok):
            view, ok_ = _as4(t, self.n, self.u)
            if not ok_:
                view = torch.empty(view.shape, dtype=t.dtype, device=t.device)
                self._pending.append((t, view))
            views.append(view)
        return views

    def finish(self) -> None:
        for t, v in self._pending:
            t.copy_(v.reshape(t.shape))

    def geometry(self, oq4, ok4) -> torch.Tensor:
        """The integers the C++ kernels read the layout from (rope.cpp's Geometry)."""
        g = [self.O, self.I, self.D, self.E, self.P, self.Oc]
        for t in (self.q, self.k, oq4, ok4):
            g += [t.shape[1], t.stride(0), t.stride(1), t.stride(2)]
        for t in (self.cos, self.sin):
            g += [t.stride(0), t.stride(1), t.stride(2)]
        return torch.tensor(g, dtype=torch.int64)


def out_dtypes(q, k, cos, cast_mode):
    """The outputs' dtypes: HF's promotion of q (k) and cos in hf mode, q's (k's) own in fp32 mode."""
    if cast_mode == "fp32":
        return q.dtype, k.dtype
    return torch.promote_types(q.dtype, cos.dtype), torch.promote_types(k.dtype, cos.dtype)


_plans: dict = {}  # kind of call -> (output dtypes, the kernels' geometry or None where the layout needs copies)


def pairwise(q, k, cos, cast_mode, run):
    """`run(q, k, which)` -> (q_embed, k_embed) for a kernel that takes q and k together and rotates nothing when
    either is empty: with one of them empty, the other is rotated alone (passed as both; `which` says whose weights
    and eps go with it) and the empty output made, as the golden gives both."""
    if q.numel() and k.numel():
        return run(q, k, "qk")
    oq, ok = _outputs(q, k, cos, cast_mode)
    if q.numel():
        oq = run(q, q, "qq")[0]
    elif k.numel():
        ok = run(k, k, "kk")[1]
    return oq, ok


def _cpu_call(entry, q, k, cos, sin, mrope_section, unsqueeze_dim, cast_mode, *extra):
    """Run a C++ rope kernel: outputs made like q and k (rope.like) by the kernel, the layout read from the
    per-signature plan, the tensors where they are; a layout that needs copies goes through a Layout. The kernels
    step along D by one element: an input whose last dim is strided (q[..., ::2], a cos expanded along D) is
    copied first, and the outputs laid out as the golden's (like q and k)."""
    if any(t.stride(-1) != 1 and t.shape[-1] > 1 for t in (q, k, cos, sin)):
        oq, ok = _cpu_call(entry, *(t.contiguous() if t.stride(-1) != 1 else t for t in (q, k, cos, sin)),
                           mrope_section, unsqueeze_dim, cast_mode, *extra)
        return like(q, oq), like(k, ok)
    key = (q.shape, q.stride(), k.shape, k.stride(), cos.shape, cos.stride(), sin.stride(), q.dtype, cos.dtype,
           tuple(mrope_section), unsqueeze_dim, cast_mode)
    plan = _plans.get(key)
    if plan is None:
        dq, dk = out_dtypes(q, k, cos, cast_mode)
        meta = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for t in (q, k, cos, sin)]
        lay = Layout(*meta, mrope_section, unsqueeze_dim)
        targets = lay.targets(torch.empty_like(meta[0], dtype=dq), torch.empty_like(meta[1], dtype=dk))
        if len(_plans) > 256:
            _plans.clear()
        plan = _plans[key] = (dq, dk, None if lay.copied or lay._pending else lay.geometry(*targets))
    dq, dk, geometry = plan
    sections, mode = list(mrope_section), MODES[cast_mode]
    if geometry is not None:
        return entry(q, k, cos, sin, geometry, sections, mode, dq, dk, *extra, None, None)
    oq, ok = torch.empty_like(q, dtype=dq), torch.empty_like(k, dtype=dk)
    lay = Layout(q, k, cos, sin, mrope_section, unsqueeze_dim)
    oq4, ok4 = lay.targets(oq, ok)
    entry(lay.q, lay.k, lay.cos, lay.sin, lay.geometry(oq4, ok4), sections, mode, dq, dk, *extra, oq4, ok4)
    lay.finish()
    return oq, ok


def _angles_supported(cos):
    """The kernels read cos/sin as fp16, bf16 or fp32 (HF accepts any float: fp64 runs on torch)."""
    return None if cos.dtype in FLOAT_DTYPES else f"cos dtype {dtype_name(cos.dtype)} not supported"


def _outputs(q, k, cos, cast_mode):
    dq, dk = out_dtypes(q, k, cos, cast_mode)
    return torch.empty_like(q, dtype=dq), torch.empty_like(k, dtype=dk)


# ---- cpu: fused C++ (rope.cpp) ---------------------------------------------------------------------------
@ROPE.impl("cpu", supports=lambda backend, q, k, cos, *rest: _angles_supported(cos))
def _(backend, q, k, cos, sin, mrope_section, unsqueeze_dim, cast_mode):
    return pairwise(q, k, cos, cast_mode, lambda a, b, _: _cpu_call(backend.ext.rope, a, b, cos, sin, mrope_section,
                                                                    unsqueeze_dim, cast_mode))


def norm_args(which, q_weight, k_weight, q_eps, k_eps):
    """The (q, k) weights and eps of `pairwise`'s call: q's twice when q is rotated alone, k's twice for k."""
    pick = {"q": (q_weight, q_eps), "k": (k_weight, k_eps)}
    (wa, ea), (wb, eb) = pick[which[0]], pick[which[1]]
    return wa, wb, ea, eb


@QK_NORM_ROPE.impl("cpu", supports=lambda backend, q, k, qw, kw, cos, *rest: _angles_supported(cos))
def _(backend, q, k, q_weight, k_weight, cos, sin, mrope_section, q_eps, k_eps, unsqueeze_dim, cast_mode):
    D = q.shape[-1]
    qw, kw = q_weight.reshape(D).contiguous(), k_weight.reshape(D).contiguous()

    def run(a, b, which):
        wa, wb, ea, eb = norm_args(which, qw, kw, float(q_eps), float(k_eps))
        return _cpu_call(backend.ext.qk_norm_rope, a, b, cos, sin, mrope_section, unsqueeze_dim, cast_mode, wa, wb,
                         ea, eb)
    return pairwise(q, k, cos, cast_mode, run)


# ---- npu: torch_npu.npu_apply_rotary_pos_emb / npu_rotary_mul ---------------------------------------------
# Both compute x*cos + rotate_half(x)*sin ("half" mode) in one kernel and round once: our fp32 mode, with
# q, k, cos and sin cast to fp32 first (hf mode with fp32 inputs or an fp32 cos is the same math). hf mode
# on fp16/bf16 is not mapped: HF rounds both products before the sum, and where they nearly cancel one
# rounding differs from that by far more than an ulp of the result (SPEC 5 fails), so it runs elsewhere. The layout is BSND (B = O, S = I, N = heads), or [1, O, H, D] when there
# is no S dim (vision [S, H, D]): documented BNSD limits (B*N <= 8*S) rule BNSD out at decode and in vision.
# - npu_apply_rotary_pos_emb(query, key, cos, sin, layout="BSND", rotary_mode="half") rotates q and k in
#   one launch, in place (on copies here, so the op stays out-of-place); B and S of cos must equal q's;
#   used as vllm-ascend does, for full rotary with head_dim 128 or 64.
# - npu_rotary_mul(x, r1, r2, rotary_mode="half") otherwise, once for q and once for k: 4-D, cos/sin as
#   1S1D or BS1D, D < 896 and even, B and N < 1000 (Atlas A2/A3, jit_compile=False); older series: D = 128.
#   head_dim 80 (the vision tower) only fits this one. Partial rotary: the rotated part, then a cat.
# npu_mrope is not used: it gathers cos/sin from a position-indexed cache inside the kernel, whereas HF
# hands the attention cos/sin already computed; MRoPE's section merge runs first (two cats, as 5.x does).
NPU_LIMIT = 1000


def _npu_rope_layout(lay):
    """(x -> BSND view, cos/sin shape) for the canonical layout."""
    if lay.I == 1:
        return (lambda x4: x4.reshape(1, lay.O, x4.shape[1], x4.shape[3])), (1, lay.Oc, 1, lay.E)
    return (lambda x4: x4.permute(0, 2, 1, 3)), (lay.Oc, lay.I, 1, lay.E)


def _npu_rope_supports(backend, q, k, cos, sin, mrope_section, unsqueeze_dim, cast_mode):
    E = cos.shape[-1]
    reason = _angles_supported(cos)
    if reason:
        return reason
    if cast_mode == "hf" and torch.promote_types(q.dtype, cos.dtype) != torch.float32:
        return (f"hf mode on {dtype_name(q.dtype)}: torch_npu's rope kernels round once, HF rounds each product "
                f"(cast_mode='fp32' maps onto them)")
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
            y, _ = tnpu.npu_rms_norm(x.reshape(-1, D), torch.ones(D, dtype=x.dtype, device=x.device), epsilon=eps)
            y = w.reshape(D) * y
        return y.reshape(x.shape)

    qn, kn = norm(q, q_weight, q_eps), norm(k, k_weight, k_eps)
    return _npu_rope(backend, q, k, qn, kn, cos, sin, mrope_section, unsqueeze_dim, cast_mode)


# ---- pypto: tokens x heads x D tiles --------------------------------------------------------------------
# q and k as [T, H, D] (T = O*I tokens, BSND memory: a view for HF's layouts), cos/sin as [T, 1, E] per MRoPE
# plane; the kernel merges the sections with views and a concat, and rotates with views, neg and concat.
# A tile spans all heads of a token (PyPTO 0.2.0's compiled program disagrees with its own tensor graph
# when a tile cuts the heads dim of these view/concat chains), and as many tokens as fit the UB.
LIVE_FP32 = 6  # x, its rotation, two products, the sum, the pass-through concat


def rope_tiles(T: int, H: int, D: int) -> Tiles:
    cols = -(-D // 16) * 16
    per_token = LIVE_FP32 * H * cols * 4
    rows = 1
    while rows * 2 * per_token <= UB_BYTES and rows < 8 and rows < T:
        rows *= 2
    return Tiles(rows, cols, heads=H)


def rope_kernel(pypto):
    from ..backends import pypto_lib as pl

    def rope(q: pypto.Tensor(), k: pypto.Tensor(), c0: pypto.Tensor(), c1: pypto.Tensor(), c2: pypto.Tensor(),
             s0: pypto.Tensor(), s1: pypto.Tensor(), s2: pypto.Tensor(), oq: pypto.Tensor(), ok: pypto.Tensor(),
             hf, sec_t, sec_h, sec_w, rows, heads, cols):
        pypto.set_vec_tile_shapes(rows, heads, cols)
        cos = pl.merged_angles([c0, c1, c2], sec_t, sec_h, sec_w)
        sin = pl.merged_angles([s0, s1, s2], sec_t, sec_h, sec_w)
        yq = pl.rotate(pl.f32(q), cos, sin, oq.dtype, hf)
        yk = pl.rotate(pl.f32(k), cos, sin, ok.dtype, hf)
        oq[:] = yq
        ok[:] = yk
    return rope


def qk_norm_rope_kernel(pypto):
    from ..backends import pypto_lib as pl

    def qk_norm_rope(q: pypto.Tensor(), k: pypto.Tensor(), gq: pypto.Tensor(), gk: pypto.Tensor(),
                     c0: pypto.Tensor(), c1: pypto.Tensor(), c2: pypto.Tensor(), s0: pypto.Tensor(),
                     s1: pypto.Tensor(), s2: pypto.Tensor(), oq: pypto.Tensor(), ok: pypto.Tensor(),
                     hf, sec_t, sec_h, sec_w, q_eps, k_eps, inv_d, rows, heads, cols):
        pypto.set_vec_tile_shapes(rows, heads, cols)
        cos = pl.merged_angles([c0, c1, c2], sec_t, sec_h, sec_w)
        sin = pl.merged_angles([s0, s1, s2], sec_t, sec_h, sec_w)
        nq = pl.head_norm(q, gq, q_eps, inv_d, hf)
        nk = pl.head_norm(k, gk, k_eps, inv_d, hf)
        yq = pl.rotate(nq, cos, sin, oq.dtype, hf)
        yk = pl.rotate(nk, cos, sin, ok.dtype, hf)
        oq[:] = yq
        ok[:] = yk
    return qk_norm_rope


def _pypto_inputs(lay, mrope_section):
    """q, k as [T, H, D] and the six cos/sin planes as [T, 1, E] (the merged form's one plane three times),
    plus the sections as the kernel reads them."""
    T = lay.O * lay.I
    x3 = [x4.permute(0, 2, 1, 3).reshape(T, x4.shape[1], lay.D).contiguous() for x4 in (lay.q, lay.k)]
    planes = []
    for t in (lay.cos, lay.sin):
        t = t.expand(lay.P, lay.O, lay.I, lay.E) if lay.Oc == 1 else t
        ps = [t[p].reshape(T, 1, lay.E).contiguous() for p in range(lay.P)]
        planes += ps * (3 // len(ps))
    sections = list(mrope_section) if mrope_section else [lay.E // 2, 0, 0]
    return x3, planes, sections


def _pypto_outputs(lay, outs):
    """Kernel outputs [T, H, D] over the op's outputs when their memory is token-major (the golden's for HF's
    layouts), else contiguous stand-ins copied back by `finish`."""
    views = []
    T = lay.O * lay.I
    lay._pending = []
    for t in outs:
        H = t.numel() // (T * lay.D) if T * lay.D else 0
        try:
            view = t.view(lay.O, H, lay.I, lay.D).permute(0, 2, 1, 3).view(T, H, lay.D)
        except RuntimeError:
            view = None
        if view is not None and view.is_contiguous():
            views.append(view)
        else:
            stand_in = torch.empty(T, H, lay.D, dtype=t.dtype, device=t.device)
            lay._pending.append((t, stand_in.view(lay.O, lay.I, H, lay.D).permute(0, 2, 1, 3)))
            views.append(stand_in)
    return views


def _pypto_supports(backend, q, k, cos, *rest):
    return backend.runs_on(q) or _angles_supported(cos)


@ROPE.impl("pypto", supports=_pypto_supports)
def _(backend, q, k, cos, sin, mrope_section, unsqueeze_dim, cast_mode):
    def run(q, k, _):
        oq, ok = _outputs(q, k, cos, cast_mode)
        lay = Layout(q, k, cos, sin, mrope_section, unsqueeze_dim)
        x3, planes, sections = _pypto_inputs(lay, mrope_section)
        backend.launch("rope", rope_kernel, x3[0], [*x3, *planes], _pypto_outputs(lay, (oq, ok)),
                       [int(cast_mode == "hf"), *sections], tiles=rope_tiles(x3[0].shape[0], lay.Hq, lay.D))
        lay.finish()
        return oq, ok
    return pairwise(q, k, cos, cast_mode, run)


@QK_NORM_ROPE.impl("pypto", supports=lambda backend, q, k, qw, kw, cos, *rest: _pypto_supports(backend, q, k, cos))
def _(backend, q, k, q_weight, k_weight, cos, sin, mrope_section, q_eps, k_eps, unsqueeze_dim, cast_mode):
    def run(q, k, which):
        qw, kw, qe, ke = norm_args(which, q_weight, k_weight, q_eps, k_eps)
        oq, ok = _outputs(q, k, cos, cast_mode)
        lay = Layout(q, k, cos, sin, mrope_section, unsqueeze_dim)
        x3, planes, sections = _pypto_inputs(lay, mrope_section)
        D = lay.D
        # [1, H, D]: PyPTO broadcasts one axis at a time (a [1, 1, D] weight over [T, H, D] is refused)
        weights = [w.reshape(1, 1, D).expand(1, H, D).contiguous() for w, H in ((qw, lay.Hq), (kw, lay.Hk))]
        backend.launch("qk_norm_rope", qk_norm_rope_kernel, x3[0], [*x3, *weights, *planes],
                       _pypto_outputs(lay, (oq, ok)),
                       [int(cast_mode == "hf"), *sections, float(qe), float(ke), 1.0 / D],
                       tiles=rope_tiles(x3[0].shape[0], lay.Hq, D))
        lay.finish()
        return oq, ok
    return pairwise(q, k, cos, cast_mode, run)


# ---- rotary_embedding's backends: cpu in place from the cache, npu_mrope, the rope kernel on pypto ---------------
def _cache_supported(backend, positions, query, key, cache, *rest):
    return _angles_supported(cache)


@ROTARY_EMBEDDING.impl("cpu", supports=_cache_supported, into=True)
def _(backend, positions, query, key, cos_sin_cache, head_size, mrope_section, cast_mode, out=None):
    """rope.cpp's rotary_embedding: each token's cos/sin row read from the cache at its position(s), every head of
    q and k rotated with it; written over `out` (the inputs themselves for vLLM: in place) or new tensors. The
    kernel reads vLLM's [T, H * D] row views where they are and copies any other layout itself."""
    oq, ok = out if out is not None else (torch.empty(query.shape, dtype=query.dtype),
                                          torch.empty(key.shape, dtype=key.dtype))
    backend.ext.rotary_embedding(positions, query, key, cos_sin_cache, head_size, mrope_section, MODES[cast_mode],
                                 oq, ok)
    return oq, ok


# npu: torch_npu.npu_mrope(positions, query, key, cos_sin_cache, head_size, mrope_section=, rotary_mode="half")
# (aclnnRopeWithSinCosCache) is this op: positions (T,) or (3, T), query [T, Hq * head_size]; Atlas A2/A3 only.
# Its rounding is not documented as the query dtype's per product: 16-bit hf calls are declined as for rope.
# Its page's limits (torch_npu-npu_mrope.md, 约束说明): mrope_section one of four documented splits (or none);
# head_size and rotary_dim multiples of 16 in fp32 (32 in fp16/bf16): the call is made in fp32.
NPU_MROPE_SECTIONS = ([16, 24, 24], [24, 20, 20], [8, 12, 12], [16, 16, 16, 16])


def _npu_rotary_supports(backend, positions, query, key, cache, head_size, mrope_section, cast_mode):
    reason = _angles_supported(cache)
    if reason:
        return reason
    if backend.series_of(query) != "a2_a3":
        return "npu_mrope: Atlas A2/A3 only"
    if list(mrope_section) and list(mrope_section) not in NPU_MROPE_SECTIONS:
        return f"npu_mrope: mrope_section {list(mrope_section)} is not one of the documented {NPU_MROPE_SECTIONS}"
    rotary_dim = cache.shape[-1]
    if head_size % 16 or rotary_dim % 16:
        return f"npu_mrope: head_size {head_size} and rotary_dim {rotary_dim} must be multiples of 16 (fp32)"
    if cast_mode == "hf" and query.dtype != torch.float32:
        return (f"hf mode on {dtype_name(query.dtype)}: npu_mrope's rounding is not vLLM's per-product rounding "
                f"(cast_mode='fp32' maps onto it)")
    return None


@ROTARY_EMBEDDING.impl("npu", supports=_npu_rotary_supports)
def _(backend, positions, query, key, cos_sin_cache, head_size, mrope_section, cast_mode):
    T = positions.shape[-1]
    q2, k2 = (x.reshape(T, -1).float() for x in (query, key))
    yq, yk = backend.torch_npu().npu_mrope(positions.to(torch.int64), q2, k2, cos_sin_cache.float(), head_size,
                                           mrope_section=list(mrope_section) or None)  # rotary_mode "half"
    return yq.to(query.dtype).reshape(query.shape), yk.to(key.dtype).reshape(key.shape)


@ROTARY_EMBEDDING.impl("pypto", supports=lambda backend, positions, query, key, cache, *rest:
                       backend.runs_on(query) or _angles_supported(cache))
def _(backend, positions, query, key, cos_sin_cache, head_size, mrope_section, cast_mode):
    """The rope kernel on [T, H, D] views, cos and sin gathered at full rotary width on the host (the section
    merge too): the rotation the device runs is rope's, verified at the compiled level."""
    T = positions.shape[-1]
    cos, sin = cached_angles(positions, cos_sin_cache, mrope_section)
    if cast_mode == "hf":
        cos, sin = cos.to(query.dtype), sin.to(query.dtype)
    cos, sin = torch.cat((cos, cos), dim=-1).contiguous(), torch.cat((sin, sin), dim=-1).contiguous()
    q3, k3 = (x.reshape(T, -1, head_size) for x in (query, key))
    yq, yk = ROPE.impls["pypto"].fn(backend, q3, k3, cos, sin, [], -2, cast_mode)
    return yq.to(query.dtype).reshape(query.shape), yk.to(key.dtype).reshape(key.shape)
