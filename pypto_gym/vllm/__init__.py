"""pypto-gym inside vLLM: the `vllm.general_plugins` entry point, loaded by every vLLM process.

vLLM calls `register()` in its main process, its engine core and each worker before a model is built.

- Always, on a CPU with AMX: ask Linux for the process's AMX tile state (`hardware.amx_permitted`: arch_prctl,
  through torch._C._cpu._init_amx). vLLM 0.32 runs bf16 attention on the CPU with AMX kernels but never asks: its
  worker dies with SIGILL (exit code -4) at the first prefill. This only makes vLLM's own kernels runnable.
- With `PYPTO_GYM_VLLM=1` (and `USE_PTO_RMS_NORM` not 0), pypto-gym's kernels serve vLLM's ops (providers.py): IR op providers for `rms_norm` and `fused_add_rms_norm`, put first in
  the platform's default priority (a user's `kernel_config={"ir_op_priority": ...}` still comes first), and
  out-of-tree custom ops for `SiluAndMul`, `RotaryEmbedding` and `MRotaryEmbedding`; `PYPTO_GYM_VLLM_OPS`
  (comma-separated names) takes only some (on the CPU vLLM's C++ rotary_embedding is faster than the rotary
  provider at serving sizes: docs/benchmarks.md). Each process says once on stderr that it is on. `USE_PTO_RMS_NORM=0`, `PYPTO_GYM_BACKEND` and `PYPTO_GYM_STRICT` mean what they mean
  for `patch_model`.
- `PYPTO_GYM_VLLM_REPORT=DIR`: each process writes what ran where (per op: calls per backend, fallbacks and
  declined calls with their reasons) to DIR/pypto_gym-vllm-<pid>.json at exit; `report.merged(DIR)` adds
  them up over the engine's processes (tensor-parallel ranks included).
- `PYPTO_GYM_VLLM_CAPTURE=DIR`: each process records the shapes vLLM's scheduler gives every provider
  (chunked prefill, decode batches, padded sizes) and writes them as a case file DIR/cases-<pid>.json at exit,
  which `pypto-gym cases run` runs; `report.merge_cases(DIR, FILE)` makes one file of them.
"""
from __future__ import annotations

import os
import sys

from .. import config, hardware

SWITCH = "PYPTO_GYM_VLLM"
OPS_SWITCH = "PYPTO_GYM_VLLM_OPS"  # which of providers.OP_NAMES to take (default: all)
_done: list = []


def enabled() -> bool:
    """$PYPTO_GYM_VLLM (one rule for booleans: config.env_bool), and the master switch not off."""
    return bool(config.env_bool(SWITCH, False)) and config.is_enabled()


def _put_first_in_platform_priority(op_names) -> None:
    """The platform's default IR op priority with pypto_gym first for `op_names` (vLLM appends it after a user's)."""
    from vllm.platforms import current_platform

    platform = type(current_platform)
    original = platform.get_default_ir_op_priority

    def with_pypto_gym(vllm_config):
        priority = original(vllm_config)
        for name in op_names:
            current = list(getattr(priority, name) or [])
            setattr(priority, name, ["pypto_gym", *[p for p in current if p != "pypto_gym"]])
        return priority

    platform.get_default_ir_op_priority = staticmethod(with_pypto_gym)


def register() -> None:
    """vLLM's plugin hook (idempotent: vLLM calls it more than once per process)."""
    if _done:
        return
    _done.append(True)
    hardware.amx_permitted()
    if not enabled():
        return
    from . import providers, report

    chosen = providers.chosen_ops(config.env_text(OPS_SWITCH))
    ir_ops = providers.install_ir_providers(chosen)
    _put_first_in_platform_priority(ir_ops)
    custom = providers.install_custom_ops(chosen)
    report.start(os.environ.get("PYPTO_GYM_VLLM_REPORT"), os.environ.get("PYPTO_GYM_VLLM_CAPTURE"))
    print(f"pypto-gym: kernels inside vLLM on in process {os.getpid()} (backend {providers.BACKEND}): IR providers "
          f"{', '.join(ir_ops)}; custom ops {', '.join(custom)}", file=sys.stderr, flush=True)
