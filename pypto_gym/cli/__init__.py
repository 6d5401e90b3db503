"""The `pypto-gym` command: bring a HuggingFace model to fused kernels, check them, measure them.

One module per subcommand (infer, capture, calibrate, tune, export, cases, bench, make_tiny); scripts/*.py are
thin aliases of the same subcommands. Exit status: 0 success (benchmarks: every goal met), 1 a case
failed or was not run (benchmarks: a goal missed), 2 bad usage or input (one line on stderr, no
traceback; PYPTO_GYM_DEBUG=1 shows it), 130 interrupted.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

from . import bench, calibrate, capture, cases, export, infer, make_tiny, tune
from .common import Parser, UserError

DESCRIPTION = """Patch a HuggingFace model (Qwen2.5-VL / GutenOCR-3B, Qwen2-VL, Qwen3-VL, Qwen3, Llama) with fused kernels
(PyPTO, torch_npu, or fused CPU kernels), capture the real shapes its sites see as test cases, check every
kernel against a golden on them, and measure what the swap buys."""

EPILOG = """examples:
  pypto-gym infer --use_pto                            generate with the embedded model, patched
  pypto-gym capture --out cases.json                   record every site's real shapes
  pypto-gym cases run cases.json --backend cpu         check a backend against the goldens
  pypto-gym bench ops                                  op-level benchmarks (ratios, goals, JSON, PNG)
environment: USE_PTO_RMS_NORM, PYPTO_GYM_BACKEND, PYPTO_GYM_SITES, PYPTO_GYM_FUSE_RESIDUAL, PYPTO_GYM_STRICT,
PYPTO_GYM_CACHE (see README)."""

COMMANDS = (infer, capture, calibrate, tune, export, cases, bench, make_tiny)


def build_parser() -> Parser:
    import argparse

    ap = Parser(prog="pypto-gym", description=DESCRIPTION, epilog=EPILOG,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return ap


def main(argv=None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:  # Ctrl-C while the parser is built: nothing has started
        return _interrupted(_command_named(sys.argv[1:] if argv is None else argv))
    if args.command is None:  # `pypto-gym` alone: what it can do
        build_parser().print_help(sys.stderr)
        return 2
    try:
        with _interrupts_deferred():
            import torch  # noqa: F401  (torch's C++ initialisers abort the process on a KeyboardInterrupt)
        return args.func(args)
    except KeyboardInterrupt:
        return _interrupted(args.command)
    except Exception as e:
        if _caused_by_ctrl_c(e):  # Ctrl-C inside a class body or a lazy import: a RuntimeError or ImportError wraps it
            return _interrupted(args.command)
        if not isinstance(e, (UserError, OSError, ValueError, TypeError, RuntimeError)):
            raise
        if os.environ.get("PYPTO_GYM_DEBUG"):
            raise
        text = " ".join(str(e).split()) or type(e).__name__
        print(f"pypto-gym {args.command}: error: {text}", file=sys.stderr)
        return 2


def run(argv=None) -> None:
    """`pypto-gym`, `python -m pypto_gym.cli` and the scripts: main's exit code. An interrupted command (130) ends with
    os._exit after flushing its output: CPython marks a Ctrl-C as unhandled when it passes through Python code a C
    extension runs (PyRun_*), even when main catches it, and then ends the process by SIGINT (-2) instead of 130
    (seen 2 times in 16 at ~1.2 s into an export, the flag read at exit). Every file is written atomically at the
    end of a command, so skipping the interpreter's teardown leaves nothing half-written."""
    code = main(argv)
    if code == 130:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: nothing more can be said
                pass
        os._exit(130)
    raise SystemExit(code)


@contextlib.contextmanager
def _interrupts_deferred():
    """Inside: Ctrl-C is held until the end (then raised as KeyboardInterrupt), for code a KeyboardInterrupt must not
    enter: raised inside torch's C++ static initialisers it terminated the process with a C++ abort. A SIGINT the
    process ignores (started in the background) stays ignored."""
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN or threading.current_thread() is not threading.main_thread():
        yield  # ignored, or not the main thread's to handle
        return
    held = []
    signal.signal(signal.SIGINT, lambda *_: held.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt


def _command_named(argv) -> str:
    """The subcommand in a command line not yet parsed (for the interrupted line): its first word."""
    return next((a for a in argv if not a.startswith("-")), "")


def _interrupted(command: str) -> int:
    # every file is written atomically at the end of a command: an interrupted one wrote nothing
    print(f"pypto-gym{' ' + command if command else ''}: interrupted; nothing written", file=sys.stderr)
    return 130


def _caused_by_ctrl_c(error: BaseException) -> bool:
    """A KeyboardInterrupt somewhere in the error's chain (`Error calling __set_name__ ...` from a lazy import
    of transformers interrupted half-way, for one)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


__all__ = ["main", "run", "build_parser", "UserError"]
