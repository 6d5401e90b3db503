"""`bench cases FILE` and `bench pypto FILE`: every captured case timed, and costed on the NPU model.

`cases` times each case on each CPU backend (interleaved medians) and, when `pypto` is among the
backends, adds SIM's estimated AICore microseconds. `pypto` puts that estimate next to the bytes
the op must move and the time the 910B's HBM needs for them, i.e. how close the kernel gets to
the memory-bound limit an RMSNorm lives at.
"""
from __future__ import annotations

import torch

from .. import ops
from ..capture.cases import build_inputs, call_args, load_cases
from ..ops import registry
from .timing import interleaved_medians, save_plot, write_json

HBM_BYTES_PER_S = 1.6e12  # Ascend 910B HBM2e, as SIM's 910B2 model assumes (datasheet figure)


def bytes_moved(case: dict) -> int:
    """Bytes an op reads and writes at least once: every input tensor and every declared output."""
    total = 0
    for shape, dtype in list(case["inputs"].values()) + list(case["outputs"].values()):
        total += int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    return total


def _pypto_estimate(case, args, kwargs):
    stats = ops.Stats()
    getattr(ops, case["op"])(*args, **kwargs, backend="pypto", stats=stats)
    if stats.fallbacks:
        return None, next(iter(stats.fallbacks))
    return registry.get("pypto").last_estimated_us, ""


def run_cases(path, backends=("torch", "cpu"), rounds=9, json_path=None) -> int:
    cases = load_cases(path)
    timed = [b for b in backends if b != "pypto"]
    rows = []
    header = f"{'id':<18} {'op':<13} {'shape':<20} " + " ".join(f"{b + ' us':>11}" for b in timed) + \
        (f" {'cpu vs torch':>12}" if {"cpu", "torch"} <= set(timed) else "") + \
        (f" {'est. NPU us':>12}" if "pypto" in backends else "")
    print(header + "\n" + "-" * len(header))
    with torch.inference_mode():
        for case in cases:
            inputs = build_inputs(case)
            args, kwargs = call_args(case, inputs)
            fn = getattr(ops, case["op"])
            t = interleaved_medians({b: (lambda b=b: fn(*args, **kwargs, backend=b)) for b in timed}, rounds=rounds)
            row = {"id": case["id"], "op": case["op"], "description": case["description"],
                   **{f"{b}_us": t[b] * 1e6 for b in timed}}
            if "pypto" in backends:
                row["est_npu_us"], row["pypto_note"] = _pypto_estimate(case, args, kwargs)
            rows.append(row)
            shape = str(tuple(next(iter(case["inputs"].values()))[0]))
            line = f"{case['id']:<18} {case['op']:<13} {shape:<20} " + " ".join(f"{row[b + '_us']:>11.1f}" for b in timed)
            if {"cpu", "torch"} <= set(timed):
                line += f" {row['torch_us'] / row['cpu_us']:>11.1f}x"
            if "pypto" in backends:
                est = row["est_npu_us"]
                line += f" {est:>12.2f}" if est is not None else f" {'fallback':>12}"
            print(line, flush=True)
    if json_path:
        write_json(json_path, {"bench": "cases", "file": str(path), "backends": list(backends), "rows": rows})
        print(f"JSON written to {json_path}")
    return 0


def _unfused_estimate(case, inputs):
    """For add_rms_norm cases: PyPTO's estimate of a separate add kernel plus rms_norm on its result."""
    backend = registry.get("pypto")
    x_out = backend.residual_add(inputs["x1"], inputs["x2"])
    add_us = backend.last_estimated_us
    norm_us, _ = _pypto_estimate({"op": "rms_norm"}, (x_out, inputs.get("gamma"), case["eps"]), {})
    return add_us + norm_us if add_us is not None and norm_us is not None else None


def run_pypto(path, json_path=None, png_path=None) -> int:
    cases = load_cases(path)
    rows = []
    header = (f"{'id':<18} {'op':<13} {'shape':<20} {'bytes':>11} {'est. NPU us':>12} {'HBM bound us':>13} "
              f"{'of HBM BW':>10} {'add+norm us':>12} {'fused gain':>11}")
    print(f"PyPTO SIM (Ascend 910B2 cost model); HBM bound at {HBM_BYTES_PER_S / 1e12:.1f} TB/s")
    print(header + "\n" + "-" * len(header))
    with torch.inference_mode():
        for case in cases:
            inputs = build_inputs(case)
            args, kwargs = call_args(case, inputs)
            est, note = _pypto_estimate(case, args, kwargs)
            unfused = _unfused_estimate(case, inputs) if case["op"] == "add_rms_norm" and est else None
            nbytes = bytes_moved(case)
            bound = nbytes / HBM_BYTES_PER_S * 1e6
            rows.append({"id": case["id"], "op": case["op"], "description": case["description"], "bytes": nbytes,
                         "est_npu_us": est, "hbm_bound_us": bound, "hbm_fraction": (bound / est) if est else None,
                         "unfused_add_then_norm_us": unfused, "note": note})
            shape = str(tuple(next(iter(case["inputs"].values()))[0]))
            if est is None:
                print(f"{case['id']:<18} {case['op']:<13} {shape:<20} {nbytes:>11} {'fallback: ' + note}")
            else:
                tail = f" {unfused:>12.2f} {unfused / est:>10.2f}x" if unfused else ""
                print(f"{case['id']:<18} {case['op']:<13} {shape:<20} {nbytes:>11} {est:>12.2f} {bound:>13.2f} "
                      f"{bound / est:>9.1%}{tail}", flush=True)
    if json_path:
        write_json(json_path, {"bench": "pypto", "file": str(path), "hbm_bytes_per_s": HBM_BYTES_PER_S, "rows": rows})
        print(f"JSON written to {json_path}")
    if png_path:
        print(save_plot(png_path, lambda plt: _plot(plt, rows)))
    return 0


def _plot(plt, rows):
    ok = [r for r in rows if r["est_npu_us"]]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for op, marker in (("rms_norm", "o"), ("add_rms_norm", "s")):
        pts = [r for r in ok if r["op"] == op]
        ax.scatter([r["bytes"] for r in pts], [r["est_npu_us"] for r in pts], marker=marker, label=f"{op} (SIM)")
    xs = sorted(r["bytes"] for r in ok)
    ax.plot(xs, [b / HBM_BYTES_PER_S * 1e6 for b in xs], "k--", label="HBM bound")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes moved")
    ax.set_ylabel("µs")
    ax.set_title("PyPTO kernels: estimated 910B2 AICore time per captured case")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    return fig
