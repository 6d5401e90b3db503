"""The `pypto` backend's machinery: compiling and running PyPTO JIT kernels, and what a SIM run tells.

Each op's module here (kernels/pypto/<op>.py) writes its PyPTO kernel as a factory `kernel(pypto) -> function` (so PyPTO is
imported only when a kernel is first needed) and launches it with `backend.launch(...)`. Kernels
see 2-D row tensors [R, D] and per-channel vectors as [1, D] (the rotary kernels: [tokens, heads,
D]), take their tile shape (rows, cols; rows, heads, cols) as the last arguments, and follow two rules PyPTO 0.2.0 imposes: outputs are assigned last,
in the order they are declared (PyPTO numbers outputs by first assignment, which is how this
module matches the verification dumps to outputs), and no tensor is read after it has been
assigned to an output. Shared helpers for kernel bodies live in lib.py.

NPU tensors run the kernels with RunMode.NPU. CPU tensors run the same kernels through PyPTO's
compiler in RunMode.SIM: PyPTO executes the compiled program with its CPU calculator after its
compile passes and checks each pass against the untiled tensor graph; the numbers returned are
the compiled program's (`last_run.level == "compiled"`), or the graph's where PyPTO left no
compiled dump (`"graph"`). SIM's cost model (an Ascend 910B2) gives the estimated AICore time of
the call. On CPU this backend verifies kernels and estimates NPU time; it is not for speed.

PyPTO 0.2.0 compiles and simulates on every SIM call (it cannot run a cached program on CPU), so
each call's result (outputs, verdicts, estimate) is cached on disk, keyed by everything that
decides it: the inputs' bytes, the kernel's source, tile configuration and scalars, and the
source of this machinery. Adaptations of PyPTO 0.2.0 internals live in compat.py.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import shutil
import stat
import sys
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ... import files
from ...ops import registry
from ...ops.registry import Backend, register
from .budget import A2A3, LIVE_FP32_TILES, Budget, BudgetError, problem

UB_BYTES = A2A3.ub  # the unified buffer of an A2/A3 vector core
MASKED = -1e30  # an additive score bias that masks a key (exp underflows to 0 in fp32)
LIVE_FP32_ROWS = LIVE_FP32_TILES  # x, the normalised row and one temporary, all fp32, live in one tile
_SOURCES = [Path(__file__).with_name(n) for n in ("lib.py", "backend.py", "compat.py")]


@dataclass(frozen=True)
class Tiles:
    """How a call is cut: (rows, cols) per tile, and how many same-shaped tiles make one task."""

    rows: int
    cols: int
    nbuffer: int = 0  # PyPTO's vec_nbuffer_setting; 0 keeps its default merging
    heads: int = 0  # 3-D tiles (rows, heads, cols) for [tokens, heads, D] kernels; 0: 2-D rows

    @property
    def shape(self) -> tuple:
        return (self.rows, self.heads, self.cols) if self.heads else (self.rows, self.cols)

    def __str__(self):
        return "x".join(map(str, self.shape)) + (f" nbuffer {self.nbuffer}" if self.nbuffer else "")


def bucket(R: int) -> str:
    """The row classes tiles are tuned for."""
    return "decode" if R <= 8 else "small" if R <= 128 else "medium" if R <= 1024 else "large"


@functools.lru_cache(maxsize=1)
def _tuned() -> dict:
    path = Path(__file__).with_name("tiling.json")
    return json.loads(path.read_text()) if path.exists() else {}


def clear_tuned() -> None:
    """Re-read tiling.json on the next call (after `bench pypto --tune` rewrote it)."""
    _tuned.cache_clear()


def tile_config(op: str, R: int, D: int, align: int = 16) -> Tiles:
    """The tile configuration for one call. Columns: the reduce axis stays whole where one fp32 row
    fits the unified buffer (reference 000's advice), padded by PyPTO to 32-byte rows, so D need
    not be a multiple of 8; wider rows are split and PyPTO reduces across column tiles. Rows and
    the merge count: from tiling.json for the shape classes tuned on SIM's 910B2 cost model
    (`scripts/bench.py pypto FILE --tune`), else as many rows as fit, up to 8."""
    cols = -(-D // align) * align  # 32-byte rows for the narrowest dtype in the tile (int8 outputs: 32)
    per_row = cols * 4 * LIVE_FP32_ROWS
    if per_row > UB_BYTES:  # split reduction: the fewest equal column tiles that fit
        parts = -(-per_row // UB_BYTES)
        return Tiles(1, -(-cols // parts // align) * align)
    tuned = _tuned().get(f"{op}:{D}:{bucket(R)}")
    if tuned:
        return Tiles(tuned["rows"], cols, tuned["nbuffer"])
    rows = 1
    while rows * 2 * per_row <= UB_BYTES and rows < 8 and rows < R:
        rows *= 2
    return Tiles(rows, cols)


@dataclass
class RunInfo:
    """What one CPU (SIM) call produced besides its outputs."""

    estimated_us: float  # PyPTO's AICore end-to-end time (launch overhead not modelled)
    hub_us: float  # how much later the HUB core's completion task ends
    level: str  # "compiled" or "graph": which program produced the numbers returned
    verdicts: dict = field(default_factory=dict)  # PyPTO's own check of each verified pass
    tiles: str = ""
    cached: bool = False

    @classmethod
    def of_launches(cls, runs: list["RunInfo"]) -> "RunInfo":
        """One call made of several launches (a kernel whose program PyPTO's simulator cannot take whole): the
        estimates add up, the level and verdicts are the weakest seen, cached only if every launch was."""
        if len(runs) == 1:
            return runs[0]
        verdicts = {}
        for r in runs:
            for k, v in r.verdicts.items():
                verdicts[k] = v if verdicts.get(k, "PASS") == "PASS" else verdicts[k]
        return cls(sum(r.estimated_us for r in runs), sum(r.hub_us for r in runs),
                   "compiled" if all(r.level == "compiled" for r in runs) else "graph", verdicts,
                   " ".join(dict.fromkeys(r.tiles for r in runs)) + f" ({len(runs)} launches)",
                   all(r.cached for r in runs))


class PyptoBackend(Backend):
    name = "pypto"
    devices = ("cpu", "npu")

    def __init__(self):
        self._kernels = {}
        self._error = None
        self._poisoned = None
        self.last_run: RunInfo | None = None

    def unavailable_reason(self):
        if self._error is None:
            try:
                from . import compat as pypto_compat

                pypto_compat.check_version()
            except Exception as e:  # noqa: BLE001 - missing or unsupported pypto is a reason, not a crash
                self._error = str(e)
            else:
                self._error = ""
        if self._error or self._poisoned:
            return self._error or self._poisoned
        return None

    @staticmethod
    def runs_on(t: torch.Tensor) -> str | None:
        """Why a tensor's device cannot run here (None if it can): NPU tensors need torch_npu imported."""
        return "torch_npu not imported" if t.device.type == "npu" and not hasattr(torch, "npu") else None

    # -- plumbing ---------------------------------------------------------------------------------
    def _kernel(self, device_type: str, name: str, factory, nbuffer: int):
        import pypto

        from . import compat as pypto_compat

        pypto_compat.apply()
        mode = pypto.RunMode.NPU if device_type == "npu" else pypto.RunMode.SIM
        key = (name, factory, mode, nbuffer)  # one name may launch several kernels (varlen_attention: two)
        if key not in self._kernels:
            opts = {"runtime_options": {"run_mode": mode}}
            if nbuffer:
                opts["pass_options"] = {"vec_nbuffer_setting": {-1: nbuffer}}
            if mode == pypto.RunMode.SIM:
                # verified after the deepest pass that still holds whole tensors, and the last pass before codegen
                opts["verify_options"] = {"enable_pass_verify": True,
                                          "pass_verify_pass_filter": ["InferDynShape", "CodegenPreproc"]}
            self._kernels[key] = pypto.frontend.jit(**opts)(factory(pypto))
        return self._kernels[key]

    def launch(self, name: str, factory, x: torch.Tensor, inputs: list, outputs: list, scalars: list,
               tiles: "Tiles | None" = None, align: int = 16, kinds: tuple | None = None,
               budget: Budget | None = None):
        """Run kernel `name` (made by `factory(pypto)`) on 2-D `inputs`, writing `outputs` in place; tiles
        from the tuning table / the default rule for x's rows unless given. On CPU: record `last_run`,
        served from the result cache if this exact call was verified before. `kinds`: SPEC 5's kind of each output
        for PyPTO's pass verification (precision.compare), None to judge by the dtype. `budget`: the launch's tiles
        (default: the vector tile alone, LIVE_FP32_ROWS live), refused with BudgetError before anything compiles
        where the chip cannot hold them (budget.py; an op's `supports` declines such calls first)."""
        from . import compat as pypto_compat

        R, D = x.numel() // x.shape[-1], x.shape[-1]
        tiles = tiles or tile_config(name, R, D, align)
        why = problem(budget or Budget(vector=tiles.shape))
        if why:
            raise BudgetError(f"pypto-gym: the {name} kernel's tiles do not fit the chip: {why}")
        args = (*inputs, *outputs, *scalars, *tiles.shape)
        if x.device.type == "npu":
            self._kernel(x.device.type, name, factory, tiles.nbuffer)(*args)
            return
        key = _cache_key(name, factory, tiles, inputs, outputs, scalars)
        if _load_cached(key, outputs, self):  # before anything is created: a read-only cache serves hits
            return
        kernel = self._kernel(x.device.type, name, factory, tiles.nbuffer)
        pypto_compat.ensure_calculator()  # a first build says so on the terminal, not in PyPTO's log
        shapes = ", ".join(f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in inputs[:2])
        print(f"pypto-gym: PyPTO compiles and simulates {name} on {shapes} (SIM with pass-verify: seconds to "
              f"minutes a call; the verified result is cached)", file=sys.stderr, flush=True)
        scratch = pypto_compat.scratch_dir()
        try:
            with pypto_compat.quiet(scratch / "pypto.log"):
                kernel(*args)
        except Exception as e:
            self._poisoned = f"disabled after a kernel compile error in this process ({type(e).__name__})"
            registry.availability_changed()
            raise
        run = pypto_compat.latest_run_dir(scratch)
        if run is None:
            raise RuntimeError("PyPTO's SIM run left no cost-model output")
        est, hub = pypto_compat.estimated_us(run)
        level, verdicts, compiled = pypto_compat.read_verification(run, outputs, kinds)
        failed = [f"{k}: {v}" for k, v in verdicts.items() if v.startswith("FAIL")]
        if failed:
            raise RuntimeError(f"PyPTO's own verification failed after {', '.join(failed)}")
        if compiled is not None:  # return the compiled program's numbers
            for out, value in zip(outputs, compiled):
                out.copy_(value)
        self.last_run = RunInfo(est, hub, level, verdicts, str(tiles))
        _store_cached(key, outputs, self.last_run)
        for child in scratch.iterdir():
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)


def first_runs_here(backend, x, *rest) -> str | None:
    """The `supports` of an op whose PyPTO kernel takes any call its first tensor's device can run."""
    return backend.runs_on(x)


def rows(t: torch.Tensor) -> torch.Tensor:
    """A tensor as the 2-D contiguous rows [R, D] every kernel sees."""
    return t.reshape(-1, t.shape[-1]).contiguous()


def vector(t, D: int, like: torch.Tensor, fill: float) -> torch.Tensor:
    """A per-channel vector as [1, D]; an absent one as its neutral value (gamma 1, beta 0, smooth 1),
    which leaves results bit-identical and keeps one kernel per op."""
    if t is None:
        return torch.full((1, D), fill, dtype=like.dtype, device=like.device)
    return t.reshape(1, D).contiguous()


# ---- the per-call result cache (SIM only) --------------------------------------------------------
def _results_dir() -> Path:
    from . import compat as pypto_compat

    return pypto_compat.cache_dir() / "results"


def _cache_key(name, factory, tiles, inputs, outputs, scalars) -> str:
    h = hashlib.sha256()
    for src in _SOURCES:
        h.update(src.read_bytes())
    h.update(Path(inspect.getsourcefile(factory)).read_bytes())  # the definition module: kernel and helpers
    h.update(repr((name, str(tiles), tiles.nbuffer, [float(s) for s in scalars])).encode())
    for t in [*inputs, *outputs]:
        h.update(repr((str(t.dtype), tuple(t.shape))).encode())
    for t in inputs:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


_RUN_FIELDS = {"estimated_us": float, "hub_us": float, "level": str, "verdicts": dict, "tiles": str}


def _load_cached(key: str, outputs: list, backend: PyptoBackend) -> bool:
    """Serve a call from its cache entry if the entry is a regular file holding exactly what a run
    stores (outputs of the right shapes and dtypes, every RunInfo field with its type); anything else
    is a miss, recomputed and overwritten. Opening only regular files: a FIFO would block forever."""
    path = _results_dir() / f"{key}.pt"
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False
        saved = torch.load(path, weights_only=True)
        values, run = saved["outputs"], dict(saved["run"])
        if set(run) != set(_RUN_FIELDS) or len(values) != len(outputs):
            return False
        for name, kind in _RUN_FIELDS.items():
            if kind is float and isinstance(run[name], int) and not isinstance(run[name], bool):
                run[name] = float(run[name])
            if not isinstance(run[name], kind):
                return False
        if any(v.shape != o.shape or v.dtype != o.dtype for v, o in zip(values, outputs)):
            return False
    except Exception:  # noqa: BLE001 - a missing or damaged entry is recomputed, never trusted
        return False
    for out, value in zip(outputs, values):
        out.copy_(value)
    backend.last_run = RunInfo(**run, cached=True)
    return True


def _store_cached(key: str, outputs: list, run: RunInfo) -> None:
    """Cache a verified result; a cache that cannot be written (read-only, full, a directory in the
    way) costs the next call a recompute, not this result: it warns and goes on."""
    path = _results_dir() / f"{key}.pt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with files.atomic_path(path) as tmp:
            torch.save({"outputs": [o.clone() for o in outputs],
                        "run": {k: v for k, v in asdict(run).items() if k in _RUN_FIELDS}}, tmp)
    except OSError as e:
        warnings.warn(f"pypto-gym: PyPTO result not cached ({path}: {e.strerror or type(e).__name__}); "
                      f"the next identical call recompiles", RuntimeWarning, stacklevel=2)


register(PyptoBackend())
