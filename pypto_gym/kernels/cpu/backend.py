"""The `cpu` backend's machinery: every op's fused C++ kernels (kernels/cpu/<op>.cpp), built once per machine.

Each op with a cpu kernel has its C++ source beside its Python glue (kernels/cpu/<op>.cpp and <op>.py); the
shared layer (SIMD, dtypes, row primitives) is csrc/common.h and the module csrc/module.cpp. They
are compiled as one translation unit (a unity build: each op file is included, in name order),
because the torch headers dominate compile time and one unit costs one header parse.

Why C++ rather than torch.compile: one build serves every dtype, shape and row count (no
recompiles, no guard overhead at one row). Why a pybind call rather than registering the
kernels with the dispatcher (TORCH_LIBRARY_IMPL): measured side by side on [1, 1, 2048] bf16
(AMD EPYC, AVX-512 BF16, 2026-11-30), the same kernel took 1.01 us through pybind and 1.83-1.97 us
through `torch.ops`, a third of a decode-size norm call; the op layer's own `pypto_gym::*` custom
ops already make every call visible to torch.compile, autograd and the profiler.

The sources are compiled for one instruction-set level (hardware.ISA_LEVELS): the best the CPU
runs, unless a level is asked for (benchmarks and tests compare them, as backends `cpu_<level>`
of the same family). Builds are cached under $PYPTO_GYM_CACHE (default ~/.cache/pypto_gym) in a
folder keyed by content: the level, the flags, the sources, the torch and Python versions. So a
home directory shared by different CPUs or venvs never loads a build made for another, and two
clones of the same source share one. A complete build is imported without writing anything (a
pre-built cache may be read-only). The build uses the ninja this package depends on (not whatever
`ninja` is on PATH), and a build killed half-way cannot block later ones: the lock is an OS file
lock, released when its process dies, and torch's own lock file, if left behind, is removed with
a message.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
from pathlib import Path

import torch

from ... import config, files, hardware
from ...ops.registry import Backend, register

HERE = Path(__file__).resolve().parent
CSRC = HERE / "csrc"
ISA_FLAGS = {
    "avx512amx": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512bf16",
                  "-mamx-tile", "-mamx-bf16"],
    "avx512bf16": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512bf16"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "generic": [],
}
# no a*b+c contracted into an FMA: kernels round where torch rounds (rope is bit-identical to its golden)
CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
LOCK_WAIT_S = 900  # a live build takes under a minute; past this, say so instead of waiting forever


def sources() -> list[Path]:
    """What the build compiles, in order: every op's source (by name), then the module."""
    return sorted(HERE.glob("*.cpp")) + [CSRC / "module.cpp"]


def _content() -> list[tuple[str, str]]:
    return [(p.name, p.read_text()) for p in [CSRC / "common.h", *sources()]]


def build_dir(isa: str) -> Path:
    """The build folder, keyed by content (source, flags, torch and Python versions), never by where
    they are installed: two clones or venvs with the same source and torch share one build."""
    parts = [f"{name}\0{text}" for name, text in _content()]
    key = hashlib.sha256("\0".join([*parts, " ".join(CFLAGS + ISA_FLAGS[isa]), torch.__version__,
                                    str(torch.version.git_version), sys.version]).encode()).hexdigest()[:16]
    return config.cache_dir() / f"cpu_kernels-{isa}-{key}"


COMPLETE = ".pypto_gym.complete"  # written last, after a build that loaded: the folder is safe to load as is


