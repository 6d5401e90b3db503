"""The one place a call is resolved to a backend, run, and counted (SPEC 2.6).

Every call reaches `call`: the `pypto_gym.ops.*` entry points in eager mode, the
`torch.ops.pypto_gym.*` custom ops (torch.compile, autograd, fake tensors) from their kernel, and
so every patched module, whichever of the two paths it takes; a BoundCall's repeat of a kind of call
goes to `run` with the resolution `plan` gave it (recorded and counted the same way). The policy:

- Capability: the requested backend (or each of `auto`'s candidates) declares whether it takes
  these exact arguments: the op has an implementation there, the tensors are on a device it runs
  on, it is available in this process, and the implementation's pure `supports` predicate agrees.
  If not, the call runs on `torch` (the op's golden), and the fallback is counted with the reason.
- Defect: a kernel that raises on a call it declared it supports is a bug. The call is rerun on
  `torch`, counted with the error as its reason, and warned once per reason.
- Strict (`PYPTO_GYM_STRICT=1`, `config.set_strict`, or a patch's own `strict=`): both raise
  instead. The test suite runs strict, so a fallback a test did not ask for fails it.

Counters live in `Stats` objects: one per patch site, and `GLOBAL` for direct calls. A custom
op cannot carry a Python object, so each Stats has an integer id the op takes as an argument and
looks up here; a compiled graph therefore counts per site too. `ran` records which backend
actually produced each result, which is what the patch report shows. A ShapeRecorder sees every
call of a patch site here (`RECORDERS`), whichever backend runs it.
"""
from __future__ import annotations

import contextlib
import itertools
import warnings
import weakref

from .. import config
from .registry import AUTO_ORDER, BACKENDS, GENERATION, TORCH, get

RECORDERS: list = []  # active ShapeRecorders: each gets (op, stats, args) of every site call
_REFERENCE: list = []  # non-empty inside `reference()`: every call runs the golden, charged to nobody


class BackendFallbackError(RuntimeError):
    """Strict mode: a call would have fallen back to torch."""


class Stats:
    """Live counters of one call site: results per backend that produced them, fallbacks by reason.

    `site` is the patch site's kind (None for direct calls): what a recorder files a call under.
    `strict` overrides the process-wide strict switch for this site (None: follow it).
    """

    __slots__ = ("id", "ran", "fallbacks", "site", "strict", "__weakref__")
    _live: "weakref.WeakValueDictionary[int, Stats]" = weakref.WeakValueDictionary()
    _ids = itertools.count(1)

    def __init__(self, ran=None, fallbacks=None, *, site=None, strict=None, _id=None):
        self.id = next(Stats._ids) if _id is None else _id
        self.ran = dict(ran or {})
        self.fallbacks = dict(fallbacks or {})
        self.site, self.strict = site, strict
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
        return Stats(self.ran, self.fallbacks, site=self.site, strict=self.strict)

    def __reduce__(self):  # an unpickled model gets live counters of its own, not a stale id
        return _new_stats, (self.ran, self.fallbacks, self.site, self.strict)

    @classmethod
    def lookup(cls, stats_id: int) -> "Stats":
        return cls._live.get(stats_id) or GLOBAL


def _new_stats(ran, fallbacks, site, strict):
    return Stats(ran, fallbacks, site=site, strict=strict)


GLOBAL = Stats(_id=0)
_warned: set = set()


def _count_fallback(stats: Stats, reason: str) -> None:
    stats.fallbacks[reason] = stats.fallbacks.get(reason, 0) + 1


def _strict(stats: Stats) -> bool:
    return config.is_strict() if stats.strict is None else stats.strict


def why_not(op, backend, args: tuple) -> str | None:
    """None if `backend` takes this call of `op`, else the reason (a pure function of the arguments)."""
    impl = op.impls.get(backend.family)
    if impl is None:
        return op.unsupported.get(backend.family, f"{op.name} is not implemented")
    device = args[op.device_index].device.type
    if device not in backend.devices:
        return f"device is {device}"
    reason = backend.unavailable_reason()
    if reason:
        return reason
    return impl.supports(backend, *args) if impl.supports is not None else None


