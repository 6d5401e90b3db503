"""`bench ops`: each op against HF eager, the torch reference and a same-size clone() (SPEC 7).

The clone is the memory-bound floor: a norm reads x once and writes y once, as clone does, so
kernel time / clone time says how far the kernel is from the bandwidth limit.
"""
from __future__ import annotations

import time

import torch

from .. import ops
from ..ops import registry
from .timing import goal_line, interleaved_medians, pin_allocator, save_plot, write_json

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def shapes(quick: bool):
    rows = [16, 512, 4096] if quick else [16, 64, 256, 512, 1024, 2048, 4096]
    out = [("decode", (1, 1, 2048))] + [("prefill", (1, s, 2048)) for s in rows]
    out += [("vision", (t, 1280)) for t in ([1024] if quick else [1024, 3744])]
    return out


def hf_norm(D, dtype):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRMSNorm

    m = Qwen2_5_VLRMSNorm(D, eps=1e-6).to(dtype)
    with torch.no_grad():
        m.weight.normal_(1.0, 0.1)
    return m


def first_call_ms() -> dict:
    """What the cpu backend costs before its first result: build/load of the C++ kernels, first call."""
    cpu = registry.get("cpu")
    t0 = time.perf_counter()
    cpu.extension()
    load = time.perf_counter() - t0
    x = torch.randn(1, 1, 2048, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    ops.rms_norm(x, None, backend="cpu")
    return {"cpu_kernel_load_ms": load * 1e3, "cpu_build_ms": (cpu.build_seconds or 0) * 1e3,
            "cpu_first_call_ms": (time.perf_counter() - t0) * 1e3}


def wrapper_overhead_us(rounds: int) -> dict:
    """A patched norm at decode size [1, 1, 2048] bf16: bare HF module vs wrapper (switch off / on)."""
    import copy

    from ..patching import patch_model, set_enabled, unpatch_model

    bare = torch.nn.Sequential(hf_norm(2048, torch.bfloat16))
    patched = copy.deepcopy(bare)
    patch_model(patched, backend="cpu")
    x = torch.randn(1, 1, 2048, dtype=torch.bfloat16)

    def switched_off():
        set_enabled(False)
        try:
            return patched(x)
        finally:
            set_enabled(True)

    with torch.inference_mode():
        t = interleaved_medians({"bare": lambda: bare(x), "wrapper_off": switched_off,
                                 "wrapper_on_cpu": lambda: patched(x)}, rounds=rounds)
    unpatch_model(patched)
    return {k: v * 1e6 for k, v in t.items()}


def run(dtypes=("bfloat16",), quick=False, rounds=15, json_path=None, png_path=None, pin=True) -> int:
    torch.manual_seed(0)
    allocator = pin_allocator() if pin else "allocator: glibc defaults"
    print(allocator)
    warm = first_call_ms()
    print(f"cpu kernels: loaded in {warm['cpu_kernel_load_ms']:.0f} ms (build this process: "
          f"{warm['cpu_build_ms']:.0f} ms), first call {warm['cpu_first_call_ms']:.2f} ms")
    wrap = wrapper_overhead_us(rounds)
    print(f"patched norm at [1, 1, 2048] bf16: bare HF module {wrap['bare']:.1f} us, wrapper with the switch off "
          f"{wrap['wrapper_off']:.1f} us (+{wrap['wrapper_off'] - wrap['bare']:.1f}, includes two set_enabled calls), "
          f"switch on (cpu) {wrap['wrapper_on_cpu']:.1f} us")
    rows, goals = [], []
    header = (f"{'op':<13} {'shape':<18} {'dtype':<9} {'hf eager':>10} {'torch':>10} {'add+norm':>10} {'cpu':>10} "
              f"{'clone':>10} {'cpu vs ref':>10} {'cpu/clone':>9}")
    print(header + "\n" + "-" * len(header))
    with torch.inference_mode():
        for dname in dtypes:
            dtype = DTYPES[dname]
            for phase, shape in shapes(quick):
                D = shape[-1]
                x = torch.randn(shape, dtype=dtype)
                x2 = torch.randn(shape, dtype=dtype)
                m = hf_norm(D, dtype)
                g = m.weight
                t = interleaved_medians({
                    "hf": lambda: m(x),
                    "torch": lambda: ops.rms_norm(x, g, backend="torch"),
                    "cpu": lambda: ops.rms_norm(x, g, backend="cpu"),
                    "add_then_norm": lambda: ops.rms_norm(x + x2, g, backend="cpu"),
                    "add_rms_norm": lambda: ops.add_rms_norm(x, x2, g, backend="cpu"),
                    "torch_add_rms_norm": lambda: ops.add_rms_norm(x, x2, g, backend="torch"),
                    "clone": lambda: x.clone(),
                }, rounds=rounds)
                us = {k: v * 1e6 for k, v in t.items()}
                n_rows = x.numel() // D
                rows.append({"phase": phase, "shape": list(shape), "rows": n_rows, "dtype": dname, **{
                    f"{k}_us": v for k, v in us.items()}, "cpu_speedup_vs_hf": us["hf"] / us["cpu"],
                    "cpu_over_clone": us["cpu"] / us["clone"],
                    "fused_speedup_vs_add_then_norm": us["add_then_norm"] / us["add_rms_norm"]})
                r = rows[-1]
                print(f"{'rms_norm':<13} {str(tuple(shape)):<18} {dname:<9} {us['hf']:>10.1f} {us['torch']:>10.1f} "
                      f"{'':>10} {us['cpu']:>10.1f} {us['clone']:>10.1f} {r['cpu_speedup_vs_hf']:>9.1f}x "
                      f"{r['cpu_over_clone']:>8.2f}x")
                print(f"{'add_rms_norm':<13} {str(tuple(shape)):<18} {dname:<9} {'':>10} "
                      f"{us['torch_add_rms_norm']:>10.1f} {us['add_then_norm']:>10.1f} {us['add_rms_norm']:>10.1f} "
                      f"{us['clone']:>10.1f} {r['fused_speedup_vs_add_then_norm']:>9.2f}x "
                      f"{us['add_rms_norm'] / us['clone']:>8.2f}x")
    for r in rows:
        if r["dtype"] == "bfloat16" and r["shape"][-1] == 2048 and 512 <= r["rows"] <= 4096:
            goals.append(goal_line(r["cpu_speedup_vs_hf"] >= 10,
                                   f"cpu rms_norm bf16 D=2048 rows={r['rows']}: {r['cpu_speedup_vs_hf']:.1f}x HF eager "
                                   f"(goal >= 10x)"))
        if r["dtype"] == "bfloat16" and r["rows"] == 1:
            goals.append(goal_line(r["cpu_speedup_vs_hf"] >= 1,
                                   f"cpu rms_norm bf16 decode rows=1: {r['cpu_speedup_vs_hf']:.2f}x HF eager (goal >= 1x)"))
        goals.append(goal_line(r["fused_speedup_vs_add_then_norm"] > 1,
                               f"cpu add_rms_norm {r['dtype']} {tuple(r['shape'])}: "
                               f"{r['fused_speedup_vs_add_then_norm']:.2f}x add then rms_norm (goal > 1x)"))
    print("\n" + "\n".join(goals))
    result = {"bench": "ops", "allocator": allocator, "first_call": warm, "wrapper_us": wrap, "rows": rows, "goals": goals,
              "threads": torch.get_num_threads()}
    if json_path:
        write_json(json_path, result)
        print(f"JSON written to {json_path}")
    if png_path:
        print(save_plot(png_path, lambda plt: _plot(plt, rows)))
    return 0 if all(g.startswith("PASS") for g in goals) else 1


def _plot(plt, rows):
    fig, ax = plt.subplots(figsize=(8, 4.5))
    text = [r for r in rows if r["shape"][-1] == 2048 and r["dtype"] == "bfloat16"]
    xs = [r["rows"] for r in text]
    for key, label in (("hf_us", "HF eager RMSNorm"), ("torch_us", "torch reference"), ("cpu_us", "pypto-gym cpu"),
                       ("add_rms_norm_us", "cpu add_rms_norm"), ("clone_us", "clone() floor")):
        ax.plot(xs, [r[key] for r in text], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("rows (tokens), D=2048, bf16")
    ax.set_ylabel("median µs per call")
    ax.set_title("rms_norm on CPU")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return fig
