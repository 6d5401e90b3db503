"""`bench ops` for rope and qk_norm_rope: GutenOCR-3B's attentions and Qwen3-8B's, as HF hands them over, against
HF's rotary functions (and Qwen3's q/k norms)."""
import torch

from ...kernels.rope_layout import Layout
from ...ops.defs.rms_norm import RMS_NORM
from ...ops.defs.rope import QK_NORM_ROPE, ROPE, merge_sections
from . import BenchSpec, register
from .rms_norm import hf_norm_kernels


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
    norm = RMS_NORM

    def run():
        qn = norm.call((q, qw, q_eps, cast_mode), backend, None)
        kn = norm.call((k, kw, k_eps, cast_mode), backend, None)
        return ROPE.call((qn, kn, cos, sin, sec, u, cast_mode), backend, None)
    return run



register(ROPE, BenchSpec(_bench_shapes, _hf_rope, lambda a: (lambda: (a[0].clone(), a[1].clone())), "clone() of q and k",
                         ROPE_GOALS, hf_kernels=_hf_kernels))
register(QK_NORM_ROPE, BenchSpec(_qk_bench_shapes, _hf_qk_norm_rope, lambda a: (lambda: (a[0].clone(), a[1].clone())),
                                 "clone() of q and k", {"decode_vs_hf": 3.0, "vs_hf": 2.0}, unfused=_unfused_qk_norm_rope,
                                 hf_kernels=_hf_qk_kernels))
