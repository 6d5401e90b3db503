"""`bench cases FILE` and `bench pypto FILE`: every captured case timed, and costed on the NPU model.

`cases` times each case on each CPU backend (interleaved medians) and, when `pypto` is among the
backends, adds SIM's estimated AICore microseconds. `pypto` puts that estimate next to the bytes
the op must move and the time the 910B's HBM needs for them, i.e. how close the kernel gets to
the memory-bound limit an RMSNorm lives at.
"""
from __future__ import annotations

import torch

from ..capture.cases import case_args, load_cases, printable
from ..ops import OPS, Stats, registry
from ..ops.defs.rms_norm import pypto_residual_add
from .timing import interleaved_medians, save_plot, write_json

HBM_BYTES_PER_S = 1.6e12  # Ascend 910B HBM2e, as SIM's 910B2 model assumes (datasheet figure)


def bytes_moved(case: dict) -> int:
    """Bytes an op reads and writes at least once: every input tensor and every declared output."""
    total = 0
    tensors = [(tuple(t.shape), t.dtype) for t in case["args"] if isinstance(t, torch.Tensor)]
    for shape, dtype in tensors + list(case["outputs"].values()):
        total += int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    return total


def _pypto_run(case, args):
    """(RunInfo of the pypto call, "") or (None, the fallback reason)."""
    stats = Stats()
    OPS[case["op"]].call(args, "pypto", stats)
    if stats.fallbacks:
        return None, next(iter(stats.fallbacks))
    return registry.get("pypto").last_run, ""


def _pypto_estimate(case, args):
    run, note = _pypto_run(case, args)
    return (None if run is None else run.estimated_us), note


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
            args = case_args(case)
            op = OPS[case["op"]]
            t = interleaved_medians({b: (lambda b=b: op.call(args, b, None)) for b in timed}, rounds=rounds)
            row = {"id": case["id"], "op": case["op"], "description": case["description"],
                   **{f"{b}_us": t[b] * 1e6 for b in timed}}
            if "pypto" in backends:
                row["est_npu_us"], row["pypto_note"] = _pypto_estimate(case, args)
            rows.append(row)
            shape = str(tuple(case["args"][0].shape))
            line = f"{printable(case['id']):<18} {case['op']:<13} {shape:<20} " + " ".join(f"{row[b + '_us']:>11.1f}" for b in timed)
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


def _unfused_estimate(case, args):
    """For add_rms_norm cases: PyPTO's estimate of a separate add kernel plus rms_norm on its result."""
    backend = registry.get("pypto")
    x1, x2, gamma, eps, cast_mode = args
    x_out = pypto_residual_add(backend, x1, x2)
    add_us = backend.last_run.estimated_us
    norm_us, _ = _pypto_estimate({"op": "rms_norm"}, (x_out, gamma, eps, cast_mode))
    return add_us + norm_us if add_us is not None and norm_us is not None else None


BOUND_GOAL = 0.70  # of the HBM bound, for prefill and vision cases
DECODE_GOAL_US = 2.0


def _goals(case, est, bound, unfused) -> list[str]:
    """This case's goals (issue 12): 70% of the HBM bound at prefill, <= 2 us at decode, fused cheaper."""
    out = []
    if case.get("phase") == "decode":
        out.append("PASS" if est <= DECODE_GOAL_US else "FAIL")
    else:
        out.append("PASS" if bound / est >= BOUND_GOAL else "FAIL")
    if unfused is not None:
        out.append("PASS" if est < unfused else "FAIL")
    return out


