"""`bench pypto --tune`: choose the PyPTO tile configuration per shape class on SIM's 910B2 model.

For every rms_norm / add_rms_norm case of a case file, each candidate (tile rows, merge count)
is compiled and costed in its own process (a compile error leaves PyPTO 0.2.0 unusable for the
rest of a process), and the fastest becomes the entry of its shape class in
`pypto_gym/ops/backends/pypto_tiling.json`, which the backend reads. Classes are (op, D, row
bucket); a shape outside the table falls back to the backend's rule.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .. import files
from ..capture.cases import load_cases
from ..ops.backends import pypto_backend
from ..ops.backends.pypto_backend import Tiles, bucket

ROWS = (1, 2, 4, 8)
NBUFFERS = (0, 4, 8, 16)

WORKER = """
import json, sys, torch
from pypto_gym.ops.backends import pypto_backend
op, R, D, rows, cols, nb = sys.argv[1], *map(int, sys.argv[2:])
pypto_backend.tile_config = lambda *a: pypto_backend.Tiles(rows, cols, nb)
pypto_backend._load_cached = lambda *a: False
b = pypto_backend.PyptoBackend()
x1, x2, g = torch.randn(R, D).bfloat16(), torch.randn(R, D).bfloat16(), torch.randn(D).bfloat16()
(b.rms_norm(x1, g, 1e-6, "hf") if op == "rms_norm" else b.add_rms_norm(x1, x2, g, 1e-6, "hf"))
print(json.dumps({"us": b.last_run.estimated_us, "level": b.last_run.level}))
"""


def candidates(R: int, D: int):
    cols = pypto_backend.tile_config("rms_norm", R, D).cols
    per_row = cols * 4 * pypto_backend.LIVE_FP32_ROWS
    for rows in ROWS:
        if rows <= max(R, 1) and rows * per_row <= pypto_backend.UB_BYTES:
            for nb in NBUFFERS:
                yield Tiles(rows, cols, nb)


def measure(op: str, R: int, D: int, tiles: Tiles) -> float | None:
    """PyPTO's estimated AICore µs for one configuration, in a fresh process (None if it fails)."""
    proc = subprocess.run([sys.executable, "-c", WORKER, op, str(R), str(D), str(tiles.rows), str(tiles.cols),
                           str(tiles.nbuffer)], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 or not proc.stdout.strip():
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])["us"]


def tune(case_file, out_path=None) -> dict:
    shapes = sorted({(c["op"], c["inputs"][next(iter(c["inputs"]))][0]) for c in load_cases(case_file)
                     if c["op"] in ("rms_norm", "add_rms_norm")})
    table: dict = {}
    for op, shape in shapes:
        D, R = shape[-1], 1
        for s in shape[:-1]:
            R *= s
        results = []
        for tiles in candidates(R, D):
            us = measure(op, R, D, tiles)
            print(f"{op:<13} R={R:<6} D={D:<5} tiles {str(tiles):<20} {'failed' if us is None else f'{us:8.2f} us'}",
                  flush=True)
            if us is not None:
                results.append((us, tiles))
        if not results:
            continue
        key = f"{op}:{D}:{bucket(R)}"
        best_us, best = min(results, key=lambda r: r[0])
        entry = table.setdefault(key, {"rows": best.rows, "nbuffer": best.nbuffer, "us": {}})
        entry["us"][str(R)] = round(best_us, 2)
        if (best.rows, best.nbuffer) != (entry["rows"], entry["nbuffer"]):  # a class tuned on several R: keep the
            entry["note"] = "rows differ within this class; the first shape's best is kept"  # first, say so
    if out_path:
        files.write_text(out_path, json.dumps(table, indent=2, sort_keys=True) + "\n")
    return table


def main(case_file, out_path=Path(pypto_backend.__file__).with_name("pypto_tiling.json")) -> int:
    table = tune(case_file, out_path)
    print(json.dumps(table, indent=2))
    return 0
