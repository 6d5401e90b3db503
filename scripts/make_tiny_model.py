"""Rebuild an embedded tiny checkpoint in modeling/ (deterministic: same bytes every run).

Same as `pypto-gym make-tiny-model`; see `--help`. Every test and the demo run a *real* transformers
model (same classes, processor and chat template as the family) with no model hub: a byte-level BPE
tokenizer trained offline on modeling/tiny_qwen2_5_vl/corpus.txt, random weights from a fixed seed.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pypto_gym.cli import run  # noqa: E402

if __name__ == "__main__":
    run(["make-tiny-model", *sys.argv[1:]])
