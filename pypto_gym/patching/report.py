"""The patch report: every candidate site, what happened to it and why, with live counters."""
from __future__ import annotations

from collections import Counter


class PatchReport:
    """`print(report)` gives a table; `report.to_json()` the JSON-ready dict of SPEC 3."""

    def __init__(self, state):
        self._state = state

    def to_json(self) -> dict:
        st = self._state
        sites = [e if isinstance(e, dict) else e.row() for e in st.entries]
        patched = [r for r in sites if r["status"] == "patched"]
        fallbacks = Counter()
        for r in patched:
            fallbacks.update(r["fallbacks"])
        return {
            "backend": st.backend, "cast_mode": st.cast_mode, "enabled": st.enabled(),
            "fuse_residual": st.fuse_residual, "sites_filter": st.patterns,
            "summary": {"candidates": len(sites), "patched": len(patched), "skipped": len(sites) - len(patched),
                        "fused_layers": len(st.layers), "calls": sum(r["calls"] for r in patched),
                        "fallbacks": dict(fallbacks)},
            "sites": sites,
            "fused_layers": [{"path": l.path, "norms": l.fused} for l in st.layers],
            "fusion_skipped": [dict(r) for r in st.fusion_skipped],
        }

    def __str__(self) -> str:
        d = self.to_json()
        s = d["summary"]
        lines = [f"pypto-gym patch report: {s['patched']}/{s['candidates']} norm sites patched, "
                 f"backend={d['backend']}, cast_mode={d['cast_mode']}, enabled={d['enabled']}, "
                 f"fused layers={s['fused_layers']}, calls={s['calls']}, fallbacks={sum(s['fallbacks'].values())}"]
        header = f"{'path':<52} {'kind':<30} {'status':<8} {'D':>5} {'dtype':<9} {'fused':<5} {'calls':>6}  fallbacks / reason"
        lines += [header, "-" * len(header)]
        for r in d["sites"]:
            extra = r["reason"] or ", ".join(f"{k} x{v}" for k, v in r.get("fallbacks", {}).items())
            lines.append(f"{r['path']:<52} {r['kind']:<30} {r['status']:<8} {r['D']:>5} {r['dtype']:<9} "
                         f"{'yes' if r.get('fused_residual') else '':<5} {r.get('calls', 0):>6}  {extra}")
        for r in d["fusion_skipped"]:
            lines.append(f"residual fusion skipped at {r['path']}: {r['reason']}")
        return "\n".join(lines)

    __repr__ = __str__
