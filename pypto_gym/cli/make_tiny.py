"""`pypto-gym make-tiny-model` (scripts/make_tiny_model.py): rebuild a family's embedded tiny checkpoint."""
from __future__ import annotations

from pathlib import Path

from . import common


def add_parser(sub):
    from .. import models

    names = [f.name for f in models.tiny_families()]
    p = sub.add_parser("make-tiny-model", help="rebuild an embedded tiny checkpoint (deterministic: same bytes)")
    p.add_argument("--family", default=models.DEFAULT.name, choices=names)
    p.add_argument("--out", type=Path, help="directory (default: the family's checkpoint in modeling/)")
    p.add_argument("--seed", type=common.NON_NEGATIVE, default=0)
    p.add_argument("--force", action="store_true", help="write into a non-empty --out")
    p.set_defaults(func=run)


def run(args) -> int:
    from .. import models

    family = models.FAMILIES[args.family]
    out = args.out or family.tiny_dir
    if out.exists() and not out.is_dir():
        raise common.UserError(f"--out: {out} is a file; expected a directory")
    foreign = out.is_dir() and any(out.iterdir()) and out.resolve() != family.tiny_dir.resolve()
    if foreign and not args.force:  # an export or another checkpoint would be left a mix of two models
        raise common.UserError(f"--out: {out} is not empty; expected a new or empty directory (or --force to "
                                f"write the tiny checkpoint's files into it)")
    family.build_tiny(out, args.seed)
    print(f"wrote {out}")
    return 0