def run_pypto(path, json_path=None, png_path=None, tune=False) -> int:
    """Per case: PyPTO's AICore estimate, the HBM bound, the tiles, the goals; exit 1 if a goal is missed."""
    if tune:
        from ..ops.backends import pypto_backend
        from . import pypto_tuning

        pypto_tuning.tune(path)
        pypto_backend.clear_tuned()
    cases = load_cases(path)
    rows = []
    header = (f"{'id':<18} {'op':<13} {'phase':<8} {'shape':<16} {'est us':>8} {'HUB us':>7} {'bound us':>9} "
              f"{'of bound':>9} {'tiles':<18} {'goal':<5} {'add+norm us':>12} {'fused':<5}")
    print(f"PyPTO SIM, Ascend 910B2 cost model. est us: PyPTO's AICore end-to-end time (AIC/AIV tasks; the HUB "
          f"core's completion task and kernel launch overhead not included). HBM bound: bytes moved at "
          f"{HBM_BYTES_PER_S / 1e12:.1f} TB/s. Goals: >= {BOUND_GOAL:.0%} of the bound at prefill, <= "
          f"{DECODE_GOAL_US:g} us at decode, fused add+norm cheaper than add then norm.")
    print(header + "\n" + "-" * len(header))
    with torch.inference_mode():
        for case in cases:
            inputs = build_inputs(case)
            args, kwargs = call_args(case, inputs)
            run, note = _pypto_run(case, args, kwargs)
            shape = str(tuple(case["args"][0].shape))
            nbytes = bytes_moved(case)
            bound = nbytes / HBM_BYTES_PER_S * 1e6
            row = {"id": case["id"], "op": case["op"], "phase": case.get("phase"), "shape": shape,
                   "description": case["description"], "bytes": nbytes, "hbm_bound_us": bound, "note": note}
            if run is None:
                rows.append({**row, "est_npu_us": None, "goals": ["FAIL"]})
                print(f"{printable(case['id']):<18} {case['op']:<13} {case.get('phase', ''):<8} {shape:<16} fallback: {note}")
                continue
            est = run.estimated_us
            unfused = _unfused_estimate(case, args) if case["op"] == "add_rms_norm" else None
            goals = _goals(case, est, bound, unfused)
            rows.append({**row, "est_npu_us": est, "hub_us": run.hub_us, "level": run.level, "tiles": run.tiles,
                         "hbm_fraction": bound / est, "unfused_add_then_norm_us": unfused, "goals": goals})
            tail = f" {unfused:>12.2f} {goals[1]:<5}" if unfused is not None else ""
            print(f"{printable(case['id']):<18} {case['op']:<13} {case.get('phase', ''):<8} {shape:<16} {est:>8.2f} "
                  f"{run.hub_us:>7.2f} {bound:>9.2f} {bound / est:>8.1%} {run.tiles:<18} {goals[0]:<5}{tail}",
                  flush=True)
    passed = sum(g == "PASS" for r in rows for g in r["goals"])
    total = sum(len(r["goals"]) for r in rows)
    print(f"\ngoals met: {passed}/{total}")
    if json_path:
        write_json(json_path, {"bench": "pypto", "file": str(path), "hbm_bytes_per_s": HBM_BYTES_PER_S,
                               "bound_goal": BOUND_GOAL, "decode_goal_us": DECODE_GOAL_US, "rows": rows})
        print(f"JSON written to {json_path}")
    if png_path:
        print(save_plot(png_path, lambda plt: _plot(plt, rows)))
    return 0 if passed == total else 1


def _plot(plt, rows):
    ok = [r for r in rows if r["est_npu_us"]]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for op, marker in (("rms_norm", "o"), ("add_rms_norm", "s")):
        pts = [r for r in ok if r["op"] == op]
        ax.scatter([r["bytes"] for r in pts], [r["est_npu_us"] for r in pts], marker=marker, label=f"{op} (SIM)")
    xs = sorted(r["bytes"] for r in ok)
    ax.plot(xs, [b / HBM_BYTES_PER_S * 1e6 for b in xs], "k--", label="HBM bound")
    ax.plot(xs, [b / HBM_BYTES_PER_S * 1e6 / BOUND_GOAL for b in xs], "k:", label=f"{BOUND_GOAL:.0%} of the bound")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes moved")
    ax.set_ylabel("µs")
    ax.set_title("PyPTO kernels: estimated 910B2 AICore time per captured case (launch overhead not included)")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    return fig
