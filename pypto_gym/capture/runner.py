"""The case runner: every case of a file on one backend, against the golden, timed (SPEC 4, 5).

A case passes only if the backend asked for really ran it and its outputs meet the precision
rule. A backend that declined the call (capability) or raised (defect) leaves the case NOT RUN,
with the reason, which fails the run: a file of fallbacks to torch is not a passing kernel.
"""
from __future__ import annotations

import time
import warnings

import torch

from .. import config
from ..ops import OPS, Stats, registry
from ..precision import compare_outputs
from .cases import MAX_ELEMENTS, case_args, load_cases, printable


def _median_call_us(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e6


def run_case(case: dict, backend: str, repeat: int = 3) -> dict:
    """Run one validated case; returns a row with the worst metrics over its outputs and the verdict."""
    op = OPS[case["op"]]
    args = case_args(case)
    stats = Stats()
    with torch.inference_mode(), config.scoped(strict=False), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a defect is reported in the row, with its reason
        actual = op.call(args, backend, stats)
        last = getattr(registry.BACKENDS.get(stats.backend), "last_run", None)  # PyPTO: SIM estimate and level
        golden = op.golden(*args)
        timed = Stats()
        us = _median_call_us(lambda: op.call(args, backend, timed), repeat) if repeat else float("nan")
    comps = compare_outputs(actual, golden, op.outputs)
    problems = [f"{c.name}: {c.reason}" for c in comps if not c.passed]
    got = dict(zip([o.case_name for o in op.outputs], actual if isinstance(actual, tuple) else (actual,)))
    for name, (shape, dtype) in case["outputs"].items():
        t = got.get(name)
        if t is not None and (tuple(t.shape) != shape or t.dtype != dtype):
            problems.append(f"{name}: got {tuple(t.shape)} {t.dtype}, case declares {shape} {dtype}")
    not_run = "; ".join(stats.fallbacks) if stats.fallbacks else ""
    if not not_run and backend != "auto" and stats.backend != backend:
        not_run = f"ran on {stats.backend}, not {backend}"
    result = "NOT RUN" if not_run else ("FAIL" if problems else "PASS")
    return {"id": case["id"], "op": op.name, "description": case["description"], "backend": stats.backend,
            "requested": backend, "fallbacks": dict(stats.fallbacks), "max_abs": max(c.max_abs for c in comps),
            "cosine": min(c.cosine for c in comps), "mere": max(c.mere for c in comps),
            "mare": max(c.mare for c in comps), "us_per_call": us,
            "est_npu_us": last.estimated_us if last else None, "level": last.level if last else None,
            "tiles": last.tiles if last else None, "result": result,
            "passed": result == "PASS", "reason": not_run or "; ".join(problems)}


def run_file(path, backend: str = "auto", repeat: int = 3, progress=None, max_elements=MAX_ELEMENTS) -> list[dict]:
    registry.check_name(backend, "--backend")
    cases = load_cases(path, max_elements)
    rows = []
    for i, case in enumerate(cases):
        rows.append(run_case(case, backend, repeat))
        if progress:
            progress(i + 1, len(cases), rows[-1])
    return rows


def summary(rows: list[dict]) -> str:
    counts = {k: sum(r["result"] == k for r in rows) for k in ("PASS", "FAIL", "NOT RUN")}
    return f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['NOT RUN']} not run"


def format_table(rows: list[dict]) -> str:
    est = any(r.get("est_npu_us") is not None for r in rows)
    header = (f"{'id':<22} {'description':<58} {'ran on':<7} {'max abs':>9} {'cosine':>9} {'MERE':>9} "
              f"{'MARE':>9} {'us/call':>9}" + (f" {'est. NPU us':>11} {'level':<8}" if est else "") + "  result")
    lines = [header, "-" * len(header)]
    for r in rows:
        result = r["result"] + (f" {r['reason']}" if r["reason"] else "")
        est_cell = ""
        if est:
            est_cell = (f" {r['est_npu_us']:>11.2f} {r['level']:<8}" if r.get("est_npu_us") is not None
                        else f" {'':>11} {'':<8}")
        lines.append(f"{printable(r['id']):<22} {printable(r['description'])[:58]:<58} {r['backend'] or '':<7} "
                     f"{r['max_abs']:>9.3g} "
                     f"{r['cosine']:>9.6f} {r['mere']:>9.2e} {r['mare']:>9.2e} {r['us_per_call']:>9.1f}"
                     f"{est_cell}  {result}")
    lines.append(summary(rows))
    return "\n".join(lines)
