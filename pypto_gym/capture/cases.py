"""pypto-gym's JSON test-case format (SPEC 4): schema, reading with clear refusals, building inputs.

A case names an op, its inputs (tensors as shape and dtype, scalars as values) and a seed; inputs
are regenerated from the seed, so a file of thousands of real shapes stays a few kilobytes. The
schema of every op is its definition's (ops/defs/): the argument roles give the input fields (by
their case names: `hidden_states`, `weight` for rms_norm, as files have always called them), how each
is checked and how it is generated; the golden, run on meta tensors, gives the outputs. Everything
read from a file is checked before anything is allocated: a malformed case is refused naming the
file, the case id and the field, and a case larger than the element cap is refused before its
tensors exist.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from ..ops import OPS, ArgTypeError, ArgValueError, dtype_name
from ..ops.args import Tensor
from ..precision import THRESHOLDS

MAX_SEED = 2 ** 64 - 1  # torch.Generator.manual_seed's range
MAX_ELEMENTS = 2 ** 27  # per tensor (512 MB in fp32); `cases run --max-elements` raises it
PROGRESS_BYTES = 16 * 2 ** 20  # files above this size say that they are being read
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


def validate_case(case: dict, path="<cases>", max_elements=MAX_ELEMENTS) -> dict:
    """Check one case and return it normalised: `args` (meta tensors and values, in the op's argument
    order), `outputs` {name: (shape, dtype)}, and the descriptive fields."""
    cid = case.get("id", "?") if isinstance(case, dict) else "?"
    if not isinstance(case, dict):
        raise _err(path, cid, "test_cases[]", "expected an object")
    for f in REQUIRED_FIELDS:
        if f not in case:
            raise _err(path, cid, f, "missing")
    if not isinstance(cid, str) or not cid:
        raise _err(path, cid, "id", f"got {cid!r}; expected a non-empty string")
    name = case["op"]
    if not isinstance(name, str) or name not in OPS:
        raise _err(path, cid, "op", f"unknown op {name!r}; expected one of {', '.join(OPS)}")
    op = OPS[name]
    seed = case["seed"]
    if not _is_int(seed) or not 0 <= seed <= MAX_SEED:
        raise _err(path, cid, "seed", f"got {seed!r}; expected an int in [0, 2^64)")
    for field in ("description", "phase"):
        if not isinstance(case.get(field, ""), str):
            raise _err(path, cid, field, f"got {case[field]!r}; expected a string")
    sites = case.get("sites", [])
    if not isinstance(sites, list) or not all(isinstance(s, str) for s in sites):
        raise _err(path, cid, "sites", f"got {sites!r}; expected a list of strings")
    for field in ("rtol", "atol"):
        if field in case and (not _finite_number(case[field]) or case[field] < 0):
            raise _err(path, cid, field, f"got {case[field]!r}; expected a finite number >= 0")
    if "count" in case and (not _is_int(case["count"]) or case["count"] < 0):
        raise _err(path, cid, "count", f"got {case['count']!r}; expected an int >= 0")
    inputs = case["input"]
    if not isinstance(inputs, dict):
        raise _err(path, cid, "input", "expected an object")
    known = {a.case for a in op.args}
    unknown = sorted(set(inputs) - known)
    if unknown:
        raise _err(path, cid, "input", f"unknown inputs {unknown}; {name} takes {', '.join(a.case for a in op.args)}")
    field_of = {a.name: f"input.{a.case}" for a in op.args}
    args = []
    for a in op.args:
        entry = inputs.get(a.case)
        if a.case not in inputs or (entry is None and a.optional):
            if a.required and not a.optional:
                raise _err(path, cid, field_of[a.name], "missing")
            args.append(None if a.optional else a.default)
            continue
        try:
            args.append(a.from_case(entry, max_elements))
        except (ArgTypeError, ArgValueError) as e:
            raise _err(path, cid, _field(field_of[a.name], e), str(e).split(": ", 1)[1]) from None
    try:
        op.validate(tuple(args))
    except (ArgTypeError, ArgValueError) as e:
        raise _err(path, cid, _field(field_of.get(e.arg, "input"), e), str(e)) from None
    golden = op.golden(*args)  # on meta tensors: the outputs' shapes and dtypes
    golden = golden if isinstance(golden, tuple) else (golden,)
    produced = {o.case_name: (tuple(g.shape), g.dtype) for o, g in zip(op.outputs, golden) if g is not None}
    if not isinstance(case["output"], dict):
        raise _err(path, cid, "output", "expected an object")
    outputs = {}
    for out_name, spec in case["output"].items():
        if out_name not in produced:
            raise _err(path, cid, "output", f"unknown output {out_name!r}; {name} gives {', '.join(produced)} here")
        meta = _output_spec(path, cid, out_name, spec)
        if meta != produced[out_name]:
            raise _err(path, cid, f"output.{out_name}", f"declares {list(meta[0])} {dtype_name(meta[1])}; the op "
                                                       f"gives {list(produced[out_name][0])} "
                                                       f"{dtype_name(produced[out_name][1])} for these inputs")
        outputs[out_name] = meta
    return {"id": cid, "op": name, "seed": seed, "args": tuple(args), "outputs": outputs,
            "phase": case.get("phase", ""), "sites": sites, "description": case.get("description", "")}


def _field(base: str, error) -> str:
    return f"{base}.{error.aspect}" if error.aspect else base


def _output_spec(path, cid, name, spec):
    shape, dtype = (spec.get("shape"), spec.get("dtype")) if isinstance(spec, dict) else (None, None)
    from ..ops.args import DTYPE_NAMES

    if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape) or dtype not in DTYPE_NAMES:
        raise _err(path, cid, f"output.{name}", f"got {spec!r}; expected {{\"shape\": [...], \"dtype\": ...}}")
    return tuple(shape), DTYPE_NAMES[dtype]


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


def tolerance(dtype) -> float:
    return THRESHOLDS.get(dtype, 0.0)


def case_args(case: dict) -> tuple:
    """The op's positional arguments for a validated case: tensors regenerated from its seed, in argument order."""
    op = OPS[case["op"]]
    gen = torch.Generator().manual_seed(case["seed"])
    return tuple(a.generate(v, gen) if isinstance(v, torch.Tensor) else v for a, v in zip(op.args, case["args"]))


