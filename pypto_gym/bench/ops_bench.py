"""`bench ops`: every op's cpu kernel against what a CPU user would run instead (SPEC 7).

The rows come from each op's bench spec (bench/specs/<op>.py, a BenchSpec): per op and real-model shape, side by
side (interleaved medians), what HF eager runs, `torch.compile` of the same (inductor: what a CPU user
would pick instead), the torch reference, the cpu kernel (for each instruction-set level asked for),
the op's parts on the cpu kernels where fusing is the claim, and the memory floor (the same bytes moved
with trivial math: a norm's clone(), swiglu's torch.add). Then, at decode, what a patched module costs
against the bare op and against HF's module (norm, MLP, attention), and (with the window attention) a whole vision
block on the document page, HF eager against patched, beside its GEMMs alone. Every figure is printed with the
CPU it ran on; goals are PASS/FAIL lines.
"""
from __future__ import annotations

import copy
import os
import time

import torch

from .. import hardware, ops
from ..kernels.cpu.backend import CpuBackend
from ..ops import OPS, registry
from ..ops.args import Tensor
from .specs import SPECS
from .timing import goal_line, header, interleaved_medians, pin_allocator, save_plot, write_json

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MODULE_GOALS = {"overhead": 1.15, "norm_vs_hf": 1.3, "mlp_vs_hf": 1.0, "attention_vs_hf": 1.0}


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


# ---- patched modules at decode ------------------------------------------------------------------------------
def _decode_modules(dtype):
    """(kind, HF module, its input args, the bare op call doing the module's fused part) at GutenOCR-3B dims."""
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qwen

    from .specs.rms_norm import hf_norm_module

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 2048, generator=gen).to(dtype)
    norm = hf_norm_module((1 + 0.1 * torch.randn(2048, generator=gen)).to(dtype), 1e-6)
    text = Qwen2_5_VLConfig(hidden_size=2048, intermediate_size=11008, num_attention_heads=16, num_key_value_heads=2,
                            num_hidden_layers=1).text_config
    text._attn_implementation = "sdpa"
    mlp = qwen.Qwen2MLP(text).to(dtype)
    attn = qwen.Qwen2_5_VLAttention(text, layer_idx=0).to(dtype)
    angles = torch.rand(1, 1, 64, generator=gen) * 100
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    g = norm.weight.detach()
    mlp_bare = lambda: mlp.down_proj(ops.swiglu(mlp.gate_proj(x), mlp.up_proj(x), backend="cpu"))  # noqa: E731
    return [("norm", norm, (x,), {}, lambda: ops.rms_norm(x, g, 1e-6, backend="cpu")),
            ("mlp", mlp, (x,), {}, mlp_bare),
            ("attention", attn, (x,), {"attention_mask": None, "position_embeddings": (cos, sin)}, None)]


def patched_modules_us(dtype, rounds: int) -> dict:
    """Per module kind at decode: HF's module, the same module patched (cpu), the bare op (where the module
    is one op around its projections) and the patched module with the switch off."""
    from .. import config
    from ..patching import patch_model

    out = {}
    for kind, hf, args, kwargs, bare in _decode_modules(dtype):
        patched = torch.nn.Sequential(copy.deepcopy(hf))
        patch_model(patched, backend="cpu", fuse_residual=False)
        module = patched[0]

        def switched_off(module=module, args=args, kwargs=kwargs):
            with config.scoped(enabled=False):
                return module(*args, **kwargs)

        fns = {"hf_eager": lambda hf=hf, args=args, kwargs=kwargs: hf(*args, **kwargs),
               "patched_cpu": lambda module=module, args=args, kwargs=kwargs: module(*args, **kwargs),
               "patched_switched_off": switched_off}
        if bare is not None:
            fns["bare_cpu_op"] = bare
        with torch.inference_mode():
            us = {k: v * 1e6 for k, v in interleaved_medians(fns, rounds=rounds).items()}
        us["speedup_vs_hf"] = us["hf_eager"] / us["patched_cpu"]
        if bare is not None:
            us["overhead_ratio"] = us["patched_cpu"] / us["bare_cpu_op"]
        out[kind] = us
    return out


