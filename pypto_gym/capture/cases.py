"""pypto-gym's JSON test-case format (SPEC 4): schema, reading with clear refusals, building inputs.

A case names an op, its input shapes/dtypes/eps and a seed; inputs are regenerated from the seed,
so a file of thousands of real shapes stays a few kilobytes.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..precision import THRESHOLDS

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "int8": torch.int8}
FLOAT_NAMES = ("float16", "bfloat16", "float32")

# op -> (tensor inputs that have the activation shape, per-channel inputs, output names)
OP_SCHEMA = {
    "rms_norm": (("hidden_states",), ("weight",), ("output",)),
    "add_rms_norm": (("x1", "x2"), ("gamma",), ("y", "x_out")),
    "rms_norm_dynamic_quant": (("hidden_states",), ("weight", "smooth_scale1", "beta"), ("y", "scale")),
    "add_rms_norm_dynamic_quant": (("x1", "x2"), ("gamma", "smooth_scale1", "smooth_scale2", "beta"),
                                   ("y1", "y2", "x_out", "scale1", "scale2")),
}
REQUIRED_FIELDS = ("id", "op", "seed", "input", "output")


class CaseError(ValueError):
    """A malformed case file: names the file, the case id and the field."""


def _err(path, case_id, field, msg):
    return CaseError(f"{path}: case {case_id!r}: field '{field}': {msg}")


def _tensor_spec(path, cid, field, spec, allow_int=False):
    if not isinstance(spec, dict) or "shape" not in spec or "dtype" not in spec:
        raise _err(path, cid, field, "expected {\"shape\": [...], \"dtype\": ...}")
    shape, dtype = spec["shape"], spec["dtype"]
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise _err(path, cid, f"{field}.shape", f"got {shape!r}; expected a list of non-negative ints")
    allowed = FLOAT_NAMES + (("int8",) if allow_int else ())
    if dtype not in allowed:
        raise _err(path, cid, f"{field}.dtype", f"unknown dtype {dtype!r}; expected one of {', '.join(allowed)}")
    return tuple(shape), DTYPES[dtype]


def validate_case(case: dict, path="<cases>") -> dict:
    """Check one case and return a normalised copy: shapes as tuples, torch dtypes, eps float."""
    cid = case.get("id", "?") if isinstance(case, dict) else "?"
    if not isinstance(case, dict):
        raise _err(path, cid, "test_cases[]", "expected an object")
    for f in REQUIRED_FIELDS:
        if f not in case:
            raise _err(path, cid, f, "missing")
    op = case["op"]
    if op not in OP_SCHEMA:
        raise _err(path, cid, "op", f"unknown op {op!r}; expected one of {', '.join(OP_SCHEMA)}")
    acts, vectors, outputs = OP_SCHEMA[op]
    inputs = case["input"]
    if not isinstance(inputs, dict):
        raise _err(path, cid, "input", "expected an object")
    norm = {"id": cid, "op": op, "seed": case["seed"], "inputs": {}, "outputs": {}}
    if not isinstance(case["seed"], int):
        raise _err(path, cid, "seed", f"got {case['seed']!r}; expected an int")
    for name in acts:
        if name not in inputs:
            raise _err(path, cid, f"input.{name}", "missing")
        norm["inputs"][name] = _tensor_spec(path, cid, f"input.{name}", inputs[name])
    shape0, dtype0 = norm["inputs"][acts[0]]
    if not shape0:
        raise _err(path, cid, f"input.{acts[0]}.shape", "rank 0; expected [..., D]")
    D = shape0[-1]
    for name in acts[1:]:
        if norm["inputs"][name][0] != shape0:
            raise _err(path, cid, f"input.{name}.shape", f"got {list(norm['inputs'][name][0])}; "
                                                         f"expected {list(shape0)} (same as {acts[0]})")
    for name in vectors:
        if name not in inputs or inputs[name] is None:
            if name in ("weight", "gamma") and op.endswith("quant"):
                raise _err(path, cid, f"input.{name}", "missing")
            continue
        shape, dtype = _tensor_spec(path, cid, f"input.{name}", inputs[name])
        if int(torch.Size(shape).numel()) != D or len([s for s in shape if s != 1]) > 1:
            raise _err(path, cid, f"input.{name}.shape", f"got {list(shape)}; expected [{D}] (the hidden size "
                                                         f"of {acts[0]})")
        norm["inputs"][name] = (shape, dtype)
    eps = inputs.get("eps", {"value": 1e-6})
    if not isinstance(eps, dict) or not isinstance(eps.get("value"), (int, float)) or eps["value"] < 0:
        raise _err(path, cid, "input.eps", f"got {eps!r}; expected {{\"value\": <non-negative float>}}")
    norm["eps"] = float(eps["value"])
    norm["dst_type"] = inputs.get("dst_type", {"value": "int8"}).get("value", "int8") if op.endswith("quant") else None
    if not isinstance(case["output"], dict):
        raise _err(path, cid, "output", "expected an object")
    for name, spec in case["output"].items():
        norm["outputs"][name] = _tensor_spec(path, cid, f"output.{name}", spec, allow_int=True)
    unknown = set(norm["outputs"]) - set(outputs)
    if unknown:
        raise _err(path, cid, "output", f"unknown outputs {sorted(unknown)}; expected {list(outputs)}")
    norm["phase"], norm["sites"] = case.get("phase", ""), case.get("sites", [])
    norm["description"] = case.get("description", "")
    return norm


def load_cases(path) -> list[dict]:
    """Read and validate a case file; raises CaseError (never a bare traceback) on a malformed one."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise CaseError(f"{p}: no such file") from None
    except json.JSONDecodeError as e:
        raise CaseError(f"{p}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict) or not isinstance(data.get("test_cases"), list):
        raise CaseError(f"{p}: field 'test_cases': missing or not a list")
    cases = [validate_case(c, p) for c in data["test_cases"]]
    seen = set()
    for c in cases:
        if c["id"] in seen:
            raise CaseError(f"{p}: case {c['id']!r}: field 'id': duplicate")
        seen.add(c["id"])
    return cases


def build_inputs(case: dict) -> dict:
    """Deterministic inputs from the case's seed: activations ~ N(0,1), weights ~ 1 + 0.1 N(0,1)."""
    gen = torch.Generator().manual_seed(case["seed"])
    out = {}
    for name, (shape, dtype) in case["inputs"].items():
        x = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name in ("weight", "gamma"):
            x = 1 + 0.1 * x
        elif name.startswith("smooth"):
            x = 0.5 + torch.rand(shape, generator=gen)
        elif name == "beta":
            x = 0.1 * x
        out[name] = x.to(dtype)
    return out


def call_args(case: dict, inputs: dict) -> tuple[tuple, dict]:
    """Positional args and keywords for `pypto_gym.ops.<op>` / `reference.<op>`."""
    op, eps = case["op"], case["eps"]
    if op == "rms_norm":
        return (inputs["hidden_states"], inputs.get("weight"), eps), {}
    if op == "add_rms_norm":
        return (inputs["x1"], inputs["x2"], inputs.get("gamma"), eps), {}
    if op == "rms_norm_dynamic_quant":
        return (inputs["hidden_states"], inputs["weight"], inputs.get("smooth_scale1"), inputs.get("beta"), eps), \
            {"dst_type": case["dst_type"]}
    return (inputs["x1"], inputs["x2"], inputs["gamma"], inputs.get("smooth_scale1"), inputs.get("smooth_scale2"),
            inputs.get("beta"), eps), {"dst_type": case["dst_type"]}


def tolerance(dtype_name: str) -> float:
    return THRESHOLDS.get(DTYPES.get(dtype_name), 0.0)
