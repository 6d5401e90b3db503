"""vLLM, the engine that serves pypto-gym's exports: it loads them and generates what pypto-gym's own load of
the same export generates (SPEC 11, 12).

vLLM runs in its own venv: .venv-vllm in the repository (scripts/make_vllm_env.sh builds it; CI does) or
$PYPTO_GYM_VLLM_PYTHON. Without one these tests are skipped, saying how to get it. The engines serving exports and
the plugin (`integration`: a minute each) run in CI's second step; command 2 runs the fast checks guarding the same
behaviour: every provider against vLLM's own code in vLLM, vLLM loading an export (the int8 lm_head refusal), and the
exports' format and round trip (tests/test_export.py).
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
    processor = family.load(family.tiny_dir, "bfloat16")[1]
    return [processor([p], None, None)["input_ids"][0].tolist() for p in family.calibration_prompts[:3]]


def _served_as_pypto_gym_runs_it(family, export_dir) -> None:
    """vLLM's greedy run of the export (3 of the family's prompts, 8 tokens) on its own compressed-tensors W8A8 kernels
    is pypto-gym's by vLLM's rule: two engines' bf16 roundings, so a near-tie may go either way, logprobs within 4 bf16
    ulps."""
    prompts = _prompts(family)
    theirs = compare.vllm_run(VLLM_PYTHON, export_dir, prompts, MAX_TOKENS)
    ours = compare.own_run(export_dir, prompts, MAX_TOKENS)
    assert theirs["quantization"] == "compressed-tensors" and ours["int8_linears"] == 28
    got = compare.agreement(theirs, ours)
    print(f"{family.name} {export_dir.name}: {got}")
    assert got["close"], (got, theirs["outputs"], ours["outputs"])
    assert got["max_logprob_diff_ulps"] <= 4 and got["max_topk_gap_ulps"] <= 4, got


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def calibrated_export(request, tmp_path_factory):
    """A family's tiny checkpoint calibrated and exported with default options (compressed-tensors), and again
    with --release-float-weights: the deployment path must write the same checkpoint."""
    family = models.FAMILIES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    calib = tmp / "smooth.safetensors"
    assert cli_main(["calibrate", "--model", str(family.tiny_dir), "--max-new-tokens", "2", "--out", str(calib)]) == 0
    for name, extra in (("default", []), ("released", ["--release-float-weights"]),
                        ("static", ["--quant", "w8a8_static"])):
        assert cli_main(["export", "--model", str(family.tiny_dir), "--calibration", str(calib), *extra,
                         str(tmp / name)]) == 0
    return family, tmp


@pytest.mark.integration
def test_vllm_serves_the_default_export_as_pypto_gym_runs_it(calibrated_export):
    """vLLM refused every default export (an int8 lm_head it cannot load) and took the tiny checkpoints for pooling
    models (no `architectures`): now it loads the calibrated export, runs its own W8A8 kernels on it, and its greedy
    run is pypto-gym's over 8 tokens for 3 prompts by vLLM's rule (tokens equal up to a near-tie both top-5 lists
    hold: on a tiny random model the top logprobs are a few bf16 ulps apart), logprobs within 4 bf16 ulps."""
    family, tmp = calibrated_export
    for f in ("model.safetensors", "config.json"):  # releasing the float weights changes nothing written
        assert (tmp / "released" / f).read_bytes() == (tmp / "default" / f).read_bytes(), f
    config = json.loads((tmp / "default" / "config.json").read_text())
    assert config["architectures"] and "lm_head" in config["quantization_config"]["ignore"]
    _served_as_pypto_gym_runs_it(family, tmp / "default")


@pytest.mark.integration
def test_vllm_serves_the_static_export_as_pypto_gym_runs_it(calibrated_export):
    """The static scheme's compressed-tensors export (per-tensor static, asymmetric int8 inputs: input_scale and
    input_zero_point) runs on vLLM's own W8A8 kernels (CompressedTensorsW8A8Int8 with a static, asymmetric input)
    and generates pypto-gym's tokens by vLLM's rule."""
    family, tmp = calibrated_export
    config = json.loads((tmp / "static" / "config.json").read_text())
    activations = config["quantization_config"]["config_groups"]["group_0"]["input_activations"]
    assert (activations["strategy"], activations["dynamic"], activations["symmetric"]) == ("tensor", False, False)
    _served_as_pypto_gym_runs_it(family, tmp / "static")


def test_an_int8_lm_head_export_is_refused_by_vllm_as_the_summary_says(tmp_path):
    """--int8-lm-head writes what vLLM does not load (its ParallelLMHead is never quantised): the export says so,
    and vLLM indeed refuses it."""
    out = tmp_path / "int8_head"
    assert cli_main(["export", "--model", str(models.FAMILIES["llama"].tiny_dir), "--int8-lm-head", str(out)]) == 0
    with pytest.raises(RuntimeError, match="lm_head.weight_scale"):
        compare.vllm_run(VLLM_PYTHON, out, [[1, 2, 3]], 2)


# ---- pypto-gym's kernels inside vLLM (the plugin, pypto_gym/vllm) ------------------------------------------------
def _vllm_env(tmp_path, **extra):
    return {"PYPTO_GYM_VLLM": "1", "PYPTO_GYM_VLLM_REPORT": str(tmp_path / "report"),
            "PYPTO_GYM_VLLM_CAPTURE": str(tmp_path / "capture"), "PYPTO_GYM_STRICT": "0", **extra}


def test_every_provider_takes_vllms_own_semantics_in_vllm():
    """Run in vLLM's venv (tests/vllm_checks.py): each provider on the torch backend is bit-identical to vLLM's
    reference (impls["native"], forward_native) in fp32, bf16 and fp16 (fused_add_rms_norm too: the op's fp32_sum
    norm input is vLLM's), on the cpu kernels within SPEC 5; the rotary embeddings in place; a variance_size and
    GPT-J's rotation declined and counted."""
    import subprocess

    proc = subprocess.run([VLLM_PYTHON, str(ROOT / "tests" / "vllm_checks.py")], capture_output=True, text=True,
                          timeout=900)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("vllm_checks: ")), None)
    assert proc.returncode == 0 and line, proc.stdout[-2000:] + proc.stderr[-2000:]
    failures = json.loads(line[len("vllm_checks: "):])
    assert len(failures) >= 15 and not any(failures.values()), failures


