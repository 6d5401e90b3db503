"""Every adaptation of PyPTO internals, in one place, for the one version it was written against.

PyPTO 0.2.0 can compile and cost kernels on a machine without an NPU (RunMode.SIM), and with
pass-verify on, its libtorch-based CPU "calculator" executes the tensor graph and writes real
results into the output tensors. Two things stand in the way on a CPU-only machine, and this
module adapts exactly those, after checking the installed version:

1. `JitCallableWrapper._setup_verify_data` hands the verifier copies of the inputs made with
   `pypto_impl.CopyToHost`, which does nothing without CANN, so the kernel would see zeros. On
   CPU tensors the tensors already are host memory: pass their own pointers to `SetVerifyData`.
2. `BuildOnlineManager.build_and_load_calculator` rebuilds the calculator library with cmake and
   g++ in every process (~45 s on two cores). Build it once into the pypto-gym cache, keyed by
   the PyPTO and torch versions, and load it with RTLD_GLOBAL as PyPTO does.

Importing PyPTO 0.2.0 calls `logging.basicConfig(level=logging.DEBUG)`, which would switch the
whole application's root logger to DEBUG; `import_pypto` restores the root logger afterwards.

A kernel that fails to compile leaves PyPTO 0.2.0's global state broken for the rest of the
process (first "function nested is not allowed", and after resetting that flag "tile shape not
set" and a hang), so the backend never lets a bad shape reach the compiler and, if a compile
still fails, stops using PyPTO in that process (every later call falls back, counted).

It also points PyPTO's output and log directories into a scratch folder (they would otherwise
land in the current directory) and reads SIM's cost-model swimlane for the estimated AICore time.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from ... import config, files

SUPPORTED_VERSION = "0.2.0"
AICORE_MHZ = 1800  # SIM models an Ascend 910B2; its swimlane is in cycles at 1.8 GHz
_applied = False


class PyptoVersionError(RuntimeError):
    pass


def installed_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("pypto")
    except metadata.PackageNotFoundError:
        return None


def check_version() -> str:
    """Refuse loudly if the PyPTO under us is not the one these adaptations were written for."""
    version = installed_version()
    if version is None:
        raise PyptoVersionError("pypto is not installed (pip install 'pypto-gym[pypto]')")
    if version != SUPPORTED_VERSION:
        raise PyptoVersionError(f"pypto {version} installed; pypto_gym's adaptations are for {SUPPORTED_VERSION} "
                                f"(see pypto_gym/kernels/pypto/compat.py)")
    import_pypto()
    from pypto import _utils
    from pypto.frontend.parser import entry

    for owner, name in ((entry.JitCallableWrapper, "_setup_verify_data"),
                        (_utils.BuildOnlineManager, "build_and_load_calculator")):
        if not callable(getattr(owner, name, None)):
            raise PyptoVersionError(f"pypto {version}: {owner.__name__}.{name} is missing; adaptation out of date")
    return version


OUTPUT_VARIABLES = ("TILE_FWK_OUTPUT_DIR", "PYPTO_HOME", "ASCEND_PROCESS_LOG_PATH")  # where PyPTO writes


def import_pypto():
    """Import pypto without letting it write into the user's home or reconfigure the root logger.

    `import pypto` itself writes a run record to $PYPTO_HOME (default ~/.pypto/run) and logs to
    $ASCEND_PROCESS_LOG_PATH (default ~/ascend/log): all of PyPTO's output directories point at this
    process's scratch folder first. Always this process's: the estimate is read from the newest run under
    it, so a folder inherited from the environment (a parent pypto-gym process's, as bench pypto's worker
    processes had) made PyPTO write elsewhere and every run "left no cost-model output"."""
    scratch = str(scratch_dir())
    for var in OUTPUT_VARIABLES:
        os.environ[var] = scratch
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    import pypto

    root.setLevel(level)
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    return pypto


def cache_dir() -> Path:
    return config.cache_dir() / f"pypto-{installed_version()}"


_scratch: list = []


def scratch_dir() -> Path:
    """Where PyPTO writes its per-run output (kernels, swimlanes, logs); cleaned after each call. In the
    cache, or in a temporary folder where the cache cannot be written (a read-only CI volume)."""
    if not _scratch:
        path = cache_dir() / "runs" / str(os.getpid())
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError:
            path = Path(tempfile.mkdtemp(prefix="pypto_gym-runs-"))
        _scratch.append(path)
    return _scratch[0]


def _setup_verify_data_cpu(pto_tensors) -> None:
    import pypto
    from pypto import pypto_impl
    from pypto.runtime import _pto_to_tensor_data, _pto_verify_datas

    if not pypto.get_verify_options().get("enable_pass_verify"):
        return
    _load_calculator()
    pypto_impl.SetVerifyData(_pto_to_tensor_data(pto_tensors), [], _pto_verify_datas.get_data())


def _calculator_library() -> Path:
    import torch

    return cache_dir() / f"calculator-torch{torch.__version__}" / "install" / "lib" / "libtile_fwk_calculator.so"


def build_calculator(progress=True) -> Path:
    """Build PyPTO's calculator library once per machine (cmake + g++), cached by version; a second process
    asking at the same time waits for the first build instead of racing it."""
    lib = _calculator_library()
    if lib.exists():
        return lib
    with files.exclusive(cache_dir(), "building PyPTO's CPU calculator", 1800):
        return lib if lib.exists() else _build_calculator(lib, progress)


def _build_calculator(lib: Path, progress: bool) -> Path:
    from pypto._utils import BuildOnlineManager

    if progress:
        print("pypto-gym: building PyPTO's CPU calculator (once per machine: 20 s to 4 min on two cores)...",
              file=sys.stderr, flush=True)
    import torch

    mgr = BuildOnlineManager()
    # torch's facts read here, not through PyPTO's _TorchContext: that one puts a dict copy in place of os.environ,
    # after which the process's os.environ writes no longer reach its C environment (torch.compile's C++ wrapper in
    # the same process then failed: "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR must be set")
    cmake_ctx = mgr._CMakeContext()
    cache_dir().mkdir(parents=True, exist_ok=True)  # a fresh PYPTO_GYM_CACHE: nothing made it yet
    staging = Path(tempfile.mkdtemp(prefix="calc-", dir=cache_dir()))
    ctx = mgr._CMakeContext.CompileContext(src_dir=Path(mgr.pkg_lib_dir, "calculator"), tmp_dir=staging)
    ctx.cfg_cmd_ext = (f"-DPY3_MOD_TORCH_VERSION={torch.__version__} "
                       f"-DPY3_MOD_TORCH_ROOT_PATH={Path(torch.__file__).parent} "
                       f"-DPY3_MOD_TORCH_C_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
    ctx.build_job_num = os.cpu_count() or 2
    with quiet(cache_dir() / "calculator-build.log"):  # cmake's own output; the line above says what runs
        install = cmake_ctx.compile(ctx=ctx)
    shutil.rmtree(staging / "build", ignore_errors=True)
    final = lib.parents[2]
    if final.exists():
        shutil.rmtree(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging.rename(final)
    if not lib.exists():
        raise PyptoVersionError(f"pypto {installed_version()}: calculator build did not produce {lib.name} "
                                f"under {install}; adaptation out of date")
    return lib


def ensure_calculator() -> None:
    """Build (once per machine, with a line on stderr) and load PyPTO's calculator, before a kernel
    call redirects PyPTO's own output to its log (output folders set first: apply())."""
    apply()
    _load_calculator()


