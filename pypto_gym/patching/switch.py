"""The runtime master switch (`USE_PTO_RMS_NORM`): read by every patched module on every call.

Off means each patched module runs its original forward, bit-identical to the unpatched model,
without unpatching. `set_enabled` beats the environment.
"""
import os

_FALSY = ("0", "false", "False", "off", "no")


def env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value in (None, "") else value not in _FALSY


_enabled = env_flag("USE_PTO_RMS_NORM", True)


def set_enabled(flag: bool) -> None:
    """Switch every patched model between the fused kernels (True) and the original math (False)."""
    global _enabled
    _enabled = bool(flag)


def is_enabled() -> bool:
    return _enabled
