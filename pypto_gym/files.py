"""Writing files without ever leaving a half-written one: every file pypto-gym writes goes through here.

A case file that took an hour of capture, a calibration file, a benchmark's JSON: if the disk
fills or the process dies mid-write, the previous version must survive intact. So the new content
goes to a temporary file in the same directory (same filesystem, so the rename is atomic), is
flushed to disk, and only then replaces the target with `os.replace`.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary path next to `path`; on success it replaces `path`, on failure it is removed."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text(path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_bytes(path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def check_writable(path, argument: str) -> Path:
    """Fail now, naming `argument`, if `path` cannot be written (before an hour of work, not after)."""
    target = Path(path)
    if target.is_dir():
        raise IsADirectoryError(f"{argument}: {target} is a directory; expected a file path")
    parent = target.parent
    if parent.exists() and not parent.is_dir():
        raise NotADirectoryError(f"{argument}: {parent} is a file, so {target} cannot be created")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".probe", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise PermissionError(f"{argument}: cannot write in {parent} ({e.strerror or type(e).__name__})") from None
    return target
