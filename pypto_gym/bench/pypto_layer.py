"""What HF eager runs instead of each fused op, as PyPTO kernels, and `bench layer`: one decoder layer and one
vision block of a model (GutenOCR-3B by default; `--config` another one's, e.g. Qwen3-VL-2B's), every non-GEMM kernel
HF eager launches against pypto-gym's fused ones.

`hf_kernels(op, args)` lists, for one call of a fused op, the torch ops HF's code runs for the same result
(each op's definition says, in its BenchSpec: RMSNorm's eight, swiglu's silu and mul, the rotary function's
five per tensor, the vision function's casts), each as the PyPTO kernel it would be (pypto_kernels.py).
`bench pypto` sums their estimates per captured case; `bench layer` adds the residual adds, a vision block's
windowed attention (HF's per-window loop against the fused op) and the attention HF runs as one fused kernel (a
full-attention block's, the text prefill's and decode step's: the same kernel either way), counts launches per
layer, per forward and per document page, and puts the layer's GEMMs beside them on a stated roofline (the same
launches either way);
then a text layer's W8A8 quant kernels, the dynamic scheme's beside the static one's (msModelSlim's W8A8).
PyPTO's estimates are AICore time: the launch of each kernel is not in them, so totals are also
given with a stated per-launch cost.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import hardware
from ..models.qwen2_5_vl import GUTENOCR_CONFIG, read_config
from ..kernels.pypto.varlen_attention import long_window_pairs, windows_per_launch
from ..ops import OPS, registry
from ..ops.defs.varlen_attention import windows
from . import pypto_kernels as K
from .specs import SPECS
from .specs.varlen_attention import PAGE_T, PAGE_WINDOWS
from .timing import goal_line, header, save_plot, write_json

# A stated range, not a measurement: about 5 us for a launch from a captured graph, about 20 us for an eager
# torch_npu op at small shapes (the smallest time of a custom kernel on an Ascend 910B2 in ops-transformer's
# mhc_post performance table is 21 us, aclnnMul's 80 us).
LAUNCH_US = (5.0, 20.0)
# The GEMMs are a stated roofline, not a PyPTO estimate (this project has no pypto.matmul kernel yet): a GEMM
# takes max(FLOPs / the cube peak, bytes moved / HBM bandwidth) at these quoted Ascend 910B2 figures.
CUBE_TFLOPS = 376.0  # fp16/bf16 cube peak quoted for the 910B2 (a stated figure, not measured)
HBM_TBPS = 1.6  # HBM bandwidth, TB/s


@dataclass(frozen=True)
class LayerModel:
    """What bench layer costs of a model, from its config: the decoder layer's dimensions (q/k norms: Qwen3's
    `qk_norm_rope`), the vision block's (RMSNorm + SwiGLU MLP: Qwen2.5-VL; LayerNorm + GELU MLP: Qwen3-VL), and how
    many vision blocks attend over the whole image (the others over windows)."""

    name: str
    text_layers: int
    D: int
    I: int
    heads: int
    kv_heads: int
    head_dim: int
    qk_norm: bool
    vision_blocks: int
    full_blocks: int
    vD: int
    vI: int
    v_heads: int
    vision_norm: str  # "rms_norm" or "layer_norm"
    vision_mlp: str  # "swiglu" or "gelu"

    @property
    def window_blocks(self) -> int:
        return self.vision_blocks - self.full_blocks

    def gemms(self, part: str) -> list:
        """(label, K, N) of each linear HF launches per layer / block, bf16 weights [N, K]; HF's MLPs run gate and up
        apart."""
        if part == "text":
            q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
            return [("q_proj", self.D, q), ("k_proj", self.D, kv), ("v_proj", self.D, kv), ("o_proj", q, self.D),
                    ("gate_proj", self.D, self.I), ("up_proj", self.D, self.I), ("down_proj", self.I, self.D)]
        mlp = ([("gate_proj", self.vD, self.vI), ("up_proj", self.vD, self.vI), ("down_proj", self.vI, self.vD)]
               if self.vision_mlp == "swiglu" else [("fc1", self.vD, self.vI), ("fc2", self.vI, self.vD)])
        return [("qkv", self.vD, 3 * self.vD), ("proj", self.vD, self.vD), *mlp]


def layer_model(config_path=GUTENOCR_CONFIG) -> LayerModel:
    """The LayerModel of a Qwen2.5-VL (GutenOCR-3B) or Qwen3-VL config.json; another model type is refused."""
    from pathlib import Path

    raw = read_config(config_path)
    kind = raw.get("model_type")
    if kind not in ("qwen2_5_vl", "qwen3_vl"):
        raise ValueError(f"--config: model_type {kind!r}; bench layer knows 'qwen2_5_vl' (GutenOCR-3B) and 'qwen3_vl'")
    text, vision = raw.get("text_config") or raw, raw["vision_config"]
    qwen3 = kind == "qwen3_vl"
    return LayerModel(
        name=Path(config_path).parent.name, text_layers=text["num_hidden_layers"], D=text["hidden_size"],
        I=text["intermediate_size"], heads=text["num_attention_heads"], kv_heads=text["num_key_value_heads"],
        head_dim=text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"], qk_norm=qwen3,
        vision_blocks=vision["depth"], full_blocks=vision["depth"] if qwen3 else len(vision["fullatt_block_indexes"]),
        vD=vision["hidden_size"], vI=vision["intermediate_size"], v_heads=vision["num_heads"],
        vision_norm="layer_norm" if qwen3 else "rms_norm", vision_mlp="gelu" if qwen3 else "swiglu")


def hf_kernels(op: str, args) -> list:
    """[(label, baseline kind, inputs, output shape, output dtype, scalars)] HF runs for one call of `op` (its
    definition's BenchSpec says; [] for an op without one)."""
    spec = SPECS.get(op)
    return spec.hf_kernels(args) if spec is not None and spec.hf_kernels is not None else []


def unfused(op: str, args) -> tuple[float, int, list]:
    """(sum of the estimates, kernel count, [(label, us)]) of what HF runs for one call of `op`."""
    rows = [(label, K.estimate(kind, inputs, shape, dtype, scalars))
            for label, kind, inputs, shape, dtype, scalars in hf_kernels(op, args)]
    return sum(us for _, us in rows), len(rows), rows


def fused_us(op: str, args) -> float:
    from ..ops import Stats

    stats = Stats()
    OPS[op].call(args, "pypto", stats)
    if stats.fallbacks:
        raise RuntimeError(f"{op} fell back: {next(iter(stats.fallbacks))}")
    return registry.get("pypto").last_run.estimated_us


def gemm_roofline(phase: str, M: int, model: LayerModel | None = None) -> dict:
    """The layer's GEMMs at M tokens on the stated roofline (GutenOCR-3B's unless `model` says): per GEMM its µs (the
    larger of compute at the cube peak and bf16 bytes at HBM bandwidth) and the floor of reading its weight once; the
    same launches with or without pypto-gym's fusion (it fuses what lies between them)."""
    rows = []
    for label, K, N in (model or layer_model()).gemms("vision" if phase == "vision" else "text"):
        compute_us = 2 * M * K * N / (CUBE_TFLOPS * 1e12) * 1e6
        memory_us = 2 * (M * K + K * N + M * N) / (HBM_TBPS * 1e12) * 1e6
        rows.append({"gemm": label, "M": M, "K": K, "N": N, "us": max(compute_us, memory_us),
                     "bound": "compute" if compute_us >= memory_us else "memory",
                     "weight_floor_us": 2 * K * N / (HBM_TBPS * 1e12) * 1e6})
    return {"rows": rows, "kernels": len(rows), "us": sum(r["us"] for r in rows),
            "weight_floor_us": sum(r["weight_floor_us"] for r in rows)}


# ---- bench layer -------------------------------------------------------------------------------------------
def _layer_calls(model: LayerModel, phase: str, S: int, dtype, kv: int = 0):
    """The fused ops of one text layer (phase prefill/decode, S tokens; a decode step attends over kv cached
    tokens) or one vision block (S patches) of `model`."""
    from .specs.rope import hf_text_layout

    gen = torch.Generator().manual_seed(0)
    if phase == "vision":
        D, I, heads = model.vD, model.vI, model.v_heads
        hd = D // heads
        x = torch.randn(S, D, generator=gen).to(dtype)
        q, k, v = torch.randn(S, 3 * D, generator=gen).to(dtype).reshape(S, 3, heads, hd).permute(1, 0, 2, 3).unbind(0)
        emb = torch.rand(S, hd, generator=gen)
        rope = ("rotary", "rope", (q, k, emb.cos(), emb.sin(), [], -2, "fp32"))
        qkv = tuple(t.contiguous() for t in (q, k, v))
        attention = [("full attention", "varlen_attention", (*qkv, [0, S], hd ** -0.5, "hf"))]
        if model.window_blocks:
            cu = PAGE_WINDOWS if S == PAGE_T else windows([64] * (S // 64) + [S % 64])
            attention.insert(0, ("window attention", "varlen_attention", (*qkv, cu, hd ** -0.5, "hf")))
        norm = model.vision_norm
    else:
        D, I, hd = model.D, model.I, model.head_dim
        x = torch.randn(1, S, D, generator=gen).to(dtype)
        q, k, cos, sin = hf_text_layout(S, model.heads, model.kv_heads, hd, dtype, gen)
        if model.qk_norm:  # Qwen3: q_norm and k_norm per head before the rotation, one fused op
            weights = [(1 + 0.1 * torch.randn(hd, generator=gen)).to(dtype) for _ in range(2)]
            rope = ("q/k norms + rotary", "qk_norm_rope", (q, k, *weights, cos, sin, [], 1e-6, 1e-6, 1, "hf"))
        else:
            rope = ("rotary", "rope", (q, k, cos, sin, [], 1, "hf"))
        n = kv if phase == "decode" else S  # a decode step over kv cached tokens, a causal prefill
        q, k, v = (torch.randn(1, h, m, hd, generator=gen).to(dtype)
                   for h, m in ((model.heads, S), (model.kv_heads, n), (model.kv_heads, n)))
        label = f"attention (KV {kv})" if phase == "decode" else "attention (causal)"
        attention = [(label, "decoder_attention", (q, k, v, hd ** -0.5, True, None, "pack"))]
        norm = "rms_norm"
    gamma = (1 + 0.1 * torch.randn(D, generator=gen)).to(dtype)
    g = torch.randn(*x.shape[:-1], I, generator=gen).to(dtype)
    if norm == "layer_norm":
        beta = (0.1 * torch.randn(D, generator=gen)).to(dtype)
        norms = [("input norm", "layer_norm", (x, gamma, beta, 1e-6)),
                 ("add + post-attention norm", "add_layer_norm", (x, x, gamma, beta, 1e-6))]
    else:
        norms = [("input norm", "rms_norm", (x, gamma, 1e-6, "hf")),
                 ("add + post-attention norm", "add_rms_norm", (x, x, gamma, 1e-6, "hf", "rounded"))]
    mlp = (("MLP activation", "swiglu", (g, g, "hf")) if phase != "vision" or model.vision_mlp == "swiglu" else
           ("MLP activation (GELU)", "gelu", (g.reshape(-1, I),)))
    # a layer: norm -> attention (its rotary call; a vision block's windowed attention) -> add + norm -> MLP -> add
    return [norms[0], rope, *attention, norms[1], mlp, ("residual add (MLP)", "add", (x, x))]


def window_attention_row(label: str, args, model: LayerModel) -> dict:
    """A window block's attention. HF loops over the windows: one attention per window, costed as pypto-gym's own
    kernel on that window alone (the fewest kernels HF's loop could launch per window), then torch.cat of the
    outputs (a copy kernel of the same bytes). pypto-gym: the fused op's launches (64 (window, head) pairs each)."""
    q, k, v, cu, scale, mode = args
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:]) if b > a]
    one = {n: fused_us("varlen_attention", (q[:n], k[:n], v[:n], [0, n], scale, mode)) for n in sorted(set(lengths))}
    cat_us = K.copy_us(2 * q.numel() * q.element_size(), q.shape[0])
    launches = -(-len(lengths) // windows_per_launch(q.shape[1], "cpu"))
    return {"part": f"{label} ({len(lengths)} win.)", "hf_kernels": len(lengths) + 1,
            "hf_us": sum(one[n] for n in lengths) + cat_us, "fused_kernels": launches,
            "fused_us": fused_us("varlen_attention", args), "fused_op": f"attention x{launches}",
            "blocks": model.window_blocks}


def full_attention_row(label: str, args, model: LayerModel) -> dict:
    """A full-attention block's attention (one window: the image). HF's module makes one sdpa call, one fused
    attention on an NPU too: the same kernel on both sides, costed as kernels/pypto/attention.py's kernel. Its launches are
    one program repeated (pairs of 64 query rows against every key), and PyPTO's estimate of a program does not
    depend on the data (the same to the last digit on other values), so one launch is simulated and multiplied:
    the page's 944 pairs at 15 key tiles are 118 launches of 8, each about 12 s and 2 GB to simulate here."""
    from ..kernels.pypto import attention as pa

    q, k, v, cu, scale, _ = args
    T = q.shape[0]
    qp, kp, vp, bias, tile, _ = long_window_pairs(q, k, v, [(0, T)])  # the call's pairs, as the op makes them
    pairs, step = qp.shape[0], pa.pairs_per_launch(kp.shape[1] // tile)
    launches = [(slice(0, step), pairs // step)]
    if pairs % step:
        launches.append((slice(pairs - pairs % step, pairs), 1))
    backend, us = registry.get("pypto"), 0.0
    for sel, count in launches:  # the first launch stands for every full one, the last for a partial one
        pa.tiled_attention(backend, "varlen_attention", qp[sel], kp[sel], vp[sel], bias[sel], scale, tile)
        if backend.last_run.level != "compiled":
            raise RuntimeError(f"{label}: the PyPTO kernel's numbers did not come from the compiled program")
        us += count * backend.last_run.estimated_us
    n_launches = sum(count for _, count in launches)
    return {"part": f"{label} ({T} patches)", "hf_kernels": 1, "hf_us": us, "fused_kernels": 1, "fused_us": us,
            "fused_op": f"attn ({n_launches} sim.)", "blocks": model.full_blocks,
            "full_blocks_only": bool(model.window_blocks)}  # a block's own part where every block attends in full


def _w8a8_calls(S: int, dtype):
    """[(part, (dynamic op, args), [(static op, args)...])]: a text layer's W8A8 quant kernels in each scheme. The
    MLP's activation + quant is left out: swiglu_dynamic_quant has no PyPTO kernel at 11008 wide (its whole-row
    tiles overflow the unified buffer), so there is no estimate to put the static pair beside."""
    gen = torch.Generator().manual_seed(0)
    D = 2048
    x = torch.randn(1, S, D, generator=gen).to(dtype)
    gamma = (1 + 0.1 * torch.randn(D, generator=gen)).to(dtype)
    smooth = (0.5 + torch.rand(D, generator=gen)).to(dtype)
    scale, offset = torch.tensor([0.03], dtype=dtype), torch.tensor([3.0], dtype=dtype)
    return [("input norm + quant", ("rms_norm_dynamic_quant", (x, gamma, smooth, None, 1e-6, "int8")),
             [("rms_norm_quant", (x, gamma, scale, offset, None, 1e-6))]),
            ("add + norm + quant", ("add_rms_norm_dynamic_quant", (x, x, gamma, smooth, None, None, 1e-6, "int8")),
             [("add_rms_norm_quant", (x, x, gamma, scale, offset, None, 1e-6))]),
            ("o_proj input quant", ("dynamic_quant", (x, smooth, "int8")),
             [("static_quant", (x, scale, offset, None))])]


def _same_kernel_row(label: str, us: float, op: str) -> dict:
    """A part HF and pypto-gym launch as one kernel each, the same one (costed once, counted on both sides)."""
    return {"part": label, "hf_kernels": 1, "hf_us": us, "fused_kernels": 1, "fused_us": us, "fused_op": op}


def run_layer(S: int = 128, vision_tokens: int = 256, json_path=None, kv_lengths=(1024,), png_path=None,
              model: LayerModel | None = None) -> int:
    """The tables, a goal per part (the fused ops no slower than HF's kernels on PyPTO's estimate, in fewer launches;
    exit 1 on a miss), JSON and a PNG. The default shapes (a 128-token prefill, a decode step over 1024 cached
    tokens, a vision block of four windows) take minutes; `bench layer --page` the document page's, opt-in."""
    model = model or layer_model()
    print(header("bench layer"))
    vision = (f"A vision block's windowed attention: HF's per-window loop vs the fused op, both PyPTO estimates "
              f"({model.window_blocks} window blocks); a full-attention block's ({model.full_blocks})"
              if model.window_blocks else f"Every vision block attends over the whole image ({model.full_blocks}): "
              f"its attention")
    print(f"PyPTO SIM, Ascend 910B2 cost model: estimated AICore us per kernel (launch overhead not included; "
          f"totals also with {LAUNCH_US[0]:g}-{LAUNCH_US[1]:g} us per launch, a stated range). {model.name}: "
          f"{model.text_layers} text layers, {model.vision_blocks} vision blocks; bf16; transformers 5.x's code. The "
          f"GEMMs: a stated roofline (max of {CUBE_TFLOPS:g} TFLOPS cube peak and {HBM_TBPS:g} TB/s HBM), not a "
          f"PyPTO estimate. {vision} and the text attention (a causal prefill, a decode step over its KV cache, with "
          f"the KV-read floor): one fused attention on the NPU either way (HF's sdpa), costed as pypto-gym's PyPTO "
          f"kernel on both sides."
          + (" A vision LayerNorm (nn.LayerNorm: one kernel on the NPU) and the GELU: the same kernel either way; "
             "norm2's residual add is HF's one kernel more." if model.vision_norm == "layer_norm" else ""))
    result = {"bench": "layer", "model": model.name, "machine": hardware.capability(),
              "launch_us_range": list(LAUNCH_US),
              "gemm_roofline": {"cube_tflops": CUBE_TFLOPS, "hbm_tbps": HBM_TBPS, "stated": True}, "parts": {},
              "shapes": {"text_tokens": S, "vision_tokens": vision_tokens, "kv": list(kv_lengths)}}
    goals = []
    for part, phase, tokens, per_forward, kv in (
            ("text layer", "prefill", S, model.text_layers, 0),
            *(("text layer", "decode", 1, model.text_layers, n) for n in kv_lengths),
            ("vision block", "vision", vision_tokens, model.vision_blocks, 0)):
        rows = []
        for label, op, args in _layer_calls(model, phase, tokens, torch.bfloat16, kv):
            if op == "varlen_attention":
                row = full_attention_row if label == "full attention" else window_attention_row
                rows.append(row(label, args, model))
                continue
            if op == "layer_norm":  # nn.LayerNorm is one kernel on the NPU: the same as the fused op's
                rows.append(_same_kernel_row(label, fused_us(op, args), op))
                continue
            if op == "gelu":  # the GELU MLP's activation: one kernel either way (no fused linear + GELU on the NPU)
                rows.append(_same_kernel_row(label, K.estimate("gelu_tanh", [args[0]], args[0].shape, args[0].dtype),
                                             "(same GELU)"))
                continue
            if op == "add_layer_norm":  # HF: the residual add, then its LayerNorm kernel
                x1, x2, gamma, beta, eps = args
                hf_us = K.estimate("add", [x1, x2], x1.shape, x1.dtype) + fused_us("layer_norm", (x1, gamma, beta, eps))
                rows.append({"part": label, "hf_kernels": 2, "hf_us": hf_us, "fused_kernels": 1,
                             "fused_us": fused_us(op, args), "fused_op": op})
                continue
            if op == "decoder_attention":  # HF's sdpa is one fused attention on the NPU too: the same kernel
                us = fused_us(op, args)
                kv_bytes = 2 * args[1].numel() * args[1].element_size()
                rows.append({"part": label, "hf_kernels": 1, "hf_us": us, "fused_kernels": 1, "fused_us": us,
                             "fused_op": f"{phase} attn"}
                            | ({"kv_floor_us": kv_bytes / (HBM_TBPS * 1e12) * 1e6} if phase == "decode" else {}))
                continue
            if op == "add":  # the residual add after the MLP: one kernel either way (it ends the layer)
                x1, x2 = (x.reshape(-1, x.shape[-1]) for x in args)
                us = K.estimate("add", [x1, x2], x1.shape, x1.dtype)
                rows.append({"part": label, "hf_kernels": 1, "hf_us": us, "fused_kernels": 1, "fused_us": us,
                             "fused_op": "(unfused add)"})
                continue
            hf_total, n, _ = unfused(op, args)
            rows.append({"part": label, "hf_kernels": n, "hf_us": hf_total, "fused_kernels": 1,
                         "fused_us": fused_us(op, args), "fused_op": op})
        block = [r for r in rows if not r.get("full_blocks_only")]  # a (window) block's parts
        tot = {k: sum(r[k] for r in block) for k in ("hf_kernels", "hf_us", "fused_kernels", "fused_us")}
        title = f"{part}, {phase} ({tokens} tokens{f', KV {kv}' if kv else ''})"
        print(f"\n{title}\n{'part':<28} {'HF kernels':>10} {'HF us':>9} {'fused op':<14} {'fused us':>9} {'ratio':>6}")
        for r in rows:
            print(f"{r['part']:<28} {r['hf_kernels']:>10} {r['hf_us']:>9.1f} {r['fused_op']:<14} {r['fused_us']:>9.1f} "
                  f"{r['fused_us'] / r['hf_us']:>5.2f}x")
        lo, hi = LAUNCH_US
        print(f"{'per ' + part:<28} {tot['hf_kernels']:>10} {tot['hf_us']:>9.1f} {tot['fused_kernels']:>14} kernels "
              f"{tot['fused_us']:>9.1f} {tot['fused_us'] / tot['hf_us']:>5.2f}x")
        gemms = gemm_roofline(phase, tokens, model)
        print(f"{'GEMMs (stated roofline)':<28} {gemms['kernels']:>10} {gemms['us']:>9.1f} {'the same':<14} "
              f"{gemms['us']:>9.1f}  (" + ", ".join(f"{r['gemm']} {r['us']:.1f} {r['bound']}" for r in gemms["rows"])
              + f"; weight-read floor {gemms['weight_floor_us']:.1f} us)")
        whole = f"per document page (x{per_forward})" if phase == "vision" else f"per forward (x{per_forward})"
        for label, n in ((f"per {part}", 1), (whole, per_forward)):
            def times(key):  # a row with "blocks" (window / full attention) counts for that many blocks of a forward
                return sum(r.get(key, 0) * min(n, r.get("blocks", n)) for r in (block if n == 1 else rows))
            hf_n, fu_n = times("hf_kernels") + n * gemms["kernels"], times("fused_kernels") + n * gemms["kernels"]
            hf_us, fu_us = times("hf_us") + n * gemms["us"], times("fused_us") + n * gemms["us"]
            print(f"  {label}, with the GEMMs: HF {hf_n} launches, {hf_us:.0f} us AICore ({hf_us + lo * hf_n:.0f}-"
                  f"{hf_us + hi * hf_n:.0f} us with launches); pypto-gym {fu_n} launches, {fu_us:.0f} us "
                  f"({fu_us + lo * fu_n:.0f}-{fu_us + hi * fu_n:.0f} us); weight-read floor "
                  f"{n * gemms['weight_floor_us']:.0f} us"
                  + (f" + KV-read floor {times('kv_floor_us'):.0f} us" if kv else ""))
        if phase == "decode":  # a decode token: launched op by op (eager), or replayed as one captured graph
            result.setdefault("decode_token", {})[kv] = token = decode_token_launches(
                fu_n, fu_us, hf_n, hf_us, n * gemms["weight_floor_us"] + times("kv_floor_us"))
            print(f"  per decode token (KV {kv}): eager, pypto-gym launches {fu_n} kernels, {token['eager_us'][0]:.0f}-"
                  f"{token['eager_us'][1]:.0f} us with their host launch cost (HF: {hf_n}, {token['hf_eager_us'][0]:.0f}-"
                  f"{token['hf_eager_us'][1]:.0f} us); graph-captured (NPUGraph / torchair: one launch a step, no host "
                  f"sync in the npu mapping, tests/test_npu_models.py), {token['graph_us'][0]:.0f}-"
                  f"{token['graph_us'][1]:.0f} us; weight- and KV-read floor {token['floor_us']:.0f} us")
        result["parts"][title] = {"rows": rows, "totals": tot, "per_forward": per_forward, "gemms": gemms, "kv": kv}
        goals.append(goal_line(tot["fused_us"] <= tot["hf_us"] and tot["fused_kernels"] < tot["hf_kernels"],
                               f"{title}: pypto-gym's fused ops {tot['fused_us']:.1f} us AICore in "
                               f"{tot['fused_kernels']} launches, HF's kernels {tot['hf_us']:.1f} us in "
                               f"{tot['hf_kernels']} ({tot['fused_us'] / tot['hf_us']:.2f}x; goal: no slower, fewer "
                               f"launches)"))
    result["w8a8"] = {}
    for phase, tokens in (("prefill", S), ("decode", 1)):
        rows = []
        for label, (dyn_op, dyn_args), static in _w8a8_calls(tokens, torch.bfloat16):
            rows.append({"part": label, "dynamic_op": dyn_op, "dynamic_us": fused_us(dyn_op, dyn_args),
                         "static_ops": [op for op, _ in static],
                         "static_us": sum(fused_us(op, args) for op, args in static)})
        print(f"\nW8A8 quant kernels of a text layer, {phase} ({tokens} tokens): dynamic (per-token scales) vs "
              f"static (msModelSlim's W8A8)\n{'part':<24} {'dynamic op':<28} {'us':>7} {'static op(s)':<28} "
              f"{'us':>7} {'ratio':>6}")
        for r in rows:
            print(f"{r['part']:<24} {r['dynamic_op']:<28} {r['dynamic_us']:>7.1f} {' + '.join(r['static_ops']):<28} "
                  f"{r['static_us']:>7.1f} {r['static_us'] / r['dynamic_us']:>5.2f}x")
        dyn, sta = sum(r["dynamic_us"] for r in rows), sum(r["static_us"] for r in rows)
        print(f"{'per text layer':<24} {len(rows):>28} {dyn:>7.1f} {sum(len(r['static_ops']) for r in rows):>28} "
              f"{sta:>7.1f} {sta / dyn:>5.2f}x")
        result["w8a8"][phase] = {"tokens": tokens, "rows": rows, "dynamic_us": dyn, "static_us": sta}
    print("\n" + "\n".join(goals))
    result["goals"] = goals
    if json_path:
        write_json(json_path, result)
        print(f"\nJSON written to {json_path}")
    if png_path:
        print(save_plot(png_path, lambda plt: _plot(plt, result["parts"])))
    return 0 if all(g.startswith("PASS") for g in goals) else 1


def decode_token_launches(fused_n: int, fused_us: float, hf_n: int, hf_us: float, floor_us: float) -> dict:
    """A decode token's time with its launches: eager, each kernel's host launch (LAUNCH_US, a stated range) on top
    of the AICore time; graph-captured, the graph launched once (the same range, once), the kernels back to back."""
    lo, hi = LAUNCH_US
    return {"eager_us": (fused_us + lo * fused_n, fused_us + hi * fused_n), "launches": fused_n,
            "hf_eager_us": (hf_us + lo * hf_n, hf_us + hi * hf_n), "hf_launches": hf_n,
            "graph_us": (fused_us + lo, fused_us + hi), "floor_us": floor_us}


def _plot(plt, parts: dict):
    """Per part (a text layer's prefill and decode, a vision block): HF's kernels and the fused ops, AICore us on
    PyPTO's estimate, the launches written on the bars."""
    titles = list(parts)
    fig, ax = plt.subplots(figsize=(max(6, 2.4 * len(titles)), 4))
    for i, title in enumerate(titles):
        tot = parts[title]["totals"]
        for j, (key, n, label) in enumerate((("hf_us", "hf_kernels", "HF's kernels"),
                                             ("fused_us", "fused_kernels", "pypto-gym's fused ops"))):
            bar = ax.bar(i + (j - 0.5) * 0.38, tot[key], 0.36, color=("#b0b0b0", "#2a7ab9")[j],
                         label=label if i == 0 else None)
            ax.bar_label(bar, [f"{tot[n]} launches"], fontsize=7)
    ax.set_xticks(range(len(titles)), [t.replace(", ", "\n", 1) for t in titles], fontsize=8)
    ax.set_ylabel("AICore us (PyPTO SIM, 910B2 model)")
    ax.set_title("non-GEMM kernels of one layer / block")
    ax.legend(fontsize=8)
    return fig