@pytest.mark.integration
@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_the_plugin_serves_the_same_tokens_and_says_what_ran_where(name, tmp_path):
    """fp32, 4 prompts in one batch, 32 tokens: vLLM's greedy tokens with pypto-gym's kernels equal its own, every
    provider the model uses is called (in the worker process of a deployment's engine: the report merges every
    process), and the shapes vLLM's scheduler produced become a case file that `cases run --backend cpu` passes."""
    from pypto_gym.capture.runner import run_file
    from pypto_gym.vllm import report

    family = models.FAMILIES[name]
    prompts = [ids for ids in _prompts(family)] + [[5, 6, 7]]
    plain = compare.vllm_run(VLLM_PYTHON, family.tiny_dir, prompts, 32, dtype="float32")
    fused = compare.vllm_run(VLLM_PYTHON, family.tiny_dir, prompts, 32, dtype="float32", env=_vllm_env(tmp_path),
                             processes=True)
    assert compare.agreement(plain, fused)["tokens_equal"], (plain["outputs"], fused["outputs"])
    merged = report.merged(tmp_path / "report")
    assert len(merged["processes"]) >= 2  # the main process, the engine core and the worker write one each
    for op in ("rms_norm", "fused_add_rms_norm", "SiluAndMul", "RotaryEmbedding"):
        row = merged["ops"][op]
        assert row["calls"] > 0 and set(row["ran_on"]) == {"cpu"} and not row["fallbacks"], (op, row)
    info = report.merge_cases(tmp_path / "capture", tmp_path / "served.json")
    assert info["cases"] >= 4
    rows = run_file(tmp_path / "served.json", "cpu", 1)
    assert rows and all(r["passed"] and r["backend"] == "cpu" for r in rows)
    cases = json.loads((tmp_path / "served.json").read_text())["test_cases"]
    batches = {c["input"][next(iter(c["input"]))]["shape"][0] for c in cases if c["op"] == "rms_norm"}
    assert len(batches) >= 2  # prefill chunks and decode batches of several sequences


@pytest.mark.integration
def test_bf16_serving_takes_every_provider_and_keeps_vllms_tokens(tmp_path):
    """bf16, the dtype a deployment serves: fused_add_rms_norm is taken too (vLLM normalises the unrounded fp32 sum,
    which the op's fp32_sum norm input reads), nothing is declined, and the greedy run is vLLM's own by vLLM's rule
    for comparing two runs (compare.agreement)."""
    from pypto_gym.vllm import report

    family = models.FAMILIES["qwen3"]
    prompts = _prompts(family)[:2]
    plain = compare.vllm_run(VLLM_PYTHON, family.tiny_dir, prompts, 8)
    fused = compare.vllm_run(VLLM_PYTHON, family.tiny_dir, prompts, 8, env=_vllm_env(tmp_path))
    got = compare.agreement(plain, fused)  # bf16 kernels round differently from vLLM's torch code: near-ties may flip
    assert got["close"] and got["max_logprob_diff_ulps"] <= 4, (got, plain["outputs"], fused["outputs"])
    ops = report.merged(tmp_path / "report")["ops"]
    for op in ("rms_norm", "fused_add_rms_norm", "SiluAndMul", "RotaryEmbedding"):
        assert ops[op]["calls"] > 0 and not ops[op]["declined"] and set(ops[op]["ran_on"]) == {"cpu"}, (op, ops[op])


