"""ShapeRecorder: the real calls a model's sites make, recorded from a real run (SPEC 4).

Every call a patch site makes reaches `ops.dispatch.call`, which hands it to the active recorders:
the op, the site's kind and the arguments (kept as their case-file entries: shapes, dtypes and
scalar values, never the tensors). So what is recorded is exactly what runs: rms_norm at a plain
norm, add_rms_norm where a layer is fused, the quant ops and quant_matmul in W8A8 mode, the fused
MLP and rotary ops, whatever backend runs them. A model that is not patched is patched on the
`torch` backend for the recording (bit-identical to the unpatched model) and unpatched afterwards,
so a capture does not depend on the patch state. The phase is `prefill` for vision sites and for
a forward that starts from an empty KV cache, `decode` after. Distinct (op, phase, inputs) become
cases; the sites and call counts are kept. A call with a tensor above the case loader's cap (GutenOCR's
int8 lm_head weight, 311M elements) is not written, since no default `cases run` could load it: it is
counted per site in `too_large` and the capture says so.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .. import files
from ..ops import OPS, dispatch
from ..patching import api as patching
from .cases import MAX_ELEMENTS, input_key, load_cases, make_case, read_json

PHASE_ORDER = {"prefill": 0, "decode": 1}


def _cache_len(kwargs) -> int:
    for key in ("past_key_values", "cache"):
        cache = kwargs.get(key)
        if cache is not None and hasattr(cache, "get_seq_length"):
            return int(cache.get_seq_length())
    return 0


class CaseRecorder:
    """The calls of every site (every Stats with a `site`) filed as cases, while it is in dispatch.RECORDERS: the
    part of a recorder that needs no model (vLLM's shape capture uses it as it is: pypto_gym/vllm/report.py).
    `phase` is what the calls are filed under."""

    def __init__(self, phase: str = "prefill"):
        self.records: dict = {}  # (op, phase, inputs json) -> {"op", "phase", "args", "sites", "count"}
        self._phase = phase
        self.too_large: dict[str, int] = {}  # site kind -> calls not recorded (a tensor above MAX_ELEMENTS)

    def record(self, op, stats, args) -> None:
        """One site call (from dispatch.call): filed by op, phase and inputs."""
        kind = stats.site
        phase = "prefill" if kind.startswith("vision") else self._phase
        if any(isinstance(a, torch.Tensor) and a.numel() > MAX_ELEMENTS for a in args):
            self.too_large[kind] = self.too_large.get(kind, 0) + 1
            return
        probe = make_case("", op, args, phase, [kind], 1)
        key = input_key(probe)
        rec = self.records.get(key)
        if rec is None:
            rec = self.records[key] = {"case": probe, "sites": [], "count": 0}
        rec["count"] += 1
        if kind not in rec["sites"]:
            rec["sites"].append(kind)

    # -- output -----------------------------------------------------------------------------------
    def cases(self, seed: int = 42) -> list[dict]:
        """The recorded calls as SPEC 4 test cases, in a stable order with stable ids."""
        order = list(OPS)
        keys = sorted(self.records, key=lambda k: (order.index(k[0]), PHASE_ORDER.get(k[1], 2),
                                                   sorted(self.records[k]["sites"])[0], k[2]))
        counters, out = {}, []
        for key in keys:
            rec = self.records[key]
            case = dict(rec["case"])
            op = case["op"]
            counters[op] = counters.get(op, 0) + 1
            sites = sorted(rec["sites"])
            first = case["description"].split(" ", 1)[1]
            case.update(id=f"{op}_{counters[op]:03d}", sites=sites, count=rec["count"], seed=seed,
                        description=f"{'+'.join(sites)} {first}")
            out.append(case)
        return out

    def save(self, path, model_name: str | None = None, merge: bool = True, seed: int = 42) -> dict:
        """Write the cases (atomically); with merge, an existing file keeps its cases and gains only new ones.

        An existing file that is not a valid case file is refused (CaseError), never overwritten."""
        p = Path(path)
        new = self.cases(seed)
        cases, added = new, len(new)
        if merge and p.exists():
            load_cases(p, max_elements=None, allow_empty=True)  # refuse to merge into a non-case file
            existing = read_json(p)
            cases = existing["test_cases"]
            have = {input_key(c) for c in cases}
            counters = {}
            for c in cases:
                op, _, num = c["id"].rpartition("_")
                counters[op] = max(counters.get(op, 0), int(num) if num.isascii() and num.isdigit() else 0)
            added = 0
            for c in new:
                if input_key(c) not in have:
                    counters[c["op"]] = counters.get(c["op"], 0) + 1
                    c["id"] = f"{c['op']}_{counters[c['op']]:03d}"
                    cases.append(c)
                    added += 1
            model_name = model_name or existing.get("model")
        doc = {"model": model_name, "test_cases": cases}
        files.write_text(p, json.dumps(doc, indent=2) + "\n")
        return {"path": str(p), "cases": len(cases), "added": added}


class ShapeRecorder(CaseRecorder):
    """`with ShapeRecorder(model) as rec: model.generate(...)`, then `rec.save(path)`."""

    def __init__(self, model, **patch_options):
        super().__init__()
        self.model = model
        self.patch_options = {"backend": "torch", **patch_options}
        self._handle = None
        self._patched_here = False

    def __enter__(self):
        if patching.patch_report(self.model) is None:
            patching.patch_model(self.model, **self.patch_options)
            self._patched_here = True
        self._handle = self.model.register_forward_pre_hook(self._on_model_forward, with_kwargs=True)
        dispatch.RECORDERS.append(self)
        return self

    def __exit__(self, *exc):
        dispatch.RECORDERS.remove(self)
        self._handle.remove()
        if self._patched_here:
            patching.unpatch_model(self.model)
            self._patched_here = False
        return False

    def _on_model_forward(self, module, args, kwargs):
        self._phase = "prefill" if _cache_len(kwargs) == 0 else "decode"
