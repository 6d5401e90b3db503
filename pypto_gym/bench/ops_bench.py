"""`bench ops`: the cpu kernels against what a CPU user would run instead (SPEC 7).

Per shape, side by side (interleaved medians): HF's eager RMSNorm module, `torch.compile` of the
same module (inductor: what a CPU user would pick instead), the torch reference, the cpu kernel
(for each instruction-set level asked for), and a same-size `clone()`, the memory floor: a norm
reads x once and writes y once, as clone does. Then the add+norm pair, and at decode size what a
patched module costs against the bare op and against HF eager. Every figure is printed with the
CPU it ran on; goals are PASS/FAIL lines.
"""
from __future__ import annotations

import copy
import time

import torch

from .. import hardware, ops
from ..ops import registry
from ..ops.backends.cpu import CpuBackend
from .timing import goal_line, header, interleaved_medians, pin_allocator, save_plot, write_json

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
GOALS = {"compile_speedup": 1.5, "clone_ratio": 1.5, "clone_min_rows": 512, "wrapper_overhead": 1.15,
         "wrapper_vs_hf": 1.3}


def shapes(quick: bool):
    rows = [64, 512, 4096] if quick else [64, 256, 512, 1024, 2048, 4096]
    out = [("decode", (1, 1, 2048))] + [("prefill", (1, s, 2048)) for s in rows]
    out += [("vision", (t, 1280)) for t in ([3744] if quick else [1024, 3744])]
    return out


def hf_norm(D, dtype):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRMSNorm

    m = Qwen2_5_VLRMSNorm(D, eps=1e-6).to(dtype)
    with torch.no_grad():
        m.weight.normal_(1.0, 0.1)
    return m


def kernel_backends(isas) -> dict:
    """{level: backend name}: the default `cpu` backend for the best level, `cpu_<level>` for others."""
    best = hardware.best_isa()
    names = {}
    for isa in isas:
        if isa == best:
            names[isa] = "cpu"
        elif hardware.supports_isa(isa):
            names[isa] = registry.register(CpuBackend(isa=isa, name=f"cpu_{isa}")).name
    for name in names.values():
        reason = registry.get(name).unavailable_reason()
        if reason:
            raise RuntimeError(f"cpu kernels for {name}: {reason}")
    return names


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
    """A patched norm at decode size [1, 1, 2048] bf16 against the bare op and against HF's module."""
    from .. import config
    from ..patching import patch_model

    hf = hf_norm(2048, torch.bfloat16)
    patched = torch.nn.Sequential(copy.deepcopy(hf))
    patch_model(patched, backend="cpu")
    norm = patched[0]
    x = torch.randn(1, 1, 2048, dtype=torch.bfloat16)
    g = hf.weight.detach()

    def switched_off():
        with config.scoped(enabled=False):
            return norm(x)

    with torch.inference_mode():
        t = interleaved_medians({"bare_cpu_op": lambda: ops.rms_norm(x, g, 1e-6, backend="cpu"),
                                 "patched_cpu": lambda: norm(x), "hf_eager": lambda: hf(x),
                                 "patched_switched_off": switched_off}, rounds=rounds)
    us = {k: v * 1e6 for k, v in t.items()}
    us["overhead_ratio"] = us["patched_cpu"] / us["bare_cpu_op"]
    us["speedup_vs_hf"] = us["hf_eager"] / us["patched_cpu"]
    return us


def _compiled(module):
    """torch.compile of HF's module, specialised to the shape it will see (dynamo's caches reset first:
    every shape compiles the same forward, and past 8 recompiles dynamo would silently run eager)."""
    torch._dynamo.reset()
    return torch.compile(module.forward, dynamic=False)


