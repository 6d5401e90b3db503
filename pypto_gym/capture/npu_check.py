"""`pypto-gym cases check --backend npu`: the deployment-readiness report of a case file, without an NPU.

For every captured call (the model's real shapes), which torch_npu call the `npu` mapping makes and which it
declines, and why: the op's `supports` predicate on the chip named (`--chip`, its series read from the name as
the backend reads torch_npu's device name), each decline with the documented limit it comes from. With
`--torch-npu MODULE` the mapping also runs against that module as torch_npu (the contract tests' stand-in, which is
as strict as Ascend's documentation: tests/contract/torch_npu_standin.py) and the row says whether the module took
the call and whether the result meets the golden's precision rule. What an engineer reads before booking NPU time:
a call the mapping takes that the documentation refuses is the crash the report exists to find.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from collections import Counter
from pathlib import Path

import torch

from ..kernels.npu.backend import NpuBackend, chip_series
from ..ops import OPS
from ..precision import compare_outputs
from .cases import MAX_ELEMENTS, case_args, load_cases, printable


class ChipBackend(NpuBackend):
    """The npu mapping as it would run on `chip`, on CPU tensors: its series fixed by the chip's name, its torch_npu
    a module given by path or name (imported only when a call is made)."""

    devices = ("cpu",)

    def __init__(self, chip: str, module: str | None):
        super().__init__(module_name=module or "torch_npu")
        self.chip, self.module = chip, module

    def series(self, device_index) -> str:
        return chip_series(self.chip)

    def torch_npu(self):
        if self._module is None:
            if self.module and self.module.endswith(".py"):
                # a private module name: the file's own stem may already name a loaded module (a test's stand-in),
                # which registering over it would replace for everyone else
                name = f"pypto_gym_npu_check_{Path(self.module).stem}"
                spec = importlib.util.spec_from_file_location(name, self.module)
                self._module = importlib.util.module_from_spec(spec)
                sys.modules[name] = self._module
                spec.loader.exec_module(self._module)
                if hasattr(self._module, "DEVICE_NAME"):
                    self._module.DEVICE_NAME = self.chip  # a stand-in that reports the chip it stands for
            else:
                self._module = importlib.import_module(self.module_name)
        return self._module


def check_case(case: dict, backend: ChipBackend, run: bool) -> dict:
    """One case's row: the mapping's verdict (and, with `run`, the torch_npu module's and the precision rule's)."""
    op = OPS[case["op"]]
    impl = op.impls.get("npu")
    row = {"id": case["id"], "op": op.name, "description": case["description"], "torch_npu": None, "golden": None}
    if impl is None:
        row.update(mapping="declined", reason=op.unsupported.get("npu", f"{op.name} has no npu mapping"))
        return row
    args = case_args(case)
    reason = impl.supports(backend, *args) if impl.supports is not None else None
    row.update(mapping="declined" if reason else "takes", reason=reason or "")
    if reason or not run:
        return row
    try:
        with torch.inference_mode():
            out = impl.fn(backend, *args)
    except Exception as e:  # noqa: BLE001 - the module refused a call the mapping takes: the report's finding
        row["torch_npu"] = f"REFUSED: {str(e).splitlines()[0][:160] if str(e) else type(e).__name__}"
        return row
    comps = compare_outputs(out, op.golden(*args), op.outputs)
    row["torch_npu"] = "accepted"
    row["golden"] = "meets the rule" if all(c.passed for c in comps) else \
        "; ".join(f"{c.name}: {c.reason}" for c in comps if not c.passed)
    return row


def check_file(path, chip: str, module: str | None = None, max_elements=MAX_ELEMENTS) -> list[dict]:
    backend = ChipBackend(chip, module)
    return [check_case(case, backend, module is not None) for case in load_cases(path, max_elements)]


def format_report(rows: list[dict], chip: str) -> str:
    ran = any(r["torch_npu"] is not None for r in rows)
    header = f"{'id':<22} {'op':<28} {'description':<52} {'npu mapping':<12}" + (f" {'torch_npu':<10}" if ran else "")
    lines = [f"npu readiness on {chip} ({chip_series(chip)} series)", header, "-" * len(header)]
    for r in rows:
        cell = f" {(r['torch_npu'] or '-')[:10]:<10}" if ran else ""
        why = r["reason"] or (r["torch_npu"] if r["torch_npu"] and r["torch_npu"] != "accepted" else "") or \
            (r["golden"] if r["golden"] and r["golden"] != "meets the rule" else "")
        lines.append(f"{printable(r['id']):<22} {r['op']:<28} {printable(r['description'])[:52]:<52} "
                     f"{r['mapping']:<12}{cell}  {why}")
    lines.append(summary(rows))
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    taken = [r for r in rows if r["mapping"] == "takes"]
    reasons = Counter(r["reason"] for r in rows if r["mapping"] == "declined")
    text = f"{len(taken)} of {len(rows)} calls taken by the npu mapping, {len(rows) - len(taken)} declined"
    if any(r["torch_npu"] for r in rows):
        refused = sum(1 for r in taken if (r["torch_npu"] or "").startswith("REFUSED"))
        off = sum(1 for r in taken if r["golden"] not in (None, "meets the rule"))
        text += f"; torch_npu refused {refused} of the taken, {off} missed the golden's precision rule"
    for reason, n in reasons.most_common():
        text += f"\n  declined x{n}: {reason}"
    return text


def failed(rows: list[dict]) -> bool:
    """A call the mapping takes that the module refused or that missed the rule: the mapping is wrong there."""
    return any((r["torch_npu"] or "").startswith("REFUSED") or r["golden"] not in (None, "meets the rule")
               for r in rows if r["mapping"] == "takes")
