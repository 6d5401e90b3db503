"""Record the real shapes every RMSNorm sees during generate into pypto-gym JSON test cases.

Same as `pypto-gym capture`; see `--help`. GutenOCR-3B dimensions without weights:
    python scripts/capture_shapes.py --config modeling/gutenocr_3b/config.json --num-layers 2 \\
        --vision-depth 2 --out tests/cases/gutenocr_3b.json
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pypto_gym.cli import run  # noqa: E402

if __name__ == "__main__":
    run(["capture", *sys.argv[1:]])
