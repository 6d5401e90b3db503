"""What HF eager runs instead of each fused op, as PyPTO kernels, and `bench layer`: one GutenOCR-3B decoder
layer and one vision block, every non-GEMM kernel HF eager launches against pypto-gym's fused ones.

`hf_kernels(op, args)` lists, for one call of a fused op, the torch ops HF's code runs for the same result
(transformers 5.x: RMSNorm's eight, swiglu's silu and mul, the rotary function's five per tensor, the vision
function's casts), each as the PyPTO kernel it would be (pypto_kernels.py). `bench pypto` sums their
estimates per captured case; `bench layer` adds the residual adds and counts launches per layer and per
forward. PyPTO's estimates are AICore time: the launch of each kernel is not in them, so totals are also
given with a stated per-launch cost.
"""
from __future__ import annotations

import torch

from .. import hardware
from ..ops import OPS
from ..ops.defs.rope import Layout, merge_sections
from . import pypto_kernels as K
from .timing import header, write_json

F32 = torch.float32
# A stated range, not a measurement: about 5 us for a launch from a captured graph, about 20 us for an eager
# torch_npu op at small shapes (the smallest time of a custom kernel on an Ascend 910B2 in ops-transformer's
# mhc_post performance table is 21 us, aclnnMul's 80 us).
LAUNCH_US = (5.0, 20.0)
TEXT_LAYERS, VISION_BLOCKS = 36, 32  # GutenOCR-3B (modeling/gutenocr_3b/config.json)


def _rows(t):
    return t.reshape(-1, t.shape[-1])


def _norm_kernels(x, gamma, prefix=""):
    """HF's RMSNorm forward: to(fp32), pow(2), mean(-1), + eps, rsqrt, mul, to(dtype), weight * h."""
    x = _rows(x)
    R, D = x.shape
    h = torch.zeros(R, D, dtype=F32)
    v = torch.zeros(R, 1, dtype=F32)
    return [(f"{prefix}x.to(float32)", "cast", [x], (R, D), F32, ()),
            (f"{prefix}h.pow(2)", "mul", [h, h], (R, D), F32, ()),
            (f"{prefix}.mean(-1)", "mean", [h], (R, 1), F32, (1.0 / D,)),
            (f"{prefix}variance + eps", "add_scalar", [v], (R, 1), F32, (1e-6,)),
            (f"{prefix}torch.rsqrt", "rsqrt", [v], (R, 1), F32, ()),
            (f"{prefix}h * rsqrt", "mul", [h, v], (R, D), F32, ()),
            (f"{prefix}.to(dtype)", "cast", [h], (R, D), x.dtype, ()),
            (f"{prefix}weight * h", "mul", [x, gamma.reshape(1, D)], (R, D), x.dtype, ())]


