"""ShapeRecorder: the real shapes a model's norms see, recorded from a real run (SPEC 4).

Forward hooks on every RMSNorm site record, per call, the op the site runs (rms_norm; and
add_rms_norm where residual fusion applies, whether or not the model is patched, so a capture
does not depend on the patch state), the input shape, dtypes and eps, and the phase: `prefill`
for vision and for a forward that starts from an empty KV cache, `decode` after. A norm patched
in W8A8 mode runs the quant ops instead, and they are what is recorded (int8, with a smooth-scale
input when the model was calibrated). Distinct (op, phase, shapes, dtypes, eps, smoothing) become
cases; the sites and call counts are kept.

With `absmax=True` the hooks also keep each norm's per-channel max |output| (calibration.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .. import files
from ..patching import discovery, fusion
from ..patching.wrapper import site_of
from .cases import OP_SCHEMA, load_cases, read_json, tolerance

PHASE_ORDER = {"prefill": 0, "decode": 1}


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _cache_len(kwargs) -> int:
    for key in ("past_key_values", "cache"):
        cache = kwargs.get(key)
        if cache is not None and hasattr(cache, "get_seq_length"):
            return int(cache.get_seq_length())
    return 0


class ShapeRecorder:
    """`with ShapeRecorder(model) as rec: model.generate(...)`, then `rec.save(path)`."""

    def __init__(self, model: torch.nn.Module, absmax: bool = False):
        self.model = model
        self.records: dict = {}
        self.absmax: dict | None = {} if absmax else None  # norm path -> per-channel max |output| (fp32, [D])
        self._handles = []
        self._phase = "prefill"

    # -- hooks ------------------------------------------------------------------------------------
    def _sites(self):
        """(path, module, kind, eps, fusable, quant) for every RMSNorm site, patched or not."""
        modules = dict(self.model.named_modules())
        for path, module in modules.items():
            site = site_of(module)
            if site is not None:  # patched: no probe (it would count as a call)
                yield path, module, site.kind, site.eps, site.fused, site.quant
                continue
            cand = discovery.classify(path, module)
            if cand is None or not cand.is_rms:
                continue
            parent_path, _, attr = path.rpartition(".")
            parent = modules.get(parent_path)
            fusable = parent is not None and attr in fusion.fused_forward(type(parent), frozenset({attr}))[1]
            yield path, module, cand.kind, cand.eps, fusable, None

    def __enter__(self):
        self._handles.append(self.model.register_forward_pre_hook(self._on_model_forward, with_kwargs=True))
        for path, module, kind, eps, fusable, quant in list(self._sites()):
            hook = self._make_hook(path, kind, eps, fusable, quant)
            self._handles.append(module.register_forward_hook(hook, with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return False

    def _on_model_forward(self, module, args, kwargs):
        self._phase = "prefill" if _cache_len(kwargs) == 0 else "decode"

    def _make_hook(self, path, kind, eps, fusable, quant):
        smoothed = bool(quant and quant.inv_smooth is not None)

        def hook(module, args, kwargs, output):
            x = args[0] if args else kwargs["hidden_states"]
            w = module.weight
            phase = "prefill" if kind.startswith("vision") else self._phase
            shape, xd, wd = tuple(x.shape), _dtype_name(x.dtype), _dtype_name(w.dtype)
            q = quant is not None and x.dtype == w.dtype  # QuantNorm runs the float op otherwise
            ops = ("rms_norm_dynamic_quant", "add_rms_norm_dynamic_quant") if q else ("rms_norm", "add_rms_norm")
            self._add((ops[0], phase, shape, xd, tuple(w.shape), wd, eps, smoothed and q), kind)
            if fusable:
                self._add((ops[1], phase, shape, xd, tuple(w.shape), wd, eps, smoothed and q), kind)
            if self.absmax is not None:
                y = output[0] if isinstance(output, tuple) else output
                m = y.detach().abs().reshape(-1, y.shape[-1]).amax(0).to(torch.float32).cpu()
                self.absmax[path] = m if path not in self.absmax else torch.maximum(self.absmax[path], m)
        return hook

    def _add(self, key, kind):
        rec = self.records.setdefault(key, {"sites": [], "count": 0})
        rec["count"] += 1
        if kind not in rec["sites"]:
            rec["sites"].append(kind)

    # -- output -----------------------------------------------------------------------------------
    def cases(self, seed: int = 42) -> list[dict]:
        """The recorded shapes as SPEC 4 test cases, in a stable order with stable ids."""
        keys = sorted(self.records, key=lambda k: (list(OP_SCHEMA).index(k[0]), PHASE_ORDER[k[1]],
                                                   sorted(self.records[k]["sites"])[0], k[2], k[3], k[5], k[6],
                                                   k[7]))
        counters, out = {}, []
        for key in keys:
            op, phase, shape, xd, wshape, wd, eps, smoothed = key
            counters[op] = counters.get(op, 0) + 1
            rec = self.records[key]
            out.append(make_case(f"{op}_{counters[op]:03d}", op, phase, sorted(rec["sites"]), rec["count"], seed,
                                 list(shape), xd, list(wshape), wd, eps, smoothed))
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
            have = {case_key(c) for c in cases}
            counters = {}
            for c in cases:
                op, _, num = c["id"].rpartition("_")
                counters[op] = max(counters.get(op, 0), int(num) if num.isascii() and num.isdigit() else 0)
            added = 0
            for c in new:
                if case_key(c) not in have:
                    counters[c["op"]] = counters.get(c["op"], 0) + 1
                    c["id"] = f"{c['op']}_{counters[c['op']]:03d}"
                    cases.append(c)
                    added += 1
            model_name = model_name or existing.get("model")
        doc = {"model": model_name, "test_cases": cases}
        files.write_text(p, json.dumps(doc, indent=2) + "\n")
        return {"path": str(p), "cases": len(cases), "added": added}


def case_key(case: dict) -> tuple:
    inp = case["input"]
    first = inp.get("hidden_states") or inp.get("x1")
    return (case["op"], case.get("phase"), tuple(first["shape"]), first["dtype"], json.dumps(inp, sort_keys=True))


def make_case(cid, op, phase, sites, count, seed, shape, x_dtype, w_shape, w_dtype, eps, smoothed=False) -> dict:
    out_dtype = _dtype_name(torch.promote_types(getattr(torch, x_dtype), getattr(torch, w_dtype)))
    x = {"shape": shape, "dtype": x_dtype}
    w = {"shape": w_shape, "dtype": w_dtype}
    rows = {"shape": shape[:-1], "dtype": "float32"}
    codes = {"shape": shape, "dtype": "int8"}
    smooth = {"smooth_scale1": {"shape": w_shape, "dtype": x_dtype}} if smoothed else {}
    if op == "rms_norm":
        inputs = {"hidden_states": x, "weight": w, "eps": {"value": eps}}
        outputs = {"output": {"shape": shape, "dtype": out_dtype}}
    elif op == "add_rms_norm":
        inputs = {"x1": x, "x2": dict(x), "gamma": w, "eps": {"value": eps}}
        outputs = {"y": {"shape": shape, "dtype": out_dtype}, "x_out": dict(x)}
    elif op == "rms_norm_dynamic_quant":
        inputs = {"hidden_states": x, "weight": w, **smooth, "eps": {"value": eps}, "dst_type": {"value": "int8"}}
        outputs = {"y": codes, "scale": rows}
    else:
        inputs = {"x1": x, "x2": dict(x), "gamma": w, **smooth, "eps": {"value": eps}, "dst_type": {"value": "int8"}}
        outputs = {"y1": codes, "x_out": dict(x), "scale1": rows}
    tol = tolerance(out_dtype)
    return {"id": cid, "description": f"{'+'.join(sites)} {phase} {tuple(shape)} {x_dtype}", "op": op,
            "phase": phase, "sites": sites, "count": count, "seed": seed, "input": inputs, "output": outputs,
            "rtol": tol, "atol": tol}
