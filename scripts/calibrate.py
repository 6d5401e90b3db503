"""SmoothQuant calibration for `--quant w8a8`: smooth scales from generate on real inputs.

Same as `pypto-gym calibrate`; see `--help`. On the embedded checkpoint:
    python scripts/calibrate.py --out out/tiny_smooth.safetensors
then  python scripts/infer.py --use_pto --quant w8a8 --calibration out/tiny_smooth.safetensors
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pypto_gym.cli import run  # noqa: E402

if __name__ == "__main__":
    run(["calibrate", *sys.argv[1:]])