# ---- a vision block on the document page ------------------------------------------------------------------------
VISION_BLOCK_GOAL = 1.5


def _page_block_inputs(dtype):
    """(model, the first vision block's (args, kwargs)) of a GutenOCR-3B-dims model with random weights (two vision
    blocks: the first windowed) on the document page, as its vision tower calls the block (captured by a hook, so
    the inputs are transformers' own whatever its version)."""
    from ..inference import open_image
    from ..models.qwen2_5_vl import DOCUMENT_IMAGE, GUTENOCR_CONFIG, random_model

    model, processor = random_model(GUTENOCR_CONFIG, num_layers=1, vision_depth=2, dtype=dtype)
    inputs = processor(["Read the page."], [open_image(DOCUMENT_IMAGE)], model=model)
    seen = {}

    def grab(module, args, kwargs):
        seen.setdefault("call", (args, kwargs))

    visual = getattr(model.model, "visual", None) or model.visual
    hook = visual.blocks[0].register_forward_pre_hook(grab, with_kwargs=True)
    with torch.inference_mode():
        visual(inputs["pixel_values"].to(dtype), grid_thw=inputs["image_grid_thw"])
    hook.remove()
    return model, visual, seen["call"]


def vision_block_us(dtype, rounds: int) -> dict:
    """One windowed vision block on the page (attention + MLP + norms): HF eager (its sdpa per-window loop) against
    the same block patched on the cpu backend (fused norms, rotary, window attention, MLP activation, the linears'
    bias in the GEMM's epilogue), and the block's five GEMMs alone on inputs of the same shapes, as the patched
    block runs them: what no fusion around them removes, so HF / GEMMs is the most any such fusion can give on this
    CPU (HF's own F.linear GEMMs beside them)."""
    from ..patching import patch_model
    from ..precision import compare

    model, visual, (args, kwargs) = _page_block_inputs(dtype)
    hf = visual.blocks[0]
    patched_model = copy.deepcopy(model)
    report = patch_model(patched_model, backend="cpu")
    patched = (getattr(patched_model.model, "visual", None) or patched_model.visual).blocks[0]
    x = args[0]
    down_in = torch.randn(x.shape[0], hf.mlp.down_proj.in_features).to(dtype)

    def gemms(block):  # the block's five linears as it calls them (the patched block's: bias in the epilogue)
        return lambda: [linear(inp) for linear, inp in ((block.attn.qkv, x), (block.attn.proj, x),
                                                         (block.mlp.gate_proj, x), (block.mlp.up_proj, x),
                                                         (block.mlp.down_proj, down_in))]

    with torch.inference_mode():
        check = compare(patched(*args, **kwargs), hf(*args, **kwargs), "block", "mixture")
        us = {k: v * 1e6 for k, v in interleaved_medians({"hf_eager": lambda: hf(*args, **kwargs),
                                                          "patched_cpu": lambda: patched(*args, **kwargs),
                                                          "gemms_alone": gemms(patched), "hf_gemms": gemms(hf)},
                                                         rounds=rounds, min_seconds=0).items()}
    block = [r for r in report.to_json()["sites"] if ".blocks.0." in r["path"] and r["status"] == "patched"]
    return {"patches": int(x.shape[0]), "hf_eager_us": us["hf_eager"], "patched_cpu_us": us["patched_cpu"],
            "gemms_alone_us": us["gemms_alone"], "hf_gemms_us": us["hf_gemms"],
            "speedup_vs_hf": us["hf_eager"] / us["patched_cpu"],
            "ceiling_vs_hf": us["hf_eager"] / us["gemms_alone"], "within_precision": check.passed,
            "patched_sites": sorted({r["kind"] for r in block}),
            "fallbacks": sum(sum(r["fallbacks"].values()) for r in block)}


