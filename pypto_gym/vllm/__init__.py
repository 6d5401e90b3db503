"""pypto-gym inside vLLM: the `vllm.general_plugins` entry point, loaded by every vLLM process.

vLLM calls `register()` in its engine core and in each worker before a model is built. What it does:

- On a CPU with AMX it asks Linux for the AMX tile state of the process (arch_prctl via
  torch._C._cpu._init_amx). vLLM 0.32 runs bf16 attention on the CPU with AMX kernels but never asks for
  it: its worker dies with SIGILL (exit code -4) on the first prefill. Asked once, the kernels run. This
  is done whether or not pypto-gym's kernels are enabled: it only makes vLLM's own kernels runnable.
"""
from __future__ import annotations

_done: list = []


def request_amx() -> bool:
    """Ask the kernel for AMX tile state in this process where the CPU has AMX; True when it may be used."""
    import torch

    if not torch.cpu._is_amx_tile_supported():
        return False
    return bool(torch._C._cpu._init_amx())


def register() -> None:
    """vLLM's plugin hook (idempotent: vLLM may call it more than once per process)."""
    if _done:
        return
    _done.append(True)
    request_amx()
