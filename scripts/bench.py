"""Benchmarks: `ops`, `cases FILE`, `pypto FILE`, `e2e`. Same as `pypto-gym bench ...`; see --help."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pypto_gym.cli import run  # noqa: E402

if __name__ == "__main__":
    run(["bench", *sys.argv[1:]])