# ---- the op rows ---------------------------------------------------------------------------------------------
def _compiled(fn):
    """torch.compile of what HF runs, specialised to the shape it will see (dynamo's caches reset first: every
    shape compiles the same code, and past 8 recompiles dynamo would silently run eager). Compiled in this
    process (compile_threads=1): no pool of compile workers starting up beside the timed rounds of the next rows
    on a two-core machine."""
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False)


def load_average() -> float | None:
    """The 1-minute load average: on a two-core machine anything above ~0.5 beside the benchmark itself is another
    process taking a core, which stalls every 2-thread OpenMP region (inductor's kernels parallelise even a
    decode row) for a scheduler slice: the 10-30 ms "compile" decode rows seen on a loaded machine."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def _shape_label(args) -> str:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return " ".join(str(tuple(t.shape)).replace(" ", "") for t in tensors[:2])


def op_rows(op, dtype, dname, levels, quick, rounds) -> list[dict]:
    spec = SPECS[op.name]
    rows = []
    for phase, tokens, args in spec.shapes(quick, dtype):
        hf = spec.hf(args)
        compiled = _compiled(hf)
        compiled()  # compile outside the timed rounds
        # the kernel as a patched module calls it: bound to its constants (BoundCall), the tensors per call
        constants = {a.name: v for a, v in zip(op.args, args) if not isinstance(a, Tensor)}
        tensors = [v for a, v in zip(op.args, args) if isinstance(a, Tensor)]
        fns = {"hf": hf, "compile": compiled, "torch": lambda: op.call(args, "torch", None),
               "floor": spec.floor(args)}
        for isa, name in levels.items():
            fns[f"cpu_{isa}"] = (lambda b=op.bind(name, ops.Stats(), **constants): b(*tensors))
            if spec.unfused is not None:
                fns[f"unfused_{isa}"] = spec.unfused(args, name)
        for alt, make in (spec.alternatives or {}).items():
            fns[alt] = make(args)
        from torch._dynamo.utils import counters

        counters.clear()
        us = {k: v * 1e6 for k, v in interleaved_medians(fns, rounds=rounds).items()}
        recompiled = counters["stats"]["unique_graphs"]  # the compile row must run its one graph, not recompile
        best = us[f"cpu_{next(iter(levels))}"]
        row = {"op": op.name, "phase": phase, "tokens": tokens, "shape": _shape_label(args), "dtype": dname,
               **{f"{k}_us": v for k, v in us.items()}, "floor": spec.floor_name,
               "cpu_speedup_vs_hf": us["hf"] / best, "cpu_speedup_vs_compile": us["compile"] / best,
               "cpu_over_floor": best / us["floor"], "compile_recompiles": recompiled}
        if spec.unfused is not None:
            row["fused_speedup"] = us[f"unfused_{next(iter(levels))}"] / best
        row["alternatives"] = {alt: us[alt] / best for alt in spec.alternatives or {}}
        rows.append(row)
    return rows


def _print_rows(rows, kcols):
    head = (f"{'op':<13} {'phase':<8} {'shape':<26} {'hf eager':>9} {'compile':>9} {'torch':>9} "
            + " ".join(f"{'cpu ' + k:>15}" for k in kcols) + f" {'floor':>8} {'vs hf':>7} {'vs comp':>7} {'/floor':>7}")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(f"{r['op']:<13} {r['phase']:<8} {r['shape']:<26} {r['hf_us']:>9.1f} {r['compile_us']:>9.1f} "
              f"{r['torch_us']:>9.1f} " + " ".join(f"{r['cpu_' + k + '_us']:>15.1f}" for k in kcols)
              + f" {r['floor_us']:>8.1f} {r['cpu_speedup_vs_hf']:>6.2f}x {r['cpu_speedup_vs_compile']:>6.2f}x "
              f"{r['cpu_over_floor']:>6.2f}x" + (f"   fused {r['fused_speedup']:.2f}x its parts" if "fused_speedup" in r
                                                 else "")
              + "".join(f"   {v:.2f}x {k}" for k, v in r.get("alternatives", {}).items()))


def goal_lines(rows, modules) -> list[str]:
    goals = []
    for r in rows:
        g = SPECS[r["op"]].goals
        label = f"cpu {r['op']} {r['dtype']} {r['phase']} {r['shape']}"
        if r["compile_recompiles"]:
            goals.append(goal_line(False, f"{label}: torch.compile recompiled {r['compile_recompiles']} times in the "
                                          f"timed rounds: its figure is not the compiled steady state"))
        if "vs_hf" in g:
            goals.append(goal_line(r["cpu_speedup_vs_hf"] >= g["vs_hf"], f"{label}: {r['cpu_speedup_vs_hf']:.2f}x HF "
                                                                         f"eager (goal >= {g['vs_hf']}x)"))
        if "decode_vs_hf" in g and r["phase"] == "decode":
            goals.append(goal_line(r["cpu_speedup_vs_hf"] >= g["decode_vs_hf"],
                                   f"{label}: {r['cpu_speedup_vs_hf']:.2f}x HF eager (goal >= {g['decode_vs_hf']}x)"))
        if r["tokens"] >= g.get("min_tokens", 2):
            if "vs_compile" in g:
                goals.append(goal_line(r["cpu_speedup_vs_compile"] >= g["vs_compile"],
                                       f"{label}: {r['cpu_speedup_vs_compile']:.2f}x torch.compile "
                                       f"(goal >= {g['vs_compile']}x)"))
            if "floor" in g:
                goals.append(goal_line(r["cpu_over_floor"] <= g["floor"], f"{label}: {r['cpu_over_floor']:.2f}x "
                                                                          f"{r['floor']} (goal <= {g['floor']}x)"))
        for alt, speedup in r.get("alternatives", {}).items():
            goal = g[f"vs_{alt}"]
            goals.append(goal_line(speedup >= goal, f"{label}: {speedup:.2f}x {alt} (goal >= {goal}x)"))
        if "fused_speedup" in r:
            goals.append(goal_line(r["fused_speedup"] > 1, f"{label}: {r['fused_speedup']:.2f}x its parts on their "
                                                           f"own cpu kernels (goal > 1x)"))
    for kind, m in modules.items():
        goal = MODULE_GOALS[f"{kind}_vs_hf"]
        goals.append(goal_line(m["speedup_vs_hf"] >= goal, f"patched {kind} at decode: {m['speedup_vs_hf']:.2f}x HF's "
                                                           f"module (goal >= {goal}x)"))
        if "overhead_ratio" in m:
            goals.append(goal_line(m["overhead_ratio"] <= MODULE_GOALS["overhead"],
                                   f"patched {kind} at decode costs {m['overhead_ratio']:.3f}x the bare cpu op "
                                   f"(goal <= {MODULE_GOALS['overhead']}x)"))
    return goals


def run(dtypes=("bfloat16",), quick=False, rounds=15, json_path=None, png_path=None, pin=True, isas=None,
        op_names=None) -> int:
    torch.manual_seed(0)
    allocator = pin_allocator() if pin else "allocator: glibc defaults"
    levels = kernel_backends(isas or [hardware.best_isa()])
    compile_note = "inductor at its default vector width"
    if not any(isa.startswith("avx512") for isa in levels):
        import torch._inductor.config as inductor_config  # the AVX2 comparison: compile for AVX2 too

        inductor_config.cpp.simdlen = 256
        compile_note = "inductor limited to 256-bit vectors (AVX2)"
    print(header("bench ops"))
    load = load_average()
    if load is not None and load > 0.5:
        print(f"note: load average {load:.2f} before the run: another process is using the CPU; the timings (the "
              f"torch.compile rows most) will not be repeatable")
    print(f"{allocator}; cpu kernel levels: {', '.join(f'{k} ({v})' for k, v in levels.items())}; ATen kernels: "
          f"{torch.backends.cpu.get_cpu_capability()} (ATEN_CPU_CAPABILITY); {compile_note}")
    warm = first_call_ms()
    print(f"cpu kernels: loaded in {warm['cpu_kernel_load_ms']:.0f} ms (build this process: "
          f"{warm['cpu_build_ms']:.0f} ms), first call {warm['cpu_first_call_ms']:.2f} ms")
    modules = patched_modules_us(DTYPES[dtypes[0]], rounds)
    for kind, m in modules.items():
        bare = f", bare cpu op {m['bare_cpu_op']:.2f} us ({m['overhead_ratio']:.3f}x)" if "bare_cpu_op" in m else ""
        print(f"decode {kind} {dtypes[0]}: HF module {m['hf_eager']:.2f} us, patched {m['patched_cpu']:.2f} us "
              f"({m['speedup_vs_hf']:.2f}x faster){bare}, patched with the switch off {m['patched_switched_off']:.2f} us")
    rows = []
    with torch.inference_mode():
        for dname in dtypes:
            for name, op in OPS.items():
                if name in SPECS and (not op_names or name in op_names):
                    rows += op_rows(op, DTYPES[dname], dname, levels, quick, rounds)
    kcols = list(levels)
    _print_rows(rows, kcols)
    blocks = {}
    if not quick and (not op_names or "varlen_attention" in op_names):  # the window attention's block on the page
        for dname in dtypes:
            b = blocks[dname] = vision_block_us(DTYPES[dname], max(3, rounds // 3))
            print(f"vision block {dname} ({b['patches']} patches, {', '.join(b['patched_sites'])} patched, "
                  f"{b['fallbacks']} fallbacks): HF eager {b['hf_eager_us'] / 1e3:.1f} ms, patched cpu "
                  f"{b['patched_cpu_us'] / 1e3:.1f} ms ({b['speedup_vs_hf']:.2f}x; within precision: "
                  f"{b['within_precision']}); its five GEMMs alone {b['gemms_alone_us'] / 1e3:.1f} ms as the patched "
                  f"block runs them (HF's F.linear: {b['hf_gemms_us'] / 1e3:.1f} ms), so no fusion around them can "
                  f"beat {b['ceiling_vs_hf']:.2f}x here")
    goals = goal_lines(rows, modules)
    for dname, b in blocks.items():
        goals.append(goal_line(b["speedup_vs_hf"] >= VISION_BLOCK_GOAL and b["within_precision"] and not b["fallbacks"],
                               f"patched vision block {dname} on the page: {b['speedup_vs_hf']:.2f}x HF eager's block "
                               f"(goal >= {VISION_BLOCK_GOAL}x; the GEMMs' ceiling here {b['ceiling_vs_hf']:.2f}x)"))
    print("\n" + "\n".join(goals))
    result = {"bench": "ops", "machine": hardware.capability(), "allocator": allocator, "levels": levels,
              "aten_capability": torch.backends.cpu.get_cpu_capability(), "compile": compile_note,
              "first_call": warm, "modules_us": modules, "rows": rows, "vision_block": blocks, "goals": goals,
              "threads": torch.get_num_threads(), "torch": torch.__version__,
              "load_average": {"before": load, "after": load_average()}}
    if json_path:
        write_json(json_path, result)
        print(f"JSON written to {json_path}")
    if png_path:
        print(save_plot(png_path, lambda plt: _plot(plt, rows, kcols[0])))
    return 0 if all(g.startswith("PASS") for g in goals) else 1


def _plot(plt, rows, level):
    """One panel per op: median us per call of each variant, by row."""
    names = list(dict.fromkeys(r["op"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        mine = [r for r in rows if r["op"] == name]
        xs = range(len(mine))
        for key, label in (("hf_us", "HF eager"), ("compile_us", "torch.compile"), (f"cpu_{level}_us", f"cpu ({level})"),
                           ("floor_us", "memory floor")):
            ax.plot(xs, [r[key] for r in mine], marker="o", label=label)
        ax.set_xticks(list(xs), [f"{r['phase']}\n{r['tokens']}" for r in mine], fontsize=7)
        ax.set_yscale("log")
        ax.set_title(f"{name} ({mine[0]['dtype']})", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("median µs per call")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"bench ops on {hardware.cpu_model()}", fontsize=10)
    return fig
