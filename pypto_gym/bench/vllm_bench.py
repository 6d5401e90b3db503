"""`pypto-gym bench vllm`: vLLM's own throughput with and without pypto-gym's kernels inside it, side by side,
and each provider against the op vLLM runs without it at the shapes vLLM called. Run with vLLM's python
(`.venv-vllm/bin/pypto-gym bench vllm`): it imports vLLM.

Models: the embedded tiny Qwen3 and Llama, and GutenOCR-3B's text model (Qwen2.5-VL's decoder: hidden 2048, 16
query and 2 KV heads, MLP 11008) with random weights and a few layers, written as a Qwen2 checkpoint. Each run is
its own process (the plugin is per process): off, on, off, on; the best of each side. The on runs capture the
shapes vLLM's scheduler gives the providers; each distinct shape is then timed here, pypto-gym's provider (its
cpu kernel) against vLLM's op: the IR ops' native torch code, `SiluAndMul.forward_native`, and vLLM's own C++
`rotary_embedding` (the CPU anchors to beat), each in place on views of one qkv projection as vLLM calls them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from .. import hardware
from .timing import goal_line, header, interleaved_medians, save_plot, write_json

MARK = "throughput: "
NORM_GOAL, NORM_MIN_TOKENS, DECODE_GOAL = 1.5, 64, 0.98


def gutenocr_text_checkpoint(out: Path, layers: int, dtype: str) -> Path:
    """GutenOCR-3B's decoder as a Qwen2 checkpoint with random weights (`layers` layers), for vLLM to serve."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ..models.qwen2_5_vl import GUTENOCR_CONFIG

    raw = json.loads(GUTENOCR_CONFIG.read_text())
    text = raw.get("text_config", raw)
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
            "vocab_size", "tie_word_embeddings", "max_position_embeddings")
    cfg = Qwen2Config(**{k: text.get(k, raw.get(k)) for k in keys if text.get(k, raw.get(k)) is not None},
                      num_hidden_layers=layers, rope_theta=text.get("rope_theta", raw.get("rope_theta", 1e6)))
    cfg.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(out)
    return out


def _throughput(model_dir, dtype: str, plugin: bool, capture: Path | None) -> dict:
    env = {**os.environ, "PYPTO_GYM_VLLM": "1" if plugin else "0", "PYPTO_GYM_STRICT": "0"}
    if capture is not None:
        env["PYPTO_GYM_VLLM_CAPTURE"] = str(capture)
    proc = subprocess.run([sys.executable, "-m", "pypto_gym.vllm.throughput", str(model_dir), dtype], env=env,
                          capture_output=True, text=True, timeout=1800)
    lines = [x[len(MARK):] for x in proc.stdout.splitlines() if x.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM on {model_dir} (plugin {'on' if plugin else 'off'}) failed: "
                           f"{(proc.stdout + proc.stderr)[-1500:]}")
    return json.loads(lines[-1])


