"""Backends, per-call capability checks, and counted fallbacks (SPEC 2.6).

A backend is one module implementing the four ops on raw, validated arguments. Before a call,
`resolve` asks the requested backend whether it supports exactly these arguments; `run` calls it
and, if the kernel raises, falls back to the reference with a one-time warning (or re-raises
under PYPTO_GYM_STRICT=1). Every fallback is counted with its reason in a `Stats` object: the
global one, and the per-site one a patched module passes in.
"""
from __future__ import annotations

import os
import warnings
from collections import Counter

import torch

OPS = ("rms_norm", "add_rms_norm", "rms_norm_dynamic_quant", "add_rms_norm_dynamic_quant")


class Backend:
    """Base class: subclasses set `name`, `devices` and implement the ops they provide."""

    name = "base"
    devices: tuple = ()  # device types this backend runs on

    def unavailable_reason(self) -> str | None:
        """Why the backend cannot run at all in this process (missing package, failed build)."""
        return None

    def supports(self, op: str, x: torch.Tensor, **args) -> str | None:
        """None if this call is supported, else a short reason (`device is cpu`, `D=16384 > 8192`)."""
        if x.device.type not in self.devices:
            return f"device is {x.device.type}"
        return self.unavailable_reason()

    def call(self, op: str, *args):
        return getattr(self, op)(*args)


class Stats:
    """Live call and fallback counters (reason -> count), and the backend the last call resolved to."""

    __slots__ = ("calls", "fallbacks", "backend")

    def __init__(self):
        self.calls = 0
        self.fallbacks = Counter()
        self.backend = None

    def reset(self):
        self.calls = 0
        self.fallbacks.clear()
        self.backend = None


BACKENDS: dict[str, Backend] = {}
AUTO_ORDER = ("npu", "cpu", "torch")  # pypto runs when named: on CPU its SIM mode verifies, it does not speed up
GLOBAL_STATS = Stats()
_warned: set = set()


def register(backend: Backend) -> Backend:
    BACKENDS[backend.name] = backend
    return backend


def backend_names() -> tuple:
    return ("auto",) + tuple(BACKENDS)


def get(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"backend: got {name!r}; expected one of {', '.join(backend_names())}") from None


def default_backend() -> str:
    return os.environ.get("PYPTO_GYM_BACKEND", "auto") or "auto"


def strict() -> bool:
    return os.environ.get("PYPTO_GYM_STRICT", "0") not in ("", "0", "false", "False")


def prepare(requested: str, device_type: str) -> None:
    """Do a backend's one-time work (kernel build/load) now, e.g. at patch time, not inside a timed call."""
    names = [n for n in AUTO_ORDER if n in BACKENDS] if requested == "auto" else [requested]
    for name in names:
        backend = get(name)
        if device_type in backend.devices:
            backend.unavailable_reason()
            if requested == "auto":
                return


def resolve(op: str, requested: str, x: torch.Tensor, **args) -> tuple[Backend, str | None]:
    """The backend that will run this call, and the fallback reason if it is not the one asked for."""
    if requested == "auto":
        first_reason = None
        for name in AUTO_ORDER:
            backend = BACKENDS.get(name)
            if backend is None or x.device.type not in backend.devices:
                continue
            reason = backend.supports(op, x, **args)
            if reason is None:
                return backend, first_reason
            first_reason = first_reason or f"{name}: {reason}"
        return BACKENDS["torch"], first_reason
    backend = get(requested)
    reason = backend.supports(op, x, **args)
    if reason is None:
        return backend, None
    if strict():
        raise RuntimeError(f"backend {requested!r} cannot run {op}: {reason} (PYPTO_GYM_STRICT=1)")
    return BACKENDS["torch"], f"{requested}: {reason}"


def run(op: str, backend: Backend, args: tuple, stats: Stats | None = None):
    """Run `op` on `backend`; a kernel that raises falls back to the reference, counted and warned once."""
    if backend.name == "torch":
        return backend.call(op, *args)
    try:
        return backend.call(op, *args)
    except Exception as e:  # noqa: BLE001 - any kernel failure must not take the model down
        if strict():
            raise
        reason = f"{backend.name} raised {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        key = (backend.name, op, type(e).__name__)
        if key not in _warned:
            _warned.add(key)
            warnings.warn(f"pypto_gym.{op}: {reason}; falling back to torch (set PYPTO_GYM_STRICT=1 to raise)",
                          RuntimeWarning, stacklevel=3)
        for s in {id(GLOBAL_STATS): GLOBAL_STATS, id(stats): stats}.values():
            if s is not None:
                s.fallbacks[reason] += 1
        return BACKENDS["torch"].call(op, *args)
