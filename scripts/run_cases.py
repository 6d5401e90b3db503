"""Run every case of a JSON case file against a backend and the golden; exit 1 on any failure.

Same as `pypto-gym cases run FILE [--backend NAME]`.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pypto_gym.cli import run  # noqa: E402

if __name__ == "__main__":
    run(["cases", "run", *sys.argv[1:]])
