"""Process-wide switches, parsed from the environment once, by one rule (SPEC 6).

Every boolean variable (`USE_PTO_RMS_NORM`, `PYPTO_GYM_STRICT`, `PYPTO_GYM_FUSE_RESIDUAL`) is read
by `env_bool`: trimmed, case-insensitive 1/0, true/false, yes/no, on/off; unset or empty means the
default; anything else is a `SettingError` naming the variable. Values are read on first use and
cached, so a hot path never touches `os.environ` (half a microsecond a read); the setters and the
`scoped` context manager change them for the process or for a block.

`USE_PTO_RMS_NORM` has one meaning everywhere: "run pypto-gym's kernels". 1 turns them on (the
scripts patch as if `--use_pto` were given), 0 turns them off (the scripts do not patch; a model
patched in Python runs its original math until `set_enabled(True)`). Unset, they run where you
asked for them explicitly: `patch_model(...)` in Python, `--use_pto` on the command line.
"""
from __future__ import annotations

import contextlib
import os

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class SettingError(ValueError):
    """An environment variable or switch with a value the parser does not accept."""


def parse_bool(name: str, value) -> bool:
    """The one rule for on/off values; `name` is what the error message blames."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise SettingError(f"{name}: got {value!r}; expected one of 1/0, true/false, yes/no, on/off")


def env_bool(name: str, default: bool | None) -> bool | None:
    """A boolean environment variable; unset or empty gives `default`."""
    value = os.environ.get(name)
    if value is None or not value.strip():
        return default
    return parse_bool(name, value)


def env_choice(name: str, default: str, choices) -> str:
    """A named choice from the environment, trimmed and lower-cased; refused naming the variable."""
    value = os.environ.get(name)
    if value is None or not value.strip():
        return default
    text = value.strip().lower()
    if text not in choices:
        raise SettingError(f"{name}: got {value!r}; expected one of {', '.join(choices)}")
    return text


def env_text(name: str) -> str | None:
    """A text variable, trimmed; unset or empty (after trimming) means None, i.e. the default."""
    value = os.environ.get(name)
    return value.strip() if value is not None and value.strip() else None


def cache_dir():
    """Where compiled kernels and PyPTO results are cached: $PYPTO_GYM_CACHE, else ~/.cache/pypto_gym
    (an empty value means the default, as for every variable: never the current directory)."""
    from pathlib import Path

    return Path(env_text("PYPTO_GYM_CACHE") or Path.home() / ".cache" / "pypto_gym")


class _State:
    """The cached switches. `enabled` is read by every patched norm on every call."""

    __slots__ = ("enabled", "strict", "_loaded")

    def __init__(self):
        self._loaded = False
        self.enabled = True
        self.strict = False

    def load(self) -> None:
        if not self._loaded:
            enabled = env_bool("USE_PTO_RMS_NORM", True)
            strict = env_bool("PYPTO_GYM_STRICT", False)
            self.enabled, self.strict, self._loaded = enabled, strict, True


STATE = _State()


def is_enabled() -> bool:
    STATE.load()
    return STATE.enabled


def set_enabled(flag) -> None:
    """Switch every patched model between the fused kernels (True) and the original math (False)."""
    STATE.load()
    STATE.enabled = parse_bool("enabled", flag)


def is_strict() -> bool:
    STATE.load()
    return STATE.strict


def set_strict(flag) -> None:
    """Strict: a capability fallback or a kernel error raises instead of falling back to torch."""
    STATE.load()
    STATE.strict = parse_bool("strict", flag)


@contextlib.contextmanager
def scoped(*, enabled=None, strict=None):
    """Change switches for a block: `with pypto_gym.config.scoped(strict=False): ...`."""
    STATE.load()
    saved = STATE.enabled, STATE.strict
    try:
        if enabled is not None:
            STATE.enabled = parse_bool("enabled", enabled)
        if strict is not None:
            STATE.strict = parse_bool("strict", strict)
        yield
    finally:
        STATE.enabled, STATE.strict = saved
