"""The op family: one definition per op (ops/defs/), every entry point derived from it (op.py), its kernels
per backend in kernels/<backend>/<op>.py.

    y = pypto_gym.ops.rms_norm(x, gamma, 1e-6, cast_mode="hf", backend="auto")

Each op is also `torch.ops.pypto_gym.<name>` (traceable by torch.compile, with its backward where it
has one) and `pypto_gym.ops.OPS[name]` (its definition: golden, argument roles, outputs, backends).
`backend=None` means the process default ($PYPTO_GYM_BACKEND, else "auto"); `stats` is the `Stats`
to charge (a patched site passes its own; direct calls are charged to `GLOBAL_STATS`).
"""
from . import defs, registry  # noqa: F401  (defs registers every op)
from .args import ArgTypeError, ArgValueError, dtype_name
from .dispatch import GLOBAL as GLOBAL_STATS
from .dispatch import BackendFallbackError, Stats
from .op import BoundCall, Op
from .quantize import pack_int4, unpack_int4
from .registry import backend_names

registry.load_providers()  # every backend's kernels (kernels/), after the definitions they implement

OPS: dict = Op.registry
globals().update({name: op.entry for name, op in OPS.items()})

__all__ = [*OPS, "OPS", "Op", "BoundCall", "Stats", "GLOBAL_STATS", "BackendFallbackError", "ArgTypeError",
           "ArgValueError", "pack_int4", "unpack_int4", "backend_names", "dtype_name"]