def _op_pairs(case):
    """(ours, vllm's, args) for one captured provider case, on tensors made from its shapes: the providers as vLLM
    calls them (the layers' forward_cpu, in place for the rotary), against what vLLM runs without the plugin on
    the same layer (its native IR op, SiluAndMul.forward_native, its C++ rotary_embedding)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.ir import ops as ir_ops
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from ..capture.cases import case_args
    from ..vllm import providers

    providers.ensure_installed()
    args = case_args(case)
    op = case["op"]
    if op == "rms_norm":
        return providers.rms_norm, ir_ops.rms_norm.impls["native"].impl_fn, args[:3]
    if op == "add_rms_norm":
        return providers.fused_add_rms_norm, ir_ops.fused_add_rms_norm.impls["native"].impl_fn, args[:4]
    with set_current_vllm_config(VllmConfig()):
        if op == "silu_and_mul":
            return SiluAndMul().forward_cpu, SiluAndMul.forward_native, args[:1]
        if op == "rotary_embedding" and args[0].dim() == 1:  # q and k: views of one qkv projection, as vLLM's
            positions, q, k, cache, head_size = args[:5]
            layer = get_rope(head_size, max_position=cache.shape[0], is_neox_style=True, dtype=q.dtype,
                             rope_parameters={"rope_theta": 10000.0,
                                              "partial_rotary_factor": cache.shape[-1] / head_size})
            widths = [q.shape[-1], k.shape[-1], k.shape[-1]]
            qv, kv, _ = torch.randn(q.shape[0], sum(widths), dtype=q.dtype).split(widths, dim=-1)
            return (lambda: layer.forward_cpu(positions, qv, kv),
                    lambda: RotaryEmbedding.forward_cpu(layer, positions, qv, kv), ())
    return None


def per_op(cases: list[dict], rounds: int) -> list[dict]:
    """Each captured provider shape: µs of pypto-gym's provider vs vLLM's op, median of interleaved rounds."""
    rows = []
    for case in cases:
        pair = _op_pairs(case)
        if pair is not None:
            ours, theirs, args = pair
            us = interleaved_medians({"pypto_gym": lambda: ours(*args), "vllm": lambda: theirs(*args)}, rounds=rounds)
            first = next(a for a in case["args"] if isinstance(a, torch.Tensor))
            rows.append({"op": case["op"], "model": case["model"], "shape": list(first.shape),
                         "dtype": str(first.dtype).replace("torch.", ""), "tokens": int(first.shape[0]),
                         "pypto_gym_us": us["pypto_gym"] * 1e6, "vllm_us": us["vllm"] * 1e6,
                         "speedup": us["vllm"] / us["pypto_gym"]})
    return rows


def run(layers: int = 2, dtype: str = "bfloat16", quick: bool = False, rounds: int = 41, json_path=None,
        png_path=None) -> int:
    from ..capture.cases import load_cases
    from ..models import FAMILIES
    from ..vllm import report

    print(header("bench vllm"))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        targets = {"tiny_qwen3": FAMILIES["qwen3"].tiny_dir, "tiny_llama": FAMILIES["llama"].tiny_dir}
        if not quick:
            print(f"writing GutenOCR-3B's text model with random weights ({layers} layers, {dtype})", flush=True)
            targets["gutenocr_3b_text"] = gutenocr_text_checkpoint(tmp / "gutenocr_text", layers, dtype)
        models, cases = {}, []
        for name, path in targets.items():
            sides = {"off": [], "on": []}
            for side in ("off", "on") * 3:  # timed without the shape capture, which costs per call; three engines a
                # side, interleaved: one engine's figures differ from the next's by a few per cent
                sides[side].append(_throughput(path, dtype, side == "on", None))
            _throughput(path, dtype, True, tmp / f"capture_{name}")  # the shapes vLLM's scheduler gives the providers
            best = {side: {k: max(r[k] for r in runs) for k in runs[0]} for side, runs in sides.items()}
            ratio = {k: best["on"][k] / best["off"][k] for k in best["on"]}
            models[name] = {"off": best["off"], "on": best["on"], "on_vs_off": ratio}
            print(f"{name:<18} " + "  ".join(f"{k}: {best['off'][k]:.1f} -> {best['on'][k]:.1f} ({ratio[k]:.3f}x)"
                                              for k in best["on"]), flush=True)
            merged = tmp / f"cases_{name}.json"
            report.merge_cases(tmp / f"capture_{name}", merged)
            cases += [dict(c, model=name) for c in load_cases(merged)]
        rows = per_op(cases, rounds)
    print(f"\n{'model':<18} {'op':<13} {'shape':<22} {'pypto-gym us':>13} {'vLLM us':>9} {'speedup':>8}")
    for r in rows:
        print(f"{r['model']:<18} {r['op']:<13} {str(r['shape']):<22} {r['pypto_gym_us']:>13.1f} "
              f"{r['vllm_us']:>9.1f} {r['speedup']:>7.2f}x")
    goals = []
    for r in rows:
        label = f"{r['model']} {r['op']} {r['shape']} {r['dtype']}"
        if r["op"] in ("rms_norm", "add_rms_norm") and r["tokens"] >= NORM_MIN_TOKENS:
            goals.append(goal_line(r["speedup"] >= NORM_GOAL, f"{label}: {r['speedup']:.2f}x vLLM's torch-code "
                                                              f"norm (goal >= {NORM_GOAL}x at >= {NORM_MIN_TOKENS} "
                                                              f"tokens)"))
        else:
            goals.append(goal_line(r["speedup"] >= 1.0, f"{label}: {r['speedup']:.2f}x vLLM's op (goal >= 1.0x)"))
    if "gutenocr_3b_text" in models:
        for k in ("decode_tokens_per_s_batch1", "decode_tokens_per_s_batch16"):
            q = models["gutenocr_3b_text"]["on_vs_off"][k]
            goals.append(goal_line(q >= DECODE_GOAL, f"GutenOCR-3B text, {k}: {q:.3f}x with the plugin (goal >= "
                                                     f"{DECODE_GOAL}x)"))
    print("\n" + "\n".join(goals))
    result = {"bench": "vllm", "machine": hardware.capability(), "dtype": dtype, "layers": layers, "models": models,
              "ops": rows, "goals": goals}
    if json_path:
        write_json(json_path, result)
        print(f"JSON written to {json_path}")
    if png_path:
        print(save_plot(png_path, lambda plt: _plot(plt, models, rows)))
    return 0 if all(g.startswith("PASS") for g in goals) else 1


def _plot(plt, models, rows):
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(models)
    keys = list(next(iter(models.values()))["on_vs_off"])
    for i, k in enumerate(keys):
        a.bar([j + 0.25 * i for j in range(len(names))], [models[n]["on_vs_off"][k] for n in names], width=0.25,
              label=k.replace("_tokens_per_s", ""))
    a.axhline(1.0, color="k", lw=0.8)
    a.set_xticks(range(len(names)), names, fontsize=8)
    a.set_ylabel("with / without the plugin")
    a.legend(fontsize=7)
    b.scatter([r["tokens"] for r in rows], [r["speedup"] for r in rows], c=[hash(r["op"]) % 7 for r in rows])
    for r in rows:
        b.annotate(r["op"], (r["tokens"], r["speedup"]), fontsize=6)
    b.set_xscale("log")
    b.axhline(1.0, color="k", lw=0.8)
    b.set_xlabel("tokens in the call")
    b.set_ylabel("vLLM's op µs / pypto-gym's")
    fig.suptitle(f"bench vllm on {hardware.cpu_model()}", fontsize=10)
    return fig