def run(dtypes=("bfloat16",), quick=False, rounds=15, json_path=None, png_path=None, pin=True, isas=None) -> int:
    torch.manual_seed(0)
    allocator = pin_allocator() if pin else "allocator: glibc defaults"
    levels = kernel_backends(isas or [hardware.best_isa()])
    compile_note = "inductor at its default vector width"
    if not any(isa.startswith("avx512") for isa in levels):
        import torch._inductor.config as inductor_config  # the AVX2 comparison: compile for AVX2 too

        inductor_config.cpp.simdlen = 256
        compile_note = "inductor limited to 256-bit vectors (AVX2)"
    print(header("bench ops"))
    print(f"{allocator}; cpu kernel levels: {', '.join(f'{k} ({v})' for k, v in levels.items())}; ATen kernels: "
          f"{torch.backends.cpu.get_cpu_capability()} (ATEN_CPU_CAPABILITY); {compile_note}")
    warm = first_call_ms()
    print(f"cpu kernels: loaded in {warm['cpu_kernel_load_ms']:.0f} ms (build this process: "
          f"{warm['cpu_build_ms']:.0f} ms), first call {warm['cpu_first_call_ms']:.2f} ms")
    wrap = wrapper_overhead_us(rounds)
    print(f"decode [1, 1, 2048] bf16: bare cpu op {wrap['bare_cpu_op']:.2f} us, patched module {wrap['patched_cpu']:.2f} us "
          f"({wrap['overhead_ratio']:.3f}x the bare op), HF eager {wrap['hf_eager']:.2f} us "
          f"({wrap['speedup_vs_hf']:.2f}x slower than patched), patched with the switch off "
          f"{wrap['patched_switched_off']:.2f} us")
    rows = []
    kcols = list(levels)
    header_line = (f"{'op':<13} {'shape':<16} {'dtype':<9} {'hf eager':>9} {'compile':>9} {'torch':>9} "
                   + " ".join(f"{'cpu ' + k:>15}" for k in kcols) + f" {'clone':>8} {'vs compile':>10} {'/clone':>7}")
    print(header_line + "\n" + "-" * len(header_line))
    with torch.inference_mode():
        for dname in dtypes:
            dtype = DTYPES[dname]
            for phase, shape in shapes(quick):
                D = shape[-1]
                x, x2 = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
                m = hf_norm(D, dtype)
                g = m.weight.detach()
                compiled = _compiled(m)
                compiled(x)  # compile outside the timed rounds
                fns = {"hf": lambda: m(x), "compile": lambda: compiled(x),
                       "torch": lambda: ops.rms_norm(x, g, backend="torch"), "clone": lambda: x.clone()}
                for isa, name in levels.items():
                    fns[f"cpu_{isa}"] = (lambda n=name: ops.rms_norm(x, g, backend=n))
                    fns[f"add_then_norm_{isa}"] = (lambda n=name: ops.rms_norm(x + x2, g, backend=n))
                    fns[f"add_rms_norm_{isa}"] = (lambda n=name: ops.add_rms_norm(x, x2, g, backend=n))
                us = {k: v * 1e6 for k, v in interleaved_medians(fns, rounds=rounds).items()}
                best = us[f"cpu_{kcols[0]}"]
                row = {"phase": phase, "shape": list(shape), "rows": x.numel() // D, "dtype": dname,
                       **{f"{k}_us": v for k, v in us.items()},
                       "cpu_speedup_vs_compile": us["compile"] / best, "cpu_speedup_vs_hf": us["hf"] / best,
                       "cpu_over_clone": best / us["clone"],
                       "fused_speedup": us[f"add_then_norm_{kcols[0]}"] / us[f"add_rms_norm_{kcols[0]}"]}
                rows.append(row)
                print(f"{'rms_norm':<13} {str(tuple(shape)):<16} {dname:<9} {us['hf']:>9.1f} {us['compile']:>9.1f} "
                      f"{us['torch']:>9.1f} " + " ".join(f"{us['cpu_' + k]:>15.1f}" for k in kcols)
                      + f" {us['clone']:>8.1f} {row['cpu_speedup_vs_compile']:>9.2f}x {row['cpu_over_clone']:>6.2f}x")
                print(f"{'  add+norm':<13} {'':<16} {'':<9} {'':>9} {'':>9} {'':>9} "
                      + " ".join(f"{us['add_then_norm_' + k]:>6.1f} -> {us['add_rms_norm_' + k]:>6.1f}" for k in kcols)
                      + f" {'':>8} {'fused':>10} {row['fused_speedup']:>6.2f}x")
    goals = goal_lines(rows, wrap)
    print("\n" + "\n".join(goals))
    result = {"bench": "ops", "machine": hardware.capability(), "allocator": allocator, "levels": levels,
              "aten_capability": torch.backends.cpu.get_cpu_capability(), "compile": compile_note,
              "first_call": warm, "wrapper_us": wrap, "rows": rows, "goals": goals,
              "threads": torch.get_num_threads(), "torch": torch.__version__}
    if json_path:
        write_json(json_path, result)
        print(f"JSON written to {json_path}")
    if png_path:
        print(save_plot(png_path, lambda plt: _plot(plt, rows, kcols[0])))
    return 0 if all(g.startswith("PASS") for g in goals) else 1


def goal_lines(rows, wrap) -> list[str]:
    G = GOALS
    goals = [goal_line(wrap["overhead_ratio"] <= G["wrapper_overhead"],
                       f"patched norm at decode costs {wrap['overhead_ratio']:.3f}x the bare cpu op "
                       f"(goal <= {G['wrapper_overhead']}x)"),
             goal_line(wrap["speedup_vs_hf"] >= G["wrapper_vs_hf"],
                       f"patched norm at decode is {wrap['speedup_vs_hf']:.2f}x faster than HF eager "
                       f"(goal >= {G['wrapper_vs_hf']}x)")]
    for r in rows:
        label = f"{r['dtype']} {tuple(r['shape'])}"
        if r["rows"] > 1:
            goals.append(goal_line(r["cpu_speedup_vs_compile"] >= G["compile_speedup"],
                                   f"cpu rms_norm {label}: {r['cpu_speedup_vs_compile']:.2f}x torch.compile "
                                   f"(goal >= {G['compile_speedup']}x)"))
        if r["rows"] >= G["clone_min_rows"]:
            goals.append(goal_line(r["cpu_over_clone"] <= G["clone_ratio"],
                                   f"cpu rms_norm {label}: {r['cpu_over_clone']:.2f}x clone() "
                                   f"(goal <= {G['clone_ratio']}x)"))
        goals.append(goal_line(r["fused_speedup"] > 1, f"cpu add_rms_norm {label}: {r['fused_speedup']:.2f}x "
                                                        f"add then rms_norm (goal > 1x)"))
    return goals


def _plot(plt, rows, level):
    fig, ax = plt.subplots(figsize=(8, 4.5))
    text = [r for r in rows if r["shape"][-1] == 2048]
    xs = [r["rows"] for r in text]
    for key, label in (("hf_us", "HF eager"), ("compile_us", "torch.compile (HF formula)"),
                       (f"cpu_{level}_us", f"pypto-gym cpu ({level})"), (f"add_rms_norm_{level}_us", "cpu add_rms_norm"),
                       ("clone_us", "clone() floor")):
        ax.plot(xs, [r[key] for r in text], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"rows (tokens), D=2048, {text[0]['dtype'] if text else ''}")
    ax.set_ylabel("median µs per call")
    ax.set_title(f"rms_norm on {hardware.cpu_model()}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return fig
