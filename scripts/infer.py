"""Generate with a Qwen2.5-VL-family model (embedded tiny checkpoint by default) and time it.

Same as `pypto-gym infer`; see `--help`.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pypto_gym.cli import run  # noqa: E402

if __name__ == "__main__":
    run(["infer", *sys.argv[1:]])
