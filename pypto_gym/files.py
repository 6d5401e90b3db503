"""Writing files without ever leaving a half-written one: every file pypto-gym writes goes through here.

A case file that took an hour of capture, a calibration file, a benchmark's JSON: if the disk
fills or the process dies mid-write, the previous version must survive intact. So the new content
goes to a temporary file in the same directory (same filesystem, so the rename is atomic), is
flushed to disk, and only then replaces the target with `os.replace`. The file gets the mode a
plain `open(path, "w")` would give it: the existing target's mode, else 0o666 minus the umask (a
temporary file is created 0600, which would make a shared cache or a CI artifact unreadable).

Output paths named on the command line are checked before any work (`check_writable`); like `cp`,
a missing parent directory is an error, not something created silently.
"""
from __future__ import annotations

import contextlib
import os
import stat
import sys
import tempfile
import time
from pathlib import Path


def umask() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # no /proc: read it by setting it (and put it back at once)
    os.umask(mask)
    return mask


def _mode_for(target: Path) -> int:
    try:
        return stat.S_IMODE(target.stat().st_mode)
    except OSError:
        return new_file_mode()


def new_file_mode() -> int:
    """The mode a plain open(path, "w") gives a new file: 0o666 minus the umask."""
    return 0o666 & ~umask()


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary path next to `path` (whose directory must exist); on success it replaces `path`
    with the target's mode, on failure it is removed."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, _mode_for(target))
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
    if not parent.exists():
        raise FileNotFoundError(f"{argument}: directory {parent} does not exist (create it first)")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".probe", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise PermissionError(f"{argument}: cannot write in {parent} ({e.strerror or type(e).__name__})") from None
    return target


@contextlib.contextmanager
def exclusive(folder: Path, what: str, wait_s: float):
    """An exclusive OS lock on `folder` (its `.pypto_gym.lock`) for a one-time build two processes may start at
    once (two test workers, two jobs on one cache): the second waits, saying so once, then finds the result. The
    kernel frees the lock if its holder dies; past `wait_s` the waiter raises instead of waiting forever."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock (one process at a time is the user's to keep)
        yield
        return
    with open(folder / ".pypto_gym.lock", "a+") as handle:
        start, said = time.monotonic(), False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not said:
                    print(f"pypto-gym: another process is {what} in {folder}; waiting...", file=sys.stderr, flush=True)
                    said = True
                if time.monotonic() - start > wait_s:
                    raise TimeoutError(f"{folder / '.pypto_gym.lock'} held for over {wait_s} s by another process "
                                       f"({what})") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
