"""Backends: where kernels run, whether they can run here, and the order `auto` tries them in (SPEC 2.6).

A backend is machinery, not a list of ops: it says which device types it runs on and why it
cannot run at all in this process (`unavailable_reason()`: package missing, build failed;
computed once, possibly building kernels, so call it at patch time). Which ops it implements,
and for which arguments, its kernel modules say themselves (`Op.impl(name, supports=...)`), as
vLLM's IR ops register providers. `torch` is every op's golden and runs everywhere.

The other backends and their kernels are providers (PROVIDERS, kernels/): loaded once by
`load_providers`, which `pypto_gym.ops` calls after its definitions, by package name, as a vLLM
platform imports its kernels; nothing in ops/ imports them.
"""
from __future__ import annotations

import importlib

from .. import config


class Backend:
    """A backend's machinery: subclasses set `name` and `devices` and say why they cannot run, if so."""

    name = "base"
    devices: tuple = ()  # device types this backend runs on
    family = None  # the implementations it runs: its kernel modules register them per family (default: its name)

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if "family" not in cls.__dict__ and "name" in cls.__dict__:
            cls.family = cls.name

    def unavailable_reason(self) -> str | None:
        return None


class TorchBackend(Backend):
    """The goldens themselves: every op's reference formula, on every device, never falling back."""

    name = "torch"
    devices = ("cpu", "cuda", "npu", "meta", "xpu", "mps")


BACKENDS: dict[str, Backend] = {}
AUTO_ORDER = ("npu", "cpu", "torch")  # pypto runs when named: on CPU its SIM mode verifies, it does not speed up
_default: list = []  # the parsed $PYPTO_GYM_BACKEND, once
# Bumped whenever what a call could resolve to changes (a backend or an implementation registered, PyPTO disabling
# itself after a compile error): a call plan resolved before (dispatch.plan, kept by a BoundCall per kind of call)
# is resolved again.
GENERATION = [0]


def availability_changed() -> None:
    GENERATION[0] += 1


def register(backend: Backend) -> Backend:
    BACKENDS[backend.name] = backend
    availability_changed()
    return backend


TORCH = register(TorchBackend())


PROVIDERS = "pypto_gym.kernels"  # the package of backends and their kernels (each registers itself on import)


def load_providers() -> None:
    """Import the providers once: every backend folder registers its Backend and its ops' implementations."""
    importlib.import_module(PROVIDERS)


def backend_names() -> tuple:
    return ("auto",) + tuple(BACKENDS)


def get(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except (KeyError, TypeError):
        raise ValueError(f"backend: got {name!r}; expected one of {', '.join(backend_names())}") from None


def check_name(name, argument: str = "backend") -> str:
    """A backend name as given by a user (`--backend`, `backend=`): validated, naming `argument`."""
    if name == "auto" or name in BACKENDS:
        return name
    raise ValueError(f"{argument}: got {name!r}; expected one of {', '.join(backend_names())}")


def env_backend() -> str:
    """$PYPTO_GYM_BACKEND read now (trimmed, lower-cased, refused naming the variable), else "auto"."""
    return config.env_choice("PYPTO_GYM_BACKEND", "auto", backend_names())


def default_backend() -> str:
    """The process default for `backend=None`: $PYPTO_GYM_BACKEND as read on first use."""
    if not _default:
        _default.append(env_backend())
    return _default[0]


def candidates(requested: str, device_type: str) -> list[Backend]:
    """The backends `requested` stands for on this device type, in the order they are tried."""
    if requested != "auto":
        return [get(requested)]
    return [BACKENDS[n] for n in AUTO_ORDER if n in BACKENDS and device_type in BACKENDS[n].devices]


def prepare(requested: str, device_type: str) -> str | None:
    """Do a backend's one-time work (kernel build/load) now, e.g. at patch time, not inside a timed call.

    Returns why the backend that should serve this device (the named one, or `auto`'s first
    choice) cannot run, None if it can, so the caller can say so once, loudly, at patch time
    instead of leaving it to be discovered as fallback counts.
    """
    backend = candidates(requested, device_type)[0]
    if device_type not in backend.devices:
        return f"{backend.name}: does not run on {device_type} tensors"
    reason = backend.unavailable_reason()
    return None if reason is None else f"{backend.name}: {reason}"
