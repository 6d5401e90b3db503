"""The patch report: every candidate site of every rule, what happened to it and why, with live counters.

`backend` in a site row is what actually produced that site's results ("cpu", or "cpu+torch"
when some calls fell back), not what was asked for (`requested_backend`). `op` is what the site
runs; `D`, `eps`, `dtype`, `device` are the rule's own fields (eps only for norms).
"""
from __future__ import annotations

from collections import Counter

from .site import site_label


class PatchReport:
    """`print(report)` gives a table; `report.to_json()` the JSON-ready dict of SPEC 3."""

    def __init__(self, state):
        self._state = state

    def to_json(self) -> dict:
        st = self._state
        sites = [dict(e) if isinstance(e, dict) else e.row() for e in st.entries]
        patched = [r for r in sites if r["status"] == "patched"]
        fallbacks, ran = Counter(), Counter()
        for r in patched:
            fallbacks.update(r["fallbacks"])
            ran.update(r["ran_on"])
        layers = [layer for layer in st.layers if layer.rejected is None]
        rejected = [{"path": layer.path, "reason": layer.rejected} for layer in st.layers if layer.rejected]
        by_op: dict = {}
        for r in sites:
            counts = by_op.setdefault(r["op"], {"candidates": 0, "patched": 0})
            counts["candidates"] += 1
            counts["patched"] += r["status"] == "patched"
        return {
            **st.options.to_json(), "enabled": st.enabled(),
            "summary": {"candidates": len(sites), "patched": len(patched), "skipped": len(sites) - len(patched),
                        "by_op": by_op,
                        "fused_layers": len(layers), "calls": sum(r["calls"] for r in patched),
                        "ran_on": dict(ran), "fallbacks": dict(fallbacks),
                        "fusion_bypassed": sum(sum(r["fusion_bypassed"].values()) for r in patched),
                        "bias_epilogue_linears": sum(len(r["bias_epilogue"]) for r in patched),
                        "backend_unavailable": dict(st.unavailable)},
            "sites": sites,
            "fused_layers": [{"path": layer.path, "norms": layer.fused} for layer in layers],
            "fusion_skipped": [dict(r) for r in st.fusion_skipped] + rejected,
            "w8a8": None if st.quant is None else st.quant.to_json(),
        }

    def __str__(self) -> str:
        d = self.to_json()
        s = d["summary"]
        ran = ", ".join(f"{k} x{v}" for k, v in s["ran_on"].items()) or "none yet"
        counts = ", ".join(f"{c['patched']}/{c['candidates']} {site_label(op)} sites patched"
                           for op, c in s["by_op"].items())
        lines = [f"pypto-gym patch report: {counts or 'no sites'}, "
                 f"backend={d['backend']}, cast_mode={d['cast_mode']}, enabled={d['enabled']}, "
                 f"fused layers={s['fused_layers']}, calls={s['calls']} (ran on: {ran}), "
                 f"fallbacks={sum(s['fallbacks'].values())}"]
        for device, reason in s["backend_unavailable"].items():
            lines.append(f"backend unavailable on {device}: {reason}")
        w = max([len(r["path"]) for r in d["sites"]] + [20])
        header = (f"{'path':<{w}} {'kind':<29} {'status':<8} {'D':>5} {'dtype':<9} {'backend':<10} {'fused':<5} "
                  f"{'calls':>6}  fallbacks / reason")
        lines += [header, "-" * len(header)]
        for r in d["sites"]:
            notes = [r["reason"]] if r["reason"] else [f"{k} x{v}" for k, v in r.get("fallbacks", {}).items()]
            for why, n in r.get("fusion_bypassed", {}).items():
                notes.append(f"fusion bypassed x{n} ({why})")
            if r.get("fused_into"):
                notes.append(f"fused into {r['fused_into']}")
            if r.get("bias_epilogue"):
                notes.append(f"bias in the GEMM epilogue: {', '.join(r['bias_epilogue'])}")
            if (r.get("rotary") or {}).get("rejected"):
                notes.append(f"rewrite rejected: {r['rotary']['rejected']}")
            if r.get("quant"):
                q = r["quant"]
                notes.append(f"int8 rows to {len(q['int8_to'])} linears{' (smoothed)' if q['smoothed'] else ''}")
                notes += [f"quant bypassed x{n} ({why})" for why, n in q["bypassed"].items()]
            if len(r["paths"]) > 1:
                notes.append("also at " + ", ".join(r["paths"][1:]))
            lines.append(f"{r['path']:<{w}} {r['kind']:<29} {r['status']:<8} {r['D'] or '':>5} {r['dtype'] or '':<9} "
                         f"{r['backend'] or '':<10} {'yes' if r.get('fused_residual') else '':<5} "
                         f"{r.get('calls', 0):>6}  {'; '.join(notes)}")
        for r in d["fusion_skipped"]:
            lines.append(f"residual fusion skipped at {r['path']}: {r['reason']}")
        if d["w8a8"] is not None:
            lines += _w8a8_lines(d["w8a8"])
        return "\n".join(lines)

    __repr__ = __str__