def make_case(cid: str, op, args: tuple, phase: str, sites: list, count: int, seed: int = 42) -> dict:
    """A case for one recorded call: inputs as the op's case fields, outputs from the golden on meta tensors."""
    metas = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
    inputs = {}
    for a, v in zip(op.args, metas):
        entry = a.to_case(v)
        if entry is not None:
            inputs[a.case] = entry
    golden = op.golden(*metas)
    golden = golden if isinstance(golden, tuple) else (golden,)
    outputs = {o.case_name: {"shape": list(g.shape), "dtype": dtype_name(g.dtype)}
               for o, g in zip(op.outputs, golden) if g is not None}
    first = metas[op.device_index]
    floats = [g.dtype for g in golden if g is not None and g.is_floating_point()]
    tol = tolerance(floats[0]) if floats else 0.0
    return {"id": cid, "description": f"{'+'.join(sites)} {phase} {tuple(first.shape)} {dtype_name(first.dtype)}",
            "op": op.name, "phase": phase, "sites": sites, "count": count, "seed": seed, "input": inputs,
            "output": outputs, "rtol": tol, "atol": tol}


def input_key(case: dict) -> tuple:
    """What makes two cases the same: op, phase and inputs (not ids, sites or counts), an input a file leaves
    out counted as its default (files written before an argument existed merge with new captures)."""
    op, inputs = OPS.get(case["op"]), case["input"]
    if op is None:
        return case["op"], case.get("phase"), json.dumps(inputs, sort_keys=True)
    full = [inputs.get(a.case) if a.case in inputs or isinstance(a, Tensor) else a.to_case(a.default) for a in op.args]
    return case["op"], case.get("phase"), json.dumps(full, sort_keys=True)