def _load_calculator() -> None:
    from pypto._utils import BuildOnlineManager

    mgr = BuildOnlineManager()
    if not mgr.calculator_loaded:
        ctypes.CDLL(str(build_calculator()), mode=ctypes.RTLD_GLOBAL)
        mgr.calculator_loaded = True


def apply() -> None:
    """Check the version, redirect PyPTO's output directories, install the two adaptations."""
    global _applied
    if _applied:
        return
    check_version()  # imports pypto (import_pypto: its output directories in this process's scratch)
    from pypto import _utils
    from pypto.frontend.parser import entry

    entry.JitCallableWrapper._setup_verify_data = staticmethod(_setup_verify_data_cpu)
    _utils.BuildOnlineManager.build_and_load_calculator = lambda self: _load_calculator()
    _applied = True


@contextlib.contextmanager
def quiet(log_path: Path):
    """Send what PyPTO's C++ core and helper scripts print (swimlane summaries) to a log file."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log_path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def latest_run_dir(root: Path) -> Path | None:
    """The output folder of the newest SIM run under root (the one holding its cost-model swimlane)."""
    runs = sorted(Path(root).rglob("_simulate.swim.json"), key=lambda p: p.stat().st_mtime)
    return runs[-1].parent.parent if runs else None


def estimated_us(run_dir: Path) -> tuple[float, float]:
    """(AICore end-to-end µs, trailing HUB µs) of one SIM run, from its cost-model swimlane.

    The first is PyPTO's own "AICore End-to-End Time" (lib/scripts/draw_swim_lane.py): first start
    to last end over the AIC/AIV cores only, in cycles at 1.8 GHz; kernel launch overhead is not
    modelled. The second is how much later the last task of any kind (the HUB core's completion
    task) ends.
    """
    cores = json.loads((Path(run_dir) / "CostModelSimulationOutput" / "_simulate.swim.json").read_text())
    aicore = [t for c in cores if c.get("coreType") in ("AIC", "AIV") for t in c.get("tasks", [])]
    every = [t for c in cores for t in c.get("tasks", [])]
    if not aicore:
        return 0.0, 0.0
    start, end = min(t["execStart"] for t in aicore), max(t["execEnd"] for t in aicore)
    return (end - start) / AICORE_MHZ, max(0.0, max(t["execEnd"] for t in every) - end) / AICORE_MHZ


FULL_TENSOR_PASS = "InferDynShape"  # the deepest verified pass whose dumps hold whole tensors
VERIFY_TOL = 1e-3  # PyPTO's default pass_verify_error_tol (rtol, atol)


def _dumps(folder: Path, pass_name: str) -> dict[int, tuple[bytes, bytes]]:
    """{output index: (pass value, tensor-graph golden)} as raw bytes, from one pass's dump folder."""
    found: dict[int, dict[str, bytes]] = {}
    for f in folder.glob(f"tensor~*~{pass_name}~0~*.data"):
        parts = f.name.split("~")
        k = int(parts[4])
        found.setdefault(k, {})["golden" if parts[5] == "golden" else "value"] = f.read_bytes()
    return {k: (v["value"], v["golden"]) for k, v in found.items() if {"value", "golden"} <= v.keys()}