def _load_complete(folder: Path, name: str):
    """Import a finished build without writing anything (no lock: a pre-built cache may be read-only)."""
    import importlib.machinery
    import importlib.util

    if not (folder / COMPLETE).is_file():
        return None
    if name in sys.modules:
        return sys.modules[name]
    loader = importlib.machinery.ExtensionFileLoader(name, str(folder / f"{name}.so"))
    spec = importlib.util.spec_from_file_location(name, loader.path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[name] = module
    return module


@contextlib.contextmanager
def _package_ninja():
    """Put the ninja this package depends on first on PATH while torch builds (a venv used without
    activation has it only in its own bin/, and two ninja versions distrust each other's logs)."""
    try:
        import ninja

        ninja_dir = ninja.BIN_DIR
    except (ImportError, AttributeError):
        yield
        return
    saved = os.environ.get("PATH", "")
    os.environ["PATH"] = ninja_dir + os.pathsep + saved
    try:
        yield
    finally:
        os.environ["PATH"] = saved


@contextlib.contextmanager
def build_lock(folder: Path):
    """The build folder's lock (files.exclusive), and a stale torch lock a killed build left removed."""
    with files.exclusive(folder, "building the cpu kernels", LOCK_WAIT_S):
        stale = folder / "lock"  # torch's FileBaton: it waits forever on a file a killed build left
        if stale.exists():
            print(f"pypto-gym: removing {stale}, left by a build that was killed; building again",
                  file=sys.stderr, flush=True)
            stale.unlink(missing_ok=True)
        yield


def _write_sources(folder: Path) -> Path:
    """Copy the sources into the build folder and write the unity file that includes them (the same bytes
    for every clone, so the build does not depend on where the package lives)."""
    src = folder / "src"
    src.mkdir(exist_ok=True)
    for name, text in _content():
        target = src / name
        if not target.exists() or target.read_text() != text:
            target.write_text(text)
    unity = folder / f"{folder.name}.cpp"
    unity.write_text("".join(f'#include "{p.name}"\n' for p in sources()))
    return unity


def build(isa: str):
    """Build (first time for this level and source) or load the kernels; returns the module."""
    from torch.utils.cpp_extension import load

    folder = build_dir(isa)
    name = f"pypto_gym_cpu_{isa}"
    module = _load_complete(folder, name)
    if module is None:
        with build_lock(folder):
            if not any(folder.glob("*.so")):
                print(f"pypto-gym: building the fused CPU kernels for {isa} (once per machine: 30 s to 4 min on "
                      f"two cores)...", file=sys.stderr, flush=True)
            unity = _write_sources(folder)
            with _package_ninja():
                module = load(name=name, sources=[str(unity)], build_directory=str(folder),
                              extra_include_paths=[str(folder / "src")], extra_cflags=CFLAGS + ISA_FLAGS[isa],
                              extra_ldflags=["-fopenmp"], verbose=False)
            (folder / COMPLETE).write_text(isa + "\n")
    if module.isa() != isa:
        raise RuntimeError(f"cpu kernels in {folder} were compiled for {module.isa()}, not {isa}")
    return module


class CpuBackend(Backend):
    """The C++ kernels for one instruction-set level. Every level is the `cpu` family: the op modules beside this one
    register one implementation, `fn(backend, *args)`, calling `backend.ext`, the compiled module."""

    devices = ("cpu",)
    family = "cpu"

    def __init__(self, isa: str | None = None, name: str = "cpu"):
        self.name = name
        self.isa = isa
        self._ext = None
        self._error = None
        self.build_seconds = None

    @property
    def ext(self):
        return self._ext if self._ext is not None else self.extension()

    def extension(self):
        """The compiled kernels (built or loaded on first use; the reason is kept if that fails)."""
        if self._ext is None and self._error is None:
            t0 = time.perf_counter()
            isa = self.isa or hardware.best_isa()
            try:
                if not hardware.supports_isa(isa):
                    raise RuntimeError(f"this CPU does not run {isa} code ({hardware.capability()})")
                self._ext = build(isa)
                self.isa = isa
            except Exception as e:  # noqa: BLE001 - reported as the reason every call falls back
                first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
                self._error = f"C++ kernels failed to build ({type(e).__name__}: {first})"
                if isinstance(e, OSError) and str(config.cache_dir()) in str(e):
                    self._error += (f"; the kernel cache {config.cache_dir()} must be a writable folder: set "
                                    f"PYPTO_GYM_CACHE to one")
            self.build_seconds = time.perf_counter() - t0
        return self._ext

    def unavailable_reason(self):
        if self._ext is None:
            self.extension()
        return self._error


register(CpuBackend())
