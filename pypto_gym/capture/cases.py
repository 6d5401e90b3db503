"""pypto-gym's JSON test-case format (SPEC 4): schema, reading with clear refusals, building inputs.

A case names an op, its input shapes/dtypes/eps and a seed; inputs are regenerated from the seed,
so a file of thousands of real shapes stays a few kilobytes. Everything read from a file is
checked before anything is allocated: a malformed case is refused naming the file, the case id
and the field, and a case larger than the element cap is refused before its tensors exist.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from ..precision import THRESHOLDS

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "int8": torch.int8}
FLOAT_NAMES = ("float16", "bfloat16", "float32")
DST_TYPES = ("int8", "int4")
MAX_SEED = 2 ** 64 - 1  # torch.Generator.manual_seed's range
MAX_ELEMENTS = 2 ** 27  # per tensor (512 MB in fp32); `cases run --max-elements` raises it
PROGRESS_BYTES = 16 * 2 ** 20  # files above this size say that they are being read

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


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite_number(v) -> bool:
    """An int or float that is finite as a float (a 401-digit integer is not: float() overflows)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def printable(text: str) -> str:
    """A case id (or any file-provided text) safe to print: control and other unprintable characters
    escaped, so an id cannot repaint the terminal (e.g. a fake PASS written over a FAIL)."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _tensor_spec(path, cid, field, spec, allowed=FLOAT_NAMES, max_elements=MAX_ELEMENTS):
    if not isinstance(spec, dict) or "shape" not in spec or "dtype" not in spec:
        raise _err(path, cid, field, "expected {\"shape\": [...], \"dtype\": ...}")
    shape, dtype = spec["shape"], spec["dtype"]
    if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
        raise _err(path, cid, f"{field}.shape", f"got {shape!r}; expected a list of non-negative ints")
    if not isinstance(dtype, str) or dtype not in allowed:
        raise _err(path, cid, f"{field}.dtype", f"unknown dtype {dtype!r}; expected one of {', '.join(allowed)}")
    n = math.prod(shape)
    if max_elements is not None and n > max_elements:
        raise _err(path, cid, f"{field}.shape", f"{shape} has {n:,} elements, above the cap of {max_elements:,} "
                                                 f"(raise it with --max-elements)")
    return tuple(shape), DTYPES[dtype]


def _choice_value(path, cid, field, spec, check):
    """`{"value": v}` fields (eps, dst_type): the value, or a refusal naming the field."""
    if not isinstance(spec, dict) or "value" not in spec:
        raise _err(path, cid, field, f"got {spec!r}; expected {{\"value\": ...}}")
    return check(spec["value"])


def validate_case(case: dict, path="<cases>", max_elements=MAX_ELEMENTS) -> dict:
    """Check one case and return a normalised copy: shapes as tuples, torch dtypes, eps float."""
    cid = case.get("id", "?") if isinstance(case, dict) else "?"
    if not isinstance(case, dict):
        raise _err(path, cid, "test_cases[]", "expected an object")
    for f in REQUIRED_FIELDS:
        if f not in case:
            raise _err(path, cid, f, "missing")
    if not isinstance(cid, str) or not cid:
        raise _err(path, cid, "id", f"got {cid!r}; expected a non-empty string")
    op = case["op"]
    if not isinstance(op, str) or op not in OP_SCHEMA:
        raise _err(path, cid, "op", f"unknown op {op!r}; expected one of {', '.join(OP_SCHEMA)}")
    seed = case["seed"]
    if not _is_int(seed) or not 0 <= seed <= MAX_SEED:
        raise _err(path, cid, "seed", f"got {seed!r}; expected an int in [0, 2^64)")
    for field in ("description", "phase"):
        if not isinstance(case.get(field, ""), str):
            raise _err(path, cid, field, f"got {case[field]!r}; expected a string")
    sites = case.get("sites", [])
    if not isinstance(sites, list) or not all(isinstance(s, str) for s in sites):
        raise _err(path, cid, "sites", f"got {sites!r}; expected a list of strings")
    acts, vectors, outputs = OP_SCHEMA[op]
    quant = op.endswith("quant")
    inputs = case["input"]
    if not isinstance(inputs, dict):
        raise _err(path, cid, "input", "expected an object")
    norm = {"id": cid, "op": op, "seed": seed, "inputs": {}, "outputs": {}}
    for name in acts:
        if name not in inputs:
            raise _err(path, cid, f"input.{name}", "missing")
        norm["inputs"][name] = _tensor_spec(path, cid, f"input.{name}", inputs[name], max_elements=max_elements)
    shape0, dtype0 = norm["inputs"][acts[0]]
    if not shape0:
        raise _err(path, cid, f"input.{acts[0]}.shape", "rank 0; expected [..., D]")
    D = shape0[-1]
    if D == 0:
        raise _err(path, cid, f"input.{acts[0]}.shape", f"got {list(shape0)}: last dim D is 0; expected D >= 1")
    for name in acts[1:]:
        if norm["inputs"][name] != (shape0, dtype0):
            raise _err(path, cid, f"input.{name}", f"got {list(norm['inputs'][name][0])} {norm['inputs'][name][1]}; "
                                                   f"expected {list(shape0)} {dtype0} (the same as {acts[0]})")
    for name in vectors:
        if name not in inputs or inputs[name] is None:
            if name in ("weight", "gamma") and quant:
                raise _err(path, cid, f"input.{name}", "missing")
            continue
        shape, dtype = _tensor_spec(path, cid, f"input.{name}", inputs[name], max_elements=max_elements)
        if math.prod(shape) != D or len([s for s in shape if s != 1]) > 1:
            raise _err(path, cid, f"input.{name}.shape", f"got {list(shape)}; expected [{D}] (the hidden size "
                                                         f"of {acts[0]})")
        if quant and dtype != dtype0:
            raise _err(path, cid, f"input.{name}.dtype", f"got {dtype}; the quant ops need {dtype0} (x's dtype)")
        norm["inputs"][name] = (shape, dtype)
    if quant and "smooth_scale2" in norm["inputs"] and "smooth_scale1" not in norm["inputs"]:
        raise _err(path, cid, "input.smooth_scale2", "given without smooth_scale1")

    def check_eps(v):
        if not _finite_number(v) or v < 0 or (quant and v == 0):
            raise _err(path, cid, "input.eps.value", f"got {v!r}; expected a finite number "
                                                     f"{'> 0 (quant ops)' if quant else '>= 0'}")
        return float(v)

    norm["eps"] = _choice_value(path, cid, "input.eps", inputs.get("eps", {"value": 1e-6}), check_eps)

    def check_dst(v):
        if v not in DST_TYPES:
            raise _err(path, cid, "input.dst_type.value", f"got {v!r}; expected one of {', '.join(DST_TYPES)}")
        return v

    norm["dst_type"] = _choice_value(path, cid, "input.dst_type", inputs.get("dst_type", {"value": "int8"}),
                                     check_dst) if quant else None
    if not isinstance(case["output"], dict):
        raise _err(path, cid, "output", "expected an object")
    for name, spec in case["output"].items():
        norm["outputs"][name] = _tensor_spec(path, cid, f"output.{name}", spec, FLOAT_NAMES + ("int8",), max_elements)
    unknown = set(norm["outputs"]) - set(outputs)
    if unknown:
        raise _err(path, cid, "output", f"unknown outputs {sorted(unknown)}; expected {list(outputs)}")
    for field in ("rtol", "atol"):
        if field in case and (not _finite_number(case[field]) or case[field] < 0):
            raise _err(path, cid, field, f"got {case[field]!r}; expected a finite number >= 0")
    if "count" in case and (not _is_int(case["count"]) or case["count"] < 0):
        raise _err(path, cid, "count", f"got {case['count']!r}; expected an int >= 0")
    norm["phase"], norm["sites"] = case.get("phase", ""), sites
    norm["description"] = case.get("description", "")
    return norm


def read_json(path):
    """A case file's JSON, or a CaseError naming the file (missing, a directory, not UTF-8, not JSON)."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > PROGRESS_BYTES:
            print(f"reading {p} ({size / 2 ** 20:.0f} MB)...", file=sys.stderr, flush=True)
        with open(p, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CaseError(f"{p}: no such file") from None
    except IsADirectoryError:
        raise CaseError(f"{p}: is a directory; expected a case file") from None
    except UnicodeDecodeError as e:
        raise CaseError(f"{p}: not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise CaseError(f"{p}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:
        raise CaseError(f"{p}: not a case file (JSON nested too deeply to read)") from None
    except ValueError as e:  # e.g. an integer literal past Python's digit limit
        raise CaseError(f"{p}: not a case file ({str(e).splitlines()[0][:120]})") from None
    except OSError as e:
        raise CaseError(f"{p}: cannot be read ({e.strerror or type(e).__name__})") from None


def load_cases(path, max_elements=MAX_ELEMENTS, allow_empty: bool = False) -> list[dict]:
    """Read and validate a case file; raises CaseError (never a bare traceback) on a malformed one, and on
    one with no cases unless `allow_empty` (a file to merge new cases into)."""
    p = Path(path)
    data = read_json(p)
    if not isinstance(data, dict) or not isinstance(data.get("test_cases"), list):
        raise CaseError(f"{p}: field 'test_cases': missing or not a list (expected a pypto-gym case file: "
                        f"{{\"test_cases\": [...]}})")
    if not data["test_cases"] and not allow_empty:
        raise CaseError(f"{p}: field 'test_cases': the list is empty; expected at least one case")
    cases = [validate_case(c, p, max_elements) for c in data["test_cases"]]
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