def resolve(op, requested: str, args: tuple):
    """(backend, implementation, None) for the implementation that takes this call, or (torch, None, the
    fallback reason) when the golden runs instead."""
    if requested == "torch":
        return TORCH, None, None
    if requested != "auto":
        backend = BACKENDS.get(requested) or get(requested)
        reason = why_not(op, backend, args)
        if reason is None:
            return backend, op.impls[backend.family], None
        return TORCH, None, f"{requested}: {reason}"
    device = args[op.device_index].device.type
    first = None
    for name in AUTO_ORDER:
        backend = BACKENDS.get(name)
        if backend is None or device not in backend.devices:
            continue
        if backend is TORCH:
            break
        reason = why_not(op, backend, args)
        if reason is None:
            return backend, op.impls[backend.family], first
        first = first or f"{name}: {reason}"
    return TORCH, None, first


@contextlib.contextmanager
def reference():
    """Inside: every call runs its golden and counts nowhere (a rewrite's first-call check compares the
    original and the rewritten forward this way, without charging the sites or being recorded)."""
    _REFERENCE.append(True)
    try:
        yield
    finally:
        _REFERENCE.pop()


def call(op, requested: str, stats: Stats, args: tuple, into: tuple | None = None):
    """Resolve, run and count one call of `op` (validated positional `args`). `into`: tensors to write the outputs
    into (the op's in-place form, vLLM's rotary embedding for one): an implementation registered with `into=True`
    writes them itself, any other's results (the golden's too) are copied in; `into` is returned."""
    return run(op, resolve(op, requested, args), stats, args, into)


def plan(op, requested: str, args: tuple) -> tuple:
    """`resolve`'s answer for calls of this kind, and the registry generation it holds for: a BoundCall keeps it for
    its calls of one kind (types, dtypes, shapes, devices, scalar values), since `supports` predicates read only
    those and a backend's availability changes only with the generation (a decode-size call is a few
    microseconds: resolving each one again was a third of the Python a vLLM provider spent per call)."""
    return resolve(op, requested, args), GENERATION[0]


def run(op, resolved: tuple, stats: Stats, args: tuple, into: tuple | None = None):
    """One call on the (backend, implementation, fallback reason) `resolve` chose: recorded, run, counted."""
    if _REFERENCE:
        return written(op.golden(*args), into)
    if RECORDERS and stats.site is not None:
        for recorder in RECORDERS:
            recorder.record(op, stats, args)
    backend, impl, reason = resolved
    if reason is not None:
        if _strict(stats):
            raise BackendFallbackError(f"pypto_gym.{op.name}: {reason}; would fall back to torch (strict mode)")
        _count_fallback(stats, reason)
    writes = into is not None and impl is not None and impl.into
    if impl is None:
        out = op.golden(*args)
    else:
        try:
            out = impl.fn(backend, *args, out=into) if writes else impl.fn(backend, *args)
        except Exception as e:  # noqa: BLE001 - policy: a failing kernel must not take the model down
            if _strict(stats) or writes:  # an in-place kernel may have written part of its inputs: no rerun
                raise
            out = _defect(op, backend.name, e, stats, args)
            backend = TORCH
    ran = stats.ran
    ran[backend.name] = ran.get(backend.name, 0) + 1
    return out if into is None or writes else written(out, into)


def written(out, into):
    """`out` copied into the tensors `into` (returned in the outputs' structure); `out` itself without `into`."""
    if into is None:
        return out
    for t, o in zip(into, out if isinstance(out, tuple) else (out,)):
        t.copy_(o)
    return into if isinstance(out, tuple) else into[0]


def _defect(op, backend: str, error, stats, args):
    """A kernel raised on a call it declared it supports: count, warn once per reason, rerun on torch."""
    text = str(error).splitlines()[0][:160] if str(error) else ""
    reason = f"{backend} raised {type(error).__name__}: {text}"
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"pypto_gym.{op.name}: {reason}; this result and later ones like it come from torch "
                      f"(PYPTO_GYM_STRICT=1 raises instead)", RuntimeWarning, stacklevel=4)
    _count_fallback(stats, reason)
    return op.golden(*args)