def tiny_gptj(out: Path) -> Path:
    """A one-layer GPT-J (random weights, the tiny Llama's tokenizer): vLLM rotates it GPT-J style (interleaved),
    which no pypto-gym rotary op computes."""
    import shutil

    import torch
    from transformers import GPTJConfig, GPTJForCausalLM

    llama = models.FAMILIES["llama"].tiny_dir
    vocab = json.loads((llama / "config.json").read_text())["vocab_size"]
    config = GPTJConfig(vocab_size=vocab, n_positions=256, n_embd=128, n_layer=1, n_head=2, rotary_dim=16,
                        bos_token_id=1, eos_token_id=2, architectures=["GPTJForCausalLM"])
    torch.manual_seed(0)
    GPTJForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama / name, out / name)
    return out


@pytest.mark.integration
def test_a_declined_call_is_counted_with_its_reason_and_strict_mode_raises(tmp_path):
    """GPT-J's interleaved rotation: the provider declines it to vLLM's native code, counted with the reason; with
    PYPTO_GYM_STRICT=1 the engine stops with the reason instead."""
    from pypto_gym.vllm import report

    model = tiny_gptj(tmp_path / "gptj")
    fused = compare.vllm_run(VLLM_PYTHON, model, [[5, 6, 7]], 4, dtype="float32", env=_vllm_env(tmp_path))
    assert len(fused["outputs"][0]["token_ids"]) == 4
    declined = report.merged(tmp_path / "report")["ops"]["RotaryEmbedding"]["declined"]
    assert any(reason.startswith("GPT-J interleaved rotation") and n > 0 for reason, n in declined.items()), declined
    with pytest.raises(RuntimeError, match="would run vLLM's native code \\(strict mode\\)"):
        compare.vllm_run(VLLM_PYTHON, model, [[5, 6, 7]], 2, dtype="float32",
                         env=_vllm_env(tmp_path / "strict", PYPTO_GYM_STRICT="1"))


@pytest.mark.integration
def test_tensor_parallel_ranks_run_the_sharded_shapes_and_report_together(tmp_path):
    """tensor_parallel_size=2 on vLLM's CPU backend (one core per rank: VLLM_CPU_OMP_THREADS_BIND="0|1", else it
    refuses to bind two workers on one NUMA node): the tokens of one rank, both ranks' counters in the merged
    report, and the MLP's activation captured at half the intermediate width (each rank's shard)."""
    from pypto_gym.vllm import report

    family = models.FAMILIES["qwen3"]
    prompts = _prompts(family)[:2]
    one = compare.vllm_run(VLLM_PYTHON, family.tiny_dir, prompts, 8, dtype="float32", env=_vllm_env(tmp_path / "a"))
    two = compare.vllm_run(VLLM_PYTHON, family.tiny_dir, prompts, 8, dtype="float32", tensor_parallel_size=2,
                           env={**_vllm_env(tmp_path / "b"), "VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert compare.agreement(one, two)["tokens_equal"]
    per_process = [json.loads(p.read_text())["ops"]["SiluAndMul"]["calls"]
                   for p in (tmp_path / "b" / "report").glob("*.json")]
    assert sum(1 for n in per_process if n > 0) == 2  # both ranks ran the provider
    report.merge_cases(tmp_path / "b" / "capture", tmp_path / "tp.json")
    widths = {c["input"]["x"]["shape"][-1] for c in json.loads((tmp_path / "tp.json").read_text())["test_cases"]
              if c["op"] == "silu_and_mul"}
    intermediate = json.loads((family.tiny_dir / "config.json").read_text())["intermediate_size"]
    assert widths == {intermediate}, widths  # gate and up halves of the rank's shard: 2 * intermediate / 2


@pytest.mark.integration
def test_vllm_serves_the_text_only_export_of_a_qwen3_vl(tmp_path):
    """vllm-cpu serves text models: `export --text-only` writes the tiny Qwen3-VL's decoder as a Qwen3ForCausalLM,
    which vLLM loads with its own W8A8 kernels and whose greedy run is pypto-gym's by vLLM's rule."""
    family = models.FAMILIES["qwen3_vl"]
    calib = tmp_path / "smooth.safetensors"
    assert cli_main(["calibrate", "--model", str(family.tiny_dir), "--max-new-tokens", "2", "--out", str(calib)]) == 0
    assert cli_main(["export", "--model", str(family.tiny_dir), "--calibration", str(calib), "--text-only",
                     str(tmp_path / "text")]) == 0
    _served_as_pypto_gym_runs_it(family, tmp_path / "text")
