"""Backends: what each one declares it can run, and the order `auto` tries them in (SPEC 2.6).

A backend is an object with one method per op taking the op's validated positional arguments.
It declares two things, as vLLM's op providers and HF `kernels` do, so that fallback is decided
from declarations and never by catching errors:

- `unavailable_reason()`: why it cannot run at all in this process (package missing, build
  failed); computed once, possibly building kernels, so call it at patch time.
- `supports(op, args)`: None if it takes exactly these arguments, else a short reason
  (`device is cpu`, `dtype float32 not supported by npu_add_rms_norm_dynamic_quant`). It must be
  a pure function of the arguments: no environment reads, no side effects.

The backend is chosen for each call by `dispatch.call`, the one place calls are resolved.
"""
from __future__ import annotations

from .. import config


class Backend:
    """Base class: subclasses set `name` and `devices` and implement the ops they provide."""

    name = "base"
    devices: tuple = ()  # device types this backend runs on

    def unavailable_reason(self) -> str | None:
        return None

    def supports(self, op: str, args: tuple) -> str | None:
        x = args[0]
        if x.device.type not in self.devices:
            return f"device is {x.device.type}"
        return self.unavailable_reason()


GAMMA_INDEX = {"rms_norm": 1, "add_rms_norm": 2, "rms_norm_dynamic_quant": 1, "add_rms_norm_dynamic_quant": 2}
BACKENDS: dict[str, Backend] = {}
AUTO_ORDER = ("npu", "cpu", "torch")  # pypto runs when named: on CPU its SIM mode verifies, it does not speed up
_default: list = []  # the parsed $PYPTO_GYM_BACKEND, once


def register(backend: Backend) -> Backend:
    BACKENDS[backend.name] = backend
    return backend


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
