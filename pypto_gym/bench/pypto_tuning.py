"""`bench pypto --tune`: choose the PyPTO tile configuration per shape class on SIM's 910B2 model.

For every rms_norm / add_rms_norm case of a case file, each candidate (tile rows, merge count)
is compiled and costed in its own process (a compile error leaves PyPTO 0.2.0 unusable for the
rest of a process), and the fastest becomes the entry of its shape class in
`pypto_gym/kernels/pypto/tiling.json`, which the backend reads. Classes are (op, D, row
bucket), each tuned on its largest row count; a shape outside the table falls back to the
backend's rule. A configuration that crashes PyPTO or times out is reported "failed" and skipped.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from .. import files
from ..capture.cases import load_cases
from ..kernels.pypto import backend as pypto_backend
from ..kernels.pypto.backend import Tiles, bucket

TABLE = Path(pypto_backend.__file__).with_name("tiling.json")
ROWS = (1, 2, 4, 8)
NBUFFERS = (0, 4)  # the first full sweep (0/4/8/16) never found 8 or 16 best by more than its noise

WORKER = """
import json, sys, torch
from pypto_gym.kernels.pypto import backend as pypto_backend
op, R, D, rows, cols, nb = sys.argv[1], *map(int, sys.argv[2:])
pypto_backend.tile_config = lambda *a: pypto_backend.Tiles(rows, cols, nb)
pypto_backend._load_cached = lambda *a: False
from pypto_gym.ops import OPS
b = pypto_backend.PyptoBackend()
x1, x2, g = torch.randn(R, D).bfloat16(), torch.randn(R, D).bfloat16(), torch.randn(D).bfloat16()
args = (x1, g, 1e-6, "hf") if op == "rms_norm" else (x1, x2, g, 1e-6, "hf", "rounded")
OPS[op].impls["pypto"].fn(b, *args)
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


def tune(case_file, out_path=TABLE) -> dict:
    """Tune every (op, D, row bucket) class of the case file on its largest row count, and write the
    table after each class so an interrupted sweep resumes where it stopped (classes already in
    the table are kept)."""
    classes: dict = {}
    for c in load_cases(case_file):
        if c["op"] in ("rms_norm", "add_rms_norm"):
            shape = tuple(c["args"][0].shape)
            R, D = math.prod(shape[:-1]), shape[-1]
            key = f"{c['op']}:{D}:{bucket(R)}"
            classes[key] = max(classes.get(key, 0), R)
    table = json.loads(Path(out_path).read_text()) if Path(out_path).exists() else {}
    for key, R in sorted(classes.items()):
        if key in table:
            print(f"{key:<26} kept from {out_path}", flush=True)
            continue
        op, D = key.split(":")[0], int(key.split(":")[1])
        results = []
        for tiles in candidates(R, D):
            us = measure(op, R, D, tiles)
            print(f"{op:<13} R={R:<6} D={D:<5} tiles {str(tiles):<20} {'failed' if us is None else f'{us:8.2f} us'}",
                  flush=True)
            if us is not None:
                results.append((us, tiles))
        if results:
            best_us, best = min(results, key=lambda r: r[0])
            table[key] = {"rows": best.rows, "nbuffer": best.nbuffer, "tuned_on_rows": R, "us": round(best_us, 2)}
            files.write_text(out_path, json.dumps(table, indent=2, sort_keys=True) + "\n")
    return table
