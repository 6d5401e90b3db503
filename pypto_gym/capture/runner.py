"""The case runner: every case of a file on one backend, against the golden, timed (SPEC 4, 5)."""
from __future__ import annotations

import time

import torch

from .. import ops
from ..ops import reference, registry
from ..precision import compare_outputs
from .cases import OP_SCHEMA, build_inputs, call_args, load_cases


def _median_call_us(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e6


def run_case(case: dict, backend: str, repeat: int = 3) -> dict:
    """Run one validated case; returns a row with the worst metrics over its outputs and pass/fail."""
    inputs = build_inputs(case)
    args, kwargs = call_args(case, inputs)
    op = case["op"]
    stats = ops.Stats()
    fn = getattr(ops, op)
    with torch.inference_mode():
        actual = fn(*args, **kwargs, backend=backend, stats=stats)
        est_us = getattr(registry.BACKENDS.get(stats.backend), "last_estimated_us", None)
        golden = getattr(reference, op)(*args, **kwargs)
        us = _median_call_us(lambda: fn(*args, **kwargs, backend=backend), repeat) if repeat else float("nan")
    names = OP_SCHEMA[op][2]
    comps = compare_outputs(actual, golden, names)
    expected = case["outputs"]
    problems = [f"{c.name}: {c.reason}" for c in comps if not c.passed]
    got = dict(zip(names, actual if isinstance(actual, tuple) else (actual,)))
    for name, (shape, dtype) in expected.items():
        t = got.get(name)
        if t is not None and (tuple(t.shape) != shape or t.dtype != dtype):
            problems.append(f"{name}: got {tuple(t.shape)} {t.dtype}, case declares {shape} {dtype}")
    return {"id": case["id"], "op": op, "description": case["description"], "backend": stats.backend,
            "fallbacks": dict(stats.fallbacks), "max_abs": max(c.max_abs for c in comps),
            "cosine": min(c.cosine for c in comps), "mere": max(c.mere for c in comps),
            "mare": max(c.mare for c in comps), "us_per_call": us, "est_npu_us": est_us, "passed": not problems,
            "reason": "; ".join(problems)}


def run_file(path, backend: str = "auto", repeat: int = 3, progress=None) -> list[dict]:
    cases = load_cases(path)
    rows = []
    for i, case in enumerate(cases):
        rows.append(run_case(case, backend, repeat))
        if progress:
            progress(i + 1, len(cases), rows[-1])
    return rows


def format_table(rows: list[dict]) -> str:
    est = any(r.get("est_npu_us") is not None for r in rows)
    header = (f"{'id':<22} {'description':<58} {'ran on':<7} {'max abs':>9} {'cosine':>9} {'MERE':>9} "
              f"{'MARE':>9} {'us/call':>9}" + (f" {'est. NPU us':>11}" if est else "") + "  result")
    lines = [header, "-" * len(header)]
    for r in rows:
        result = "PASS" if r["passed"] else f"FAIL {r['reason']}"
        if r["fallbacks"]:
            result += f" (fallback: {', '.join(r['fallbacks'])})"
        lines.append(f"{r['id']:<22} {r['description'][:58]:<58} {r['backend'] or '':<7} {r['max_abs']:>9.3g} "
                     f"{r['cosine']:>9.6f} {r['mere']:>9.2e} {r['mare']:>9.2e} {r['us_per_call']:>9.1f}"
                     + (f" {r['est_npu_us']:>11.2f}" if est and r.get("est_npu_us") is not None else
                        f" {'':>11}" if est else "") + f"  {result}")
    n_fail = sum(not r["passed"] for r in rows)
    lines.append(f"{len(rows) - n_fail} passed, {n_fail} failed")
    return "\n".join(lines)