def _rotate_kernels(x3, cos3, dtype, name):
    """x * cos + rotate_half(x) * sin for one of q, k as [T, H, D]: mul, neg, cat, mul, add."""
    T, H, D = x3.shape
    return [(f"{name} * cos", "mul", [x3, cos3], (T, H, D), dtype, ()),
            (f"-{name}2", "neg", [x3[..., D // 2:]], (T, H, D // 2), dtype, ()),
            (f"cat(-{name}2, {name}1)", "cat", [x3], (T, H, D), dtype, ()),
            (f"rotate_half({name}) * sin", "mul", [x3, cos3], (T, H, D), dtype, ()),
            (f"{name}_embed = sum", "add", [x3, x3], (T, H, D), dtype, ())]


def hf_kernels(op: str, args) -> list:
    """[(label, baseline kind, inputs, output shape, output dtype, scalars)] HF runs for one call of `op`."""
    if op == "rms_norm":
        return _norm_kernels(args[0], args[1] if args[1] is not None else torch.ones(args[0].shape[-1]))
    if op == "add_rms_norm":
        x1, x2, gamma = args[:3]
        return [("residual + hidden", "add", [_rows(x1), _rows(x2)], _rows(x1).shape, x1.dtype, ()),
                *_norm_kernels(x1, gamma)]
    if op == "swiglu":
        gate, up = _rows(args[0]), _rows(args[1])
        return [("act_fn(gate)", "silu", [gate], gate.shape, gate.dtype, ()),
                ("* up", "mul", [gate, up], gate.shape, gate.dtype, ())]
    if op in ("rope", "qk_norm_rope"):
        if op == "rope":
            q, k, cos, sin, section, unsqueeze_dim, cast_mode = args
            norms = []
        else:
            q, k, qw, kw, cos, sin, section, _, _, unsqueeze_dim, cast_mode = args
            norms = _norm_kernels(q, qw, "q_norm: ") + _norm_kernels(k, kw, "k_norm: ")
        merges = []
        if section:  # transformers 4.57 merges the MRoPE planes in every layer: a cat each for cos and sin
            merged = merge_sections(cos, section)
            merges = [(f"cat {n} sections", "cat", [torch.zeros(merged.numel() // merged.shape[-1], 1, merged.shape[-1])],
                       (merged.numel() // merged.shape[-1], 1, merged.shape[-1]), cos.dtype, ()) for n in ("cos", "sin")]
            cos = sin = merged
        lay = Layout(q, k, cos, sin, (), unsqueeze_dim)
        T = lay.O * lay.I
        dtype = F32 if cast_mode == "fp32" else torch.promote_types(q.dtype, cos.dtype)
        q3 = torch.zeros(T, lay.Hq, lay.D, dtype=dtype)
        k3 = torch.zeros(T, lay.Hk, lay.D, dtype=dtype)
        cos3 = torch.zeros(T, 1, lay.D, dtype=dtype)
        casts = []
        if cast_mode == "fp32" and q.dtype != F32:  # the vision function: q.float(), k.float(), then back
            casts = [("q.float()", "cast", [q3.to(q.dtype)], q3.shape, F32, ()),
                     ("k.float()", "cast", [k3.to(k.dtype)], k3.shape, F32, ())]
        back = [] if not casts else [("q_embed.to(dtype)", "cast", [q3], q3.shape, q.dtype, ()),
                                     ("k_embed.to(dtype)", "cast", [k3], k3.shape, k.dtype, ())]
        return norms + merges + casts + _rotate_kernels(q3, cos3, dtype, "q") + _rotate_kernels(k3, cos3, dtype, "k") \
            + back
    return []


def unfused(op: str, args) -> tuple[float, int, list]:
    """(sum of the estimates, kernel count, [(label, us)]) of what HF runs for one call of `op`."""
    rows = [(label, K.estimate(kind, inputs, shape, dtype, scalars))
            for label, kind, inputs, shape, dtype, scalars in hf_kernels(op, args)]
    return sum(us for _, us in rows), len(rows), rows


def fused_us(op: str, args) -> float:
    from ..ops import Stats, registry

    stats = Stats()
    OPS[op].call(args, "pypto", stats)
    if stats.fallbacks:
        raise RuntimeError(f"{op} fell back: {next(iter(stats.fallbacks))}")
    return registry.get("pypto").last_run.estimated_us


# ---- bench layer -------------------------------------------------------------------------------------------
def _layer_calls(phase: str, S: int, dtype):
    """The fused ops of one text layer (phase prefill/decode, S tokens) or one vision block (S patches)."""
    from ..ops.defs.rope import hf_text_layout

    gen = torch.Generator().manual_seed(0)
    if phase == "vision":
        D, I, heads, hd = 1280, 3420, 16, 80
        x = torch.randn(S, D, generator=gen).to(dtype)
        q, k, _ = torch.randn(S, 3 * D, generator=gen).to(dtype).reshape(S, 3, heads, hd).permute(1, 0, 2, 3).unbind(0)
        emb = torch.rand(S, hd, generator=gen)
        rope = ("rope", (q, k, emb.cos(), emb.sin(), [], -2, "fp32"))
    else:
        D, I = 2048, 11008
        x = torch.randn(1, S, D, generator=gen).to(dtype)
        rope = ("rope", (*hf_text_layout(S, 16, 2, 128, dtype, gen), [], 1, "hf"))
    gamma = (1 + 0.1 * torch.randn(D, generator=gen)).to(dtype)
    g = torch.randn(*x.shape[:-1], I, generator=gen).to(dtype)
    # a layer: norm -> attention (its rotary call) -> add + norm -> MLP (swiglu) -> residual add
    return [("input norm", "rms_norm", (x, gamma, 1e-6, "hf")), ("rotary", *rope),
            ("add + post-attention norm", "add_rms_norm", (x, x, gamma, 1e-6, "hf")),
            ("MLP activation", "swiglu", (g, g, "hf")), ("residual add (MLP)", "add", (x, x))]


def run_layer(S: int = 512, vision_tokens: int = 3744, json_path=None) -> int:
    print(header("bench layer"))
    print(f"PyPTO SIM, Ascend 910B2 cost model: estimated AICore us per kernel (launch overhead not included; "
          f"totals also with {LAUNCH_US[0]:g}-{LAUNCH_US[1]:g} us per launch, a stated range). GutenOCR-3B: "
          f"{TEXT_LAYERS} text layers, {VISION_BLOCKS} vision blocks; bf16; transformers 5.x's code.")
    result = {"bench": "layer", "machine": hardware.capability(), "launch_us_range": list(LAUNCH_US), "parts": {}}
    for part, phase, tokens, per_forward in (("text layer", "prefill", S, TEXT_LAYERS),
                                             ("text layer", "decode", 1, TEXT_LAYERS),
                                             ("vision block", "vision", vision_tokens, VISION_BLOCKS)):
        rows = []
        for label, op, args in _layer_calls(phase, tokens, torch.bfloat16):
            if op == "add":  # the residual add after the MLP: one kernel either way (it ends the layer)
                x1, x2 = args
                us = K.estimate("add", [_rows(x1), _rows(x2)], _rows(x1).shape, x1.dtype)
                rows.append({"part": label, "hf_kernels": 1, "hf_us": us, "fused_kernels": 1, "fused_us": us,
                             "fused_op": "(unfused add)"})
                continue
            hf_total, n, _ = unfused(op, args)
            rows.append({"part": label, "hf_kernels": n, "hf_us": hf_total, "fused_kernels": 1,
                         "fused_us": fused_us(op, args), "fused_op": op})
        tot = {k: sum(r[k] for r in rows) for k in ("hf_kernels", "hf_us", "fused_kernels", "fused_us")}
        title = f"{part}, {phase} ({tokens} tokens)"
        print(f"\n{title}\n{'part':<28} {'HF kernels':>10} {'HF us':>9} {'fused op':<14} {'fused us':>9} {'ratio':>6}")
        for r in rows:
            print(f"{r['part']:<28} {r['hf_kernels']:>10} {r['hf_us']:>9.1f} {r['fused_op']:<14} {r['fused_us']:>9.1f} "
                  f"{r['fused_us'] / r['hf_us']:>5.2f}x")
        lo, hi = LAUNCH_US
        print(f"{'per ' + part:<28} {tot['hf_kernels']:>10} {tot['hf_us']:>9.1f} {tot['fused_kernels']:>14} kernels "
              f"{tot['fused_us']:>9.1f} {tot['fused_us'] / tot['hf_us']:>5.2f}x")
        for label, n in ((f"per {part}", 1), (f"per forward (x{per_forward})", per_forward)):
            hf_lo, hf_hi = n * (tot["hf_us"] + lo * tot["hf_kernels"]), n * (tot["hf_us"] + hi * tot["hf_kernels"])
            fu_lo = n * (tot["fused_us"] + lo * tot["fused_kernels"])
            fu_hi = n * (tot["fused_us"] + hi * tot["fused_kernels"])
            print(f"  {label}: HF {n * tot['hf_kernels']} launches, {n * tot['hf_us']:.0f} us AICore "
                  f"({hf_lo:.0f}-{hf_hi:.0f} us with launches); pypto-gym {n * tot['fused_kernels']} launches, "
                  f"{n * tot['fused_us']:.0f} us ({fu_lo:.0f}-{fu_hi:.0f} us)")
        result["parts"][title] = {"rows": rows, "totals": tot, "per_forward": per_forward}
    if json_path:
        write_json(json_path, result)
        print(f"\nJSON written to {json_path}")
    return 0
