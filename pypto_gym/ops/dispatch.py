"""The one place a call is resolved to a backend, run, and counted (SPEC 2.6).

Every call reaches `call`: the `pypto_gym.ops.*` entry points in eager mode, the
`torch.ops.pypto_gym.*` custom ops (torch.compile, autograd, fake tensors) from their kernel, and
so every patched module, whichever of the two paths it takes. The policy:

- Capability: the requested backend (or each of `auto`'s candidates) declares whether it takes
  these exact arguments (`Backend.supports`). If not, the call runs on `torch`, and the
  fallback is counted with the backend's reason.
- Defect: a kernel that raises on a call it declared it supports is a bug. The call is rerun on
  `torch`, counted with the error as its reason, and warned once per reason.
- Strict (`PYPTO_GYM_STRICT=1`, `config.set_strict`): both raise instead. The test suite runs
  strict, so a fallback a test did not ask for fails it.

Counters live in `Stats` objects: one per patched site, and `GLOBAL` for direct calls. A custom
op cannot carry a Python object, so each Stats has an integer id the op takes as an argument and
looks up here; a compiled graph therefore counts per site too. `ran` records which backend
actually produced each result, which is what the patch report shows.
"""
from __future__ import annotations

import itertools
import warnings
import weakref

from .. import config
from . import reference
from .registry import BACKENDS, AUTO_ORDER, get

REFERENCE = {"rms_norm": reference.rms_norm, "add_rms_norm": reference.add_rms_norm,
             "rms_norm_dynamic_quant": reference.rms_norm_dynamic_quant,
             "add_rms_norm_dynamic_quant": reference.add_rms_norm_dynamic_quant,
             "quant_matmul": reference.quant_matmul}
OPS = tuple(REFERENCE)


class BackendFallbackError(RuntimeError):
    """Strict mode: a call would have fallen back to torch."""


class Stats:
    """Live counters of one call site: results per backend that produced them, fallbacks by reason."""

    __slots__ = ("id", "ran", "fallbacks", "__weakref__")
    _live: "weakref.WeakValueDictionary[int, Stats]" = weakref.WeakValueDictionary()
    _ids = itertools.count(1)

    def __init__(self, ran=None, fallbacks=None, *, _id=None):
        self.id = next(Stats._ids) if _id is None else _id
        self.ran = dict(ran or {})
        self.fallbacks = dict(fallbacks or {})
        Stats._live[self.id] = self

    @property
    def calls(self) -> int:
        return sum(self.ran.values())

    @property
    def backend(self) -> str | None:
        """The backend(s) that produced this site's results, most calls first ("cpu", "cpu+torch")."""
        return "+".join(sorted(self.ran, key=self.ran.get, reverse=True)) or None

    def reset(self) -> None:
        self.ran.clear()
        self.fallbacks.clear()

    def __deepcopy__(self, memo):  # a copied model counts for itself
        return Stats(self.ran, self.fallbacks)

    def __reduce__(self):  # an unpickled model gets live counters of its own, not a stale id
        return Stats, (self.ran, self.fallbacks)

    @classmethod
    def lookup(cls, stats_id: int) -> "Stats":
        return cls._live.get(stats_id) or GLOBAL


GLOBAL = Stats(_id=0)
_warned: set = set()


def _count_fallback(stats: Stats, reason: str) -> None:
    stats.fallbacks[reason] = stats.fallbacks.get(reason, 0) + 1


def resolve(op: str, requested: str, args: tuple):
    """(backend, None) for the backend that takes this call, or (torch, reason) for a fallback."""
    if requested != "auto":
        backend = BACKENDS.get(requested) or get(requested)
        reason = backend.supports(op, args)
        return (backend, None) if reason is None else (BACKENDS["torch"], f"{requested}: {reason}")
    device = args[0].device.type
    first = None
    for name in AUTO_ORDER:
        backend = BACKENDS.get(name)
        if backend is None or device not in backend.devices:
            continue
        reason = backend.supports(op, args)
        if reason is None:
            return backend, first
        first = first or f"{name}: {reason}"
    return BACKENDS["torch"], first


def call(op: str, requested: str, stats: Stats, args: tuple):
    """Resolve, run and count one call of `op` (validated positional `args`)."""
    backend, reason = resolve(op, requested, args)
    if reason is not None:
        if config.is_strict():
            raise BackendFallbackError(f"pypto_gym.{op}: {reason}; would fall back to torch (strict mode)")
        _count_fallback(stats, reason)
    if backend.name == "torch":
        out = REFERENCE[op](*args)
    else:
        try:
            out = getattr(backend, op)(*args)
        except Exception as e:  # noqa: BLE001 - policy: a failing kernel must not take the model down
            if config.is_strict():
                raise
            out = _defect(op, backend, e, stats, args)
            backend = BACKENDS["torch"]
    ran = stats.ran
    ran[backend.name] = ran.get(backend.name, 0) + 1
    return out


def _defect(op, backend, error, stats, args):
    """A kernel raised on a call it declared it supports: count, warn once per reason, rerun on torch."""
    text = str(error).splitlines()[0][:160] if str(error) else ""
    reason = f"{backend.name} raised {type(error).__name__}: {text}"
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"pypto_gym.{op}: {reason}; this result and later ones like it come from torch "
                      f"(PYPTO_GYM_STRICT=1 raises instead)", RuntimeWarning, stacklevel=4)
    _count_fallback(stats, reason)
    return REFERENCE[op](*args)
