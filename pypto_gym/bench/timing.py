"""Timing helpers: interleaved medians, so variants measured side by side see the same machine noise."""
from __future__ import annotations

import json
import logging
import statistics
import time

from .. import files


def interleaved_medians(fns: dict, rounds: int = 15, min_seconds: float = 0.002) -> dict:
    """Median seconds per call of each fn, calling them round-robin (A B C A B C ...).

    Each sample times enough back-to-back calls to last `min_seconds`, so microsecond calls are
    not drowned in timer overhead.
    """
    inner = {}
    for name, fn in fns.items():
        fn()  # warm up (allocator, caches, lazy builds)
        n, t0 = 1, time.perf_counter()
        fn()
        one = max(time.perf_counter() - t0, 1e-7)
        inner[name] = max(1, int(min_seconds / one))
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            n = inner[name]
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            samples[name].append((time.perf_counter() - t0) / n)
    return {name: statistics.median(v) for name, v in samples.items()}


def pin_allocator() -> str:
    """Keep freed memory in glibc's heap (no mmap, no trim) for the rest of the process.

    Multi-megabyte tensors otherwise come back from fresh pages on some calls and recycled heap on
    others, and the page faults (not the kernels) decide the timing: HF eager's 4 MB fp32
    temporaries at 512 rows measured 0.4 ms in one run and 3.0 ms in the next. Pinned, every
    variant runs on warm memory, which is also the steady state of a long-running server.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_max = -1, -4
        ok = libc.mallopt(m_mmap_max, 0) == 1 and libc.mallopt(m_trim_threshold, 2**31 - 1) == 1
    except (OSError, AttributeError):
        ok = False
    return "allocator pinned (glibc: no mmap, no trim)" if ok else "allocator not pinned (not glibc)"


def header(name: str) -> str:
    """The first line of every benchmark: what it ran on (figures differ a lot between CPUs)."""
    import platform

    import torch

    from .. import hardware

    return (f"pypto-gym {name} | {hardware.capability()} | {torch.get_num_threads()} threads | "
            f"torch {torch.__version__} | python {platform.python_version()} | {time.strftime('%Y-%m-%d')}")


def write_json(path, data) -> None:
    files.write_text(path, json.dumps(data, indent=2) + "\n")


def goal_line(ok: bool, text: str) -> str:
    return f"{'PASS' if ok else 'FAIL'}  {text}"


def save_plot(path, draw) -> str:
    """Draw with matplotlib into a PNG; returns a message (matplotlib is in the test extra)."""
    # before matplotlib's import, which logs at DEBUG where a root logger is left there (PyPTO's import sets it)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib not installed (pip install -e '.[test]')"
    fig = draw(plt)
    with files.atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, bbox_inches="tight", format="png")
    plt.close(fig)
    return f"plot written to {path}"