def read_verification(run_dir: Path, outputs: list, kinds=None) -> tuple[str, dict, list | None]:
    """What PyPTO's pass verification found in one SIM run: (level, verdicts, compiled outputs).

    PyPTO executes the program with its CPU calculator after each listed compile pass and dumps,
    per output, that pass's values next to the untiled tensor graph's (its golden). Its own CSV
    summary is only flushed at process exit in 0.2.0, so the verdicts are computed here from the
    dumps with PyPTO's tolerance. The deepest pass that still holds whole tensors gives the
    compiled program's numbers for every output; the last pass before codegen holds the first
    tile only and is checked as far as it goes. Dumps are numbered by PyPTO's own output order,
    so each is matched to the output whose graph-level values equal its golden. `kinds`: SPEC 5's kind of each
    output ("mixture" for an attention's), None to judge by the dtype.
    Returns level "compiled" with those numbers, or "graph" (None) where the dumps are missing.
    """
    vdirs = sorted(Path(run_dir).glob("verify_*"))
    if not vdirs:
        return "graph", {}, None
    verdicts, compiled = {}, None
    for folder in sorted(vdirs[-1].glob("Pass_*")):
        pass_name = folder.name.split("_", 2)[-1]
        dumps = _dumps(folder, pass_name)
        if pass_name == FULL_TENSOR_PASS:
            compiled = _match_outputs(dumps, outputs)
        for k, (value, golden) in sorted(dumps.items()):
            verdicts[f"{folder.name}:output{k}"] = _verdict(value, golden, outputs, kinds)
    return ("compiled", verdicts, compiled) if compiled is not None else ("graph", verdicts, None)


def _verdict(value: bytes, golden: bytes, outputs: list, kinds=None) -> str:
    """A pass's values against the tensor graph's, by SPEC 5's rule for the output they belong to (its kind when
    given: an attention output near zero is judged against its row's rms, not its own size); a pass that holds one
    tile is compared with the same leading rows of the golden."""
    import torch

    from ...precision import compare

    j = next((j for j, o in enumerate(outputs) if len(golden) == o.numel() * o.element_size()), None)
    if j is None or len(value) > len(golden) or len(value) % outputs[j].element_size():
        return "UNCHECKED"
    out = outputs[j]
    a = torch.frombuffer(bytearray(value), dtype=out.dtype)
    b = torch.frombuffer(bytearray(golden[:len(value)]), dtype=out.dtype)
    kind = kinds[j] if kinds else None
    if kind is None:
        kind = "scale" if out.dtype == torch.float32 and out.shape[-1] == 1 else None
    elif a.numel() % out.shape[-1] == 0:  # rows, for a kind judged per row
        a, b = a.reshape(-1, out.shape[-1]), b.reshape(-1, out.shape[-1])
    c = compare(a, b, "value", kind)
    return "PASS" if c.passed else f"FAIL ({c.reason})"


def _match_outputs(dumps: dict, outputs: list) -> list | None:
    """The compiled values in `outputs` order, matching each dump's golden to an output's current values."""
    import torch

    result: list = [None] * len(outputs)
    for value, golden in dumps.values():
        for j, out in enumerate(outputs):
            nbytes = out.numel() * out.element_size()
            if result[j] is not None or len(golden) != nbytes or len(value) != nbytes:
                continue
            if torch.equal(torch.frombuffer(bytearray(golden), dtype=out.dtype).reshape(out.shape), out):
                result[j] = torch.frombuffer(bytearray(value), dtype=out.dtype).reshape(out.shape)
                break
    return result if all(r is not None for r in result) else None
