"""Shared fixtures: real transformers models, built offline from the repo's own assets.

The suite runs strict (PYPTO_GYM_STRICT=1): a capability fallback or a kernel error raises, so a
backend that silently did not run fails the test that used it. Tests about fallbacks opt out
with the `lenient` fixture.

The suite never touches the user's files (SPEC 12): it runs with a HOME of its own (so nothing lands
in ~/.cache/pypto_gym, ~/.pypto, ~/ascend or any other dot-folder, in this process or the ones it
starts), a PYPTO_GYM_CACHE and a torch.compile cache of its own, all in a folder made for the session
and removed after it. The kernels are built into that cache once per session, at their first use.
`pytest -n auto` (README's command) runs the tests in one worker per core (pytest-xdist): the workers
share the session's folder and cache (a build another worker started is waited for, on its lock) and
run torch on their share of the cores. A developer who runs the
suite often can keep a cache of the suite's own between runs: PYPTO_GYM_TEST_CACHE=DIR (never the
user's cache). A test that must damage a cache damages a copy (tests/test_cpu_build.py).
"""
import atexit
import os
import shutil
import tempfile
from pathlib import Path

XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # pytest -n N: this process runs a share of the tests
if XDIST_WORKER:  # the controller made the session's folder, HOME and cache; its workers inherit them
    SESSION_DIR = Path(os.environ["PYPTO_GYM_TEST_SESSION"])
else:
    SESSION_DIR = Path(tempfile.mkdtemp(prefix="pypto_gym-tests-"))
    atexit.register(shutil.rmtree, SESSION_DIR, ignore_errors=True)
    os.environ["PYPTO_GYM_TEST_SESSION"] = str(SESSION_DIR)
    os.environ["HOME"] = str(SESSION_DIR / "home")
    (SESSION_DIR / "home").mkdir()
    os.environ["PYPTO_GYM_CACHE"] = os.environ.get("PYPTO_GYM_TEST_CACHE", "").strip() or str(SESSION_DIR / "cache")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(SESSION_DIR / "torchinductor")  # not /tmp/torchinductor_$USER
for _var in ("TILE_FWK_OUTPUT_DIR", "PYPTO_HOME", "ASCEND_PROCESS_LOG_PATH"):  # set by pypto-gym per process
    os.environ.pop(_var, None)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["PYPTO_GYM_STRICT"] = "1"
os.environ.pop("USE_PTO_RMS_NORM", None)
os.environ.pop("PYPTO_GYM_BACKEND", None)

import pytest  # noqa: E402
import torch  # noqa: E402

if XDIST_WORKER:  # N workers share the cores: torch's threads spinning on a busy core cost several times their work
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import pypto_gym  # noqa: E402
from pypto_gym.models.qwen2_5_vl import SAMPLE_IMAGE, TINY_DIR, load  # noqa: E402

assert pypto_gym.is_strict(), "the suite must run strict"


@pytest.fixture
def lenient():
    """Fallbacks allowed (counted, warned) for the duration of a test."""
    with pypto_gym.config.scoped(strict=False):
        yield


@pytest.fixture(autouse=True)
def _switches_restored():
    """Every test starts with the kernels enabled and strict mode on, and leaves them so."""
    with pypto_gym.config.scoped(enabled=True, strict=True):
        yield


@pytest.fixture
def model32(tiny_loaded):
    """A float32 copy of the embedded model: torch-backend comparisons must be bit-exact."""
    import copy

    return copy.deepcopy(tiny_loaded[0]).float()


@pytest.fixture(scope="session")
def tiny_loaded():
    """The embedded checkpoint (bf16) and its processor; tests must not mutate it (use copies)."""
    return load(TINY_DIR)


@pytest.fixture(scope="session")
def sample_inputs(tiny_loaded):
    from PIL import Image

    model, processor = tiny_loaded
    return processor(["Read the text in the image."], [Image.open(SAMPLE_IMAGE).convert("RGB")], model=model)


def pytest_xdist_auto_num_workers(config):
    """`pytest -n auto`: one worker per core, at most 4 (each worker holds its own models; measured at 2)."""
    return max(1, min(os.cpu_count() or 1, 4))


# ---- the kernel levels, built while the first tests run ----------------------------------------------------------
_LEVEL_BUILDS: list = []
RUN_FIRST = ("tests/test_pypto.py",)  # no cpu kernel: what the workers run while the levels build
# then the files whose tests take tens of seconds each, so that none of them is left alone at the end of a worker's
# share while the other worker is done (the thousands of short tests after them even the two out)
RUN_EARLY = ("tests/test_compile.py", "tests/test_bench.py", "tests/test_tp.py", "tests/test_readme.py",
             "tests/test_qwen3_vl.py", "tests/test_vllm.py")


def pytest_collection_modifyitems(session, config, items):
    """The tests that need no cpu kernel first, then the slow files, then the rest (stable within each; every
    worker collects the same order), so the workers' first minutes are not spent waiting on the kernel builds and
    their last ones not on one long test."""
    items.sort(key=lambda item: 0 if item.nodeid.startswith(RUN_FIRST) else 1 if item.nodeid.startswith(RUN_EARLY)
               else 2)


def pytest_collection_finish(session):
    """tests/test_cpu_kernels.py runs every op at the levels selected (command 2: the best this CPU runs and avx2;
    `-m integration`: the others), each level one single-threaded compile of ~40 s into the session's cache. When
    it is collected, one process builds them while the first tests (RUN_FIRST) run: the best level first (what
    every other test loads), then avx2 (the AVX2-only machines' level, which tests/test_cli.py's as_avx2 run
    loads), then the others. A test reaching a level first waits on that build's lock, then loads it."""
    import subprocess
    import sys

    if XDIST_WORKER not in (None, "gw0"):
        return
    from pypto_gym import hardware

    best = hardware.best_isa()
    selected = set()  # the levels the selected tests of test_cpu_kernels.py run on
    for item in session.items:
        spec = getattr(item, "callspec", None)
        if item.nodeid.startswith("tests/test_cpu_kernels.py") and spec is not None and "kernel" in spec.params:
            selected.add(spec.params["kernel"])
    levels = sorted((isa for isa in selected | ({best} if selected else set()) if hardware.supports_isa(isa)),
                    key=lambda isa: (isa != best, isa != "avx2"))
    if not levels:
        return
    code = ("import sys\nfrom pypto_gym.kernels.cpu import backend as cpu\n"
            "for isa in sys.argv[1:]:\n    cpu.build(isa)\n")
    _LEVEL_BUILDS.append(subprocess.Popen([sys.executable, "-c", code, *levels], stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True))


def pytest_sessionfinish(session):
    """A build still running when the session ends (a short selection) is stopped with its compiler."""
    import signal

    for proc in _LEVEL_BUILDS:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
