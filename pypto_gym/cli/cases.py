"""`pypto-gym cases run` (scripts/run_cases.py): every case of a file against the golden on one backend."""
from __future__ import annotations

import json
import sys
import time

from . import common


def add_parser(sub):
    p = sub.add_parser("cases", help="test cases: run a case file against a backend")
    cases_sub = p.add_subparsers(dest="cases_command", required=True)
    r = cases_sub.add_parser("run", help="run every case against the golden; exit 1 on any failure")
    r.add_argument("file")
    r.add_argument("--backend", default="auto")
    r.add_argument("--repeat", type=common.NON_NEGATIVE, default=5, help="timed calls per case (median reported)")
    r.add_argument("--json", help="write the rows as JSON")
    r.add_argument("--max-elements", type=common.POSITIVE, default=None,  # the parser imports no torch
                   help="refuse cases with a tensor above this many elements (default: the case files' cap, 2**27)")
    r.add_argument("--quiet", action="store_true", help="no progress line per case on stderr")
    r.set_defaults(func=run)
    c = cases_sub.add_parser("check", help="the npu mapping's verdict per case without an NPU: which torch_npu calls "
                                           "it makes, which it declines and why (deployment readiness)")
    c.add_argument("file")
    c.add_argument("--backend", default="npu", choices=["npu"], help="the mapping checked (npu)")
    c.add_argument("--chip", default="Ascend910B2", help="the chip, as torch_npu names it (Ascend910B2, Ascend910_9392, "
                                                        "Ascend310P3, ...): its series decides the documented limits")
    c.add_argument("--torch-npu", default=None, metavar="MODULE",
                   help="also run every call the mapping takes against this module as torch_npu (a module name, or a "
                        ".py file such as tests/contract/torch_npu_standin.py) and check it against the golden")
    c.add_argument("--max-elements", type=common.POSITIVE, default=None,
                   help="refuse cases with a tensor above this many elements (default: the case files' cap, 2**27)")
    c.add_argument("--json", help="write the rows as JSON")
    c.set_defaults(func=check)


def run(args) -> int:
    from .. import files
    from ..capture.cases import MAX_ELEMENTS, printable
    from ..capture.runner import format_table, run_file

    if args.json:
        files.check_writable(args.json, "--json")
    start = time.perf_counter()

    def progress(i, n, row):
        if not args.quiet:
            print(f"[{i}/{n}] {printable(row['id'])} {row['result']} ({time.perf_counter() - start:.0f} s)",
                  file=sys.stderr, flush=True)

    rows = run_file(args.file, args.backend, args.repeat, progress, args.max_elements or MAX_ELEMENTS)
    print(format_table(rows))
    if args.json:
        files.write_text(args.json, json.dumps(rows, indent=2) + "\n")
    return 0 if all(r["passed"] for r in rows) else 1


def check(args) -> int:
    from pathlib import Path

    from .. import files
    from ..capture.cases import MAX_ELEMENTS
    from ..capture.npu_check import check_file, failed, format_report

    if args.torch_npu and args.torch_npu.endswith(".py") and not Path(args.torch_npu).is_file():
        raise common.UserError(f"--torch-npu: no file at {args.torch_npu}")
    if not args.chip.replace(" ", "").startswith("Ascend"):
        raise common.UserError(f"--chip: got {args.chip!r}; expected a name as torch_npu reports it, e.g. Ascend910B2")
    if args.json:
        files.check_writable(args.json, "--json")
    rows = check_file(args.file, args.chip, args.torch_npu, args.max_elements or MAX_ELEMENTS)
    print(format_report(rows, args.chip))
    if args.json:
        files.write_text(args.json, json.dumps({"chip": args.chip, "rows": rows}, indent=2) + "\n")
    return 1 if failed(rows) else 0
