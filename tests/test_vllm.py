"""vLLM, the engine that serves pypto-gym's exports: it loads them and generates what pypto-gym's own load of
the same export generates (SPEC 11, 12).

vLLM runs in its own venv: .venv-vllm in the repository (scripts/make_vllm_env.sh builds it; CI does) or
$PYPTO_GYM_VLLM_PYTHON. Without one these tests are skipped, saying how to get it.
"""
import json
import os
from pathlib import Path

import pytest

from pypto_gym import models
from pypto_gym.cli import main as cli_main
from pypto_gym.vllm import compare

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = os.environ.get("PYPTO_GYM_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    not Path(VLLM_PYTHON).is_file(), reason=f"no vLLM venv at {VLLM_PYTHON} (scripts/make_vllm_env.sh builds one; "
                                            f"or set PYPTO_GYM_VLLM_PYTHON)")]
MAX_TOKENS = 8


def _prompts(family):
    processor = family.load(family.TINY_DIR, "bfloat16")[1]
    return [processor([p], None, None)["input_ids"][0].tolist() for p in family.CALIBRATION_PROMPTS[:3]]


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def calibrated_export(request, tmp_path_factory):
    """A family's tiny checkpoint calibrated and exported with default options (compressed-tensors), and again
    with --release-float-weights: the deployment path must write the same checkpoint."""
    family = models.FAMILIES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    calib = tmp / "smooth.safetensors"
    assert cli_main(["calibrate", "--model", str(family.TINY_DIR), "--max-new-tokens", "2", "--out", str(calib)]) == 0
    for name, extra in (("default", []), ("released", ["--release-float-weights"])):
        assert cli_main(["export", "--model", str(family.TINY_DIR), "--calibration", str(calib), *extra,
                         str(tmp / name)]) == 0
    return family, tmp


def test_vllm_serves_the_default_export_as_pypto_gym_runs_it(calibrated_export):
    """vLLM refused every default export (an int8 lm_head it cannot load) and took the tiny checkpoints for pooling
    models (no `architectures`): now it loads the calibrated export, runs its own W8A8 kernels on it, and its greedy
    tokens equal pypto-gym's over 8 tokens for 3 prompts, its top-5 logprobs within bf16's rounding."""
    family, tmp = calibrated_export
    for f in ("model.safetensors", "config.json"):  # releasing the float weights changes nothing written
        assert (tmp / "released" / f).read_bytes() == (tmp / "default" / f).read_bytes(), f
    config = json.loads((tmp / "default" / "config.json").read_text())
    assert config["architectures"] and "lm_head" in config["quantization_config"]["ignore"]
    prompts = _prompts(family)
    theirs = compare.vllm_run(VLLM_PYTHON, tmp / "default", prompts, MAX_TOKENS)
    ours = compare.own_run(tmp / "default", prompts, MAX_TOKENS)
    assert theirs["quantization"] == "compressed-tensors" and ours["int8_linears"] == 28
    got = compare.agreement(theirs, ours)
    print(f"{family.NAME}: {got}")
    assert got["tokens_equal"], (theirs["outputs"], ours["outputs"])
    assert got["max_logprob_diff"] < 0.05 and got["min_topk_overlap"] >= 0.6, got


def test_an_int8_lm_head_export_is_refused_by_vllm_as_the_summary_says(tmp_path):
    """--int8-lm-head writes what vLLM does not load (its ParallelLMHead is never quantised): the export says so,
    and vLLM indeed refuses it."""
    out = tmp_path / "int8_head"
    assert cli_main(["export", "--model", str(models.FAMILIES["llama"].TINY_DIR), "--int8-lm-head", str(out)]) == 0
    with pytest.raises(RuntimeError, match="lm_head.weight_scale"):
        compare.vllm_run(VLLM_PYTHON, out, [[1, 2, 3]], 2)
