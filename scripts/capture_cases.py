"""Capture every committed case file in tests/cases/ again, exactly as it was made (the one list of how).

    python scripts/capture_cases.py                 # rewrite every file in tests/cases/
    python scripts/capture_cases.py tiny_qwen3.json  # one of them
    python scripts/capture_cases.py --into DIR       # write them elsewhere (tests compare those with the committed)

Each file is the `pypto-gym capture` (and `calibrate`) commands below, run into a fresh file: the committed
cases are what capture writes now, and tests/test_capture.py fails when one is not. The GutenOCR-3B and Qwen3-VL-2B
files use random weights at their real dimensions (2 text layers; 2 and 6 vision blocks) and need native bf16 to run in
minutes.
"""
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GUTENOCR = ["--config", str(ROOT / "modeling/gutenocr_3b/config.json"), "--num-layers", "2", "--vision-depth", "2",
            "--dtype", "bfloat16"]
QWEN3_VL_2B = ["--config", str(ROOT / "modeling/qwen3_vl_2b/config.json"), "--num-layers", "2", "--vision-depth", "6",
               "--dtype", "bfloat16"]  # six blocks: the first DeepStack tap (after block 5) is among them
W8A8 = ["--use_pto", "--backend", "cpu", "--quant", "w8a8", "--calibration", "{tmp}/gutenocr_3b_2l_smooth.safetensors"]
RECIPES = {  # file -> the commands (argv of `pypto-gym`) that write it; {out} is the file, {tmp} a scratch folder
    "tiny_qwen2_5_vl.json": [["capture", "--model", str(ROOT / "modeling/tiny_qwen2_5_vl"), "--dtype", "bfloat16",
                              "--model-name", "tiny_qwen2_5_vl", "--out", "{out}"]],
    "tiny_qwen3.json": [["capture", "--model", str(ROOT / "modeling/tiny_qwen3"), "--dtype", "bfloat16",
                         "--model-name", "tiny_qwen3", "--out", "{out}"]],
    "tiny_llama.json": [["capture", "--model", str(ROOT / "modeling/tiny_llama"), "--dtype", "bfloat16",
                         "--model-name", "tiny_llama", "--out", "{out}"]],
    "tiny_qwen3_vl.json": [["capture", "--model", str(ROOT / "modeling/tiny_qwen3_vl"), "--dtype", "bfloat16",
                            "--model-name", "tiny_qwen3_vl", "--out", "{out}"]],
    "qwen3_vl_2b.json": [["capture", *QWEN3_VL_2B, "--model-name", "qwen3_vl_2b", "--out", "{out}"]],
    "gutenocr_3b.json": [["capture", *GUTENOCR, "--model-name", "gutenocr_3b", "--out", "{out}"],
                         ["capture", *GUTENOCR, "--model-name", "gutenocr_3b", "--out", "{out}", "--batch-size", "2"]],
    "gutenocr_3b_w8a8.json": [
        ["calibrate", *GUTENOCR, "--max-new-tokens", "4", "--out", "{tmp}/gutenocr_3b_2l_smooth.safetensors"],
        ["capture", *GUTENOCR, *W8A8, "--model-name", "gutenocr_3b_w8a8", "--out", "{out}"],
        ["capture", *GUTENOCR, *W8A8, "--model-name", "gutenocr_3b_w8a8", "--out", "{out}", "--batch-size", "2"]],
}


def capture(name: str, out: Path) -> None:
    """Run `name`'s recipe, writing a fresh case file at `out` (an existing one is replaced)."""
    from pypto_gym.cli import main

    out.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for argv in RECIPES[name]:
            argv = [a.format(out=out, tmp=tmp) for a in argv]
            if main(argv) != 0:
                raise SystemExit(f"capture_cases: {name}: `pypto-gym {' '.join(argv)}` failed")


def main(argv) -> int:
    into = ROOT / "tests" / "cases"
    if argv[:1] == ["--into"]:
        into, argv = Path(argv[1]), argv[2:]
    unknown = [a for a in argv if a not in RECIPES]
    if unknown:
        print(f"capture_cases: {unknown[0]!r} is not a committed case file ({', '.join(RECIPES)})", file=sys.stderr)
        return 2
    for name in argv or RECIPES:
        capture(name, into / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
