"""What ran where inside vLLM, from every process of the engine, and the shapes its scheduler really produced.

vLLM runs its model in worker processes (one per tensor-parallel rank, beside the engine core): each writes
its own counters at exit (`start`), and `merged` adds them up, per op and provider: calls per backend that
produced the result, pypto-gym's own fallbacks and the calls declined to vLLM's native code, with reasons.
The shape capture is a CaseRecorder (capture/recorder.py) filing every provider call under phase "serving"
(vLLM mixes prefill chunks and decode tokens in one batch: a shape is a batch, not a phase).
"""
from __future__ import annotations

import atexit
import json
import os
from pathlib import Path

from .. import files

REPORT_PREFIX = "pypto_gym-vllm-"
CASES_PREFIX = "cases-"


def start(report_dir: str | None, capture_dir: str | None) -> None:
    """Write this process's counters (and recorded cases) into the folders at exit."""
    recorder = None
    if capture_dir:
        from ..capture.recorder import CaseRecorder
        from ..ops import dispatch

        recorder = CaseRecorder(phase="serving")
        dispatch.RECORDERS.append(recorder)
    if report_dir or recorder is not None:
        atexit.register(_write, report_dir, capture_dir, recorder)


def close(llm, timeout: float = 120.0) -> None:
    """Shut `llm`'s engine down and wait (up to `timeout` s) until its processes have exited, their reports written.

    Call it before `merged`. Left to itself, vLLM shuts its engine down at interpreter exit and gives the engine
    processes 5 s before it kills them: on a loaded machine an engine core can take longer, and a killed process
    writes no report (a test in CI saw one of two files)."""
    llm.llm_engine.engine_core.shutdown(timeout=timeout)


def _write(report_dir, capture_dir, recorder) -> None:
    from .providers import COUNTERS

    pid = os.getpid()
    if report_dir:
        Path(report_dir).mkdir(parents=True, exist_ok=True)
        files.write_text(Path(report_dir) / f"{REPORT_PREFIX}{pid}.json",
                         json.dumps({"pid": pid, "ops": COUNTERS.to_json()}, indent=2) + "\n")
    if recorder is not None and recorder.records:
        Path(capture_dir).mkdir(parents=True, exist_ok=True)
        recorder.save(Path(capture_dir) / f"{CASES_PREFIX}{pid}.json", model_name="vllm serving", merge=False)


def merged(report_dir) -> dict:
    """{"processes": [pids], "ops": {op: {"calls", "ran_on", "fallbacks", "declined"}}} over every process's file;
    processes that ran no provider call (vLLM's main process and engine core) count for nothing."""
    total: dict = {}
    pids = []
    for path in sorted(Path(report_dir).glob(f"{REPORT_PREFIX}*.json")):
        data = json.loads(path.read_text())
        pids.append(data["pid"])
        for op, row in data["ops"].items():
            mine = total.setdefault(op, {"calls": 0, "ran_on": {}, "fallbacks": {}, "declined": {}})
            mine["calls"] += row["calls"]
            for key in ("ran_on", "fallbacks", "declined"):
                for k, n in row[key].items():
                    mine[key][k] = mine[key].get(k, 0) + n
    return {"processes": pids, "ops": total}


def merge_cases(capture_dir, out) -> dict:
    """One case file from every process's (`pypto-gym cases run` runs it): cases equal in op, phase and inputs
    are one, their call counts added."""
    from ..capture.cases import input_key, read_json

    cases: dict = {}
    for path in sorted(Path(capture_dir).glob(f"{CASES_PREFIX}*.json")):
        for case in read_json(path)["test_cases"]:
            key = input_key(case)
            if key in cases:
                cases[key]["count"] += case["count"]
                cases[key]["sites"] = sorted(set(cases[key]["sites"]) | set(case["sites"]))
            else:
                cases[key] = case
    counters: dict = {}
    ordered = []
    for case in cases.values():
        counters[case["op"]] = counters.get(case["op"], 0) + 1
        ordered.append({**case, "id": f"{case['op']}_{counters[case['op']]:03d}"})
    files.write_text(out, json.dumps({"model": "vllm serving", "test_cases": ordered}, indent=2) + "\n")
    return {"path": str(out), "cases": len(ordered)}