def _float_copies(s: dict) -> str:
    if s.get("loaded_int8"):
        return f"({s['loaded_int8']} loaded from an int8 checkpoint as stored: no float weights, no unpatch_model)"
    shared = (s["float_weight_bytes"] - s["releasable_float_bytes"]) / 2 ** 20
    if s["released_float_bytes"]:
        return (f"(float weights released: {s['released_float_bytes'] / 2 ** 20:.1f} MB returned, unpatch_model "
                f"refused; {shared:.1f} MB kept, shared with other modules: a tied lm_head's is the embedding's)")
    return (f"(float copies kept for unpatch_model; {s['releasable_float_bytes'] / 2 ** 20:.1f} MB of them not shared "
            f"with other modules)")


def _w8a8_lines(q: dict) -> list[str]:
    s = q["summary"]
    smoothing = f"smooth scales from {q['calibration']}" if q["smoothing"] else "no smoothing (no calibration file)"
    scheme = ("static per-tensor activation scales (msModelSlim W8A8)" if q.get("scheme") == "static" else
              "dynamic per-token activation scales")
    lines = [f"W8A8: {s['int8']}/{s['linears']} linears int8 ({s['quant_norms']} norms and {s['quant_mlps']} MLPs "
             f"emit int8 rows), {scheme}, {smoothing}; "
             f"int8 rows handed over x{s['handed_over']}, quantised in the linear x{s['quantized_here']}, "
             f"fallbacks={s['fallbacks']}; weights of the int8 linears {s['float_weight_bytes'] / 2 ** 20:.1f} MB "
             f"float -> {s['int8_weight_bytes'] / 2 ** 20:.1f} MB int8 " + _float_copies(s)]
    if q.get("recipe"):
        r = q["recipe"]
        lines.append(f"recipe (pypto-gym tune, {r['scheme']} scheme): {len(r['float_linears'])} linears float, "
                     f"per-source alpha; measured cosine {r['cosine']:.5f} for a target of {r['target_cosine']}")
    if q.get("int8_gemm"):
        lines.append(f"int8 GEMM on this CPU: {q['int8_gemm']}")
    if q.get("speed_note"):
        lines.append(f"note: {q['speed_note']}")
    for r in q["skipped_producers"]:
        lines.append(f"{r['path']} emits float rows: {r['reason']}")
    ignored = q["calibration_ignored"]
    if ignored:
        lines.append(f"calibration: {len(ignored)} smooth scales ignored, for norms and MLPs this patch does not "
                     f"quantise "
                     f"({', '.join(ignored[:3])}{', ...' if len(ignored) > 3 else ''})")
    w = max([len(r["path"]) for r in q["linears"]] + [20])
    header = f"{'linear':<{w}} {'became':<9} {'backend':<10} {'calls':>6}  input / fallbacks"
    lines += [header, "-" * len(header)]
    for r in q["linears"]:
        notes = [r["input"]] + [f"{k} x{v}" for k, v in r["fallbacks"].items()]
        if r.get("requantised"):
            notes.append(f"quantised again after its float weight changed x{r['requantised']}")
        lines.append(f"{r['path']:<{w}} {r['became']:<9} {r['backend'] or '':<10} {r['calls']:>6}  {'; '.join(notes)}")
    return lines
