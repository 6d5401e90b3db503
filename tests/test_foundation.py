"""The embedded checkpoint, the GutenOCR-3B-shaped builder and scripts/infer.py."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pypto_gym import models
from pypto_gym.cli import main as cli_main
from pypto_gym.models.qwen2_5_vl import GUTENOCR_CONFIG, load, random_model

ROOT = Path(__file__).resolve().parent.parent


def test_embedded_checkpoint_generates_deterministically(tiny_loaded, sample_inputs):
    model, processor = tiny_loaded
    assert model.config.model_type == "qwen2_5_vl"
    assert sample_inputs["input_ids"].shape[1] > 16  # image tokens were expanded
    with torch.inference_mode():
        a = model.generate(**sample_inputs, max_new_tokens=6, do_sample=False)
        b = model.generate(**sample_inputs, max_new_tokens=6, do_sample=False)
    assert a.shape[1] == sample_inputs["input_ids"].shape[1] + 6
    assert torch.equal(a, b)
    assert isinstance(processor.decode(a)[0], str)


def test_gutenocr_shaped_model_has_real_dimensions():
    model, _ = random_model(GUTENOCR_CONFIG, num_layers=2, vision_depth=2)
    norms = {n: m for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")}
    text = {n: m.weight.shape[0] for n, m in norms.items() if "visual" not in n}
    vision = {n: m.weight.shape[0] for n, m in norms.items() if "visual" in n}
    assert len(text) == 2 * 2 + 1 and set(text.values()) == {2048}
    assert len(vision) == 2 * 2 + 1 and set(vision.values()) == {1280}
    assert model.config.text_config.num_attention_heads == 16
    assert next(model.parameters()).dtype == torch.bfloat16


def run_infer(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "infer.py"), *args],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_infer_script_end_to_end(tmp_path):
    report = tmp_path / "r.json"
    proc = run_infer("--max-new-tokens", "4", "--report-file", str(report))
    assert proc.returncode == 0, proc.stderr
    assert "generated:" in proc.stdout and "tokens/s" in proc.stdout
    data = json.loads(report.read_text())
    for key in ("text", "load_s", "prefill_s", "decode_tokens_per_s", "peak_memory_mb", "new_tokens"):
        assert key in data, key
    assert data["new_tokens"] == 4 and data["prefill_s"] > 0 and data["peak_memory_mb"] > 0


@pytest.mark.parametrize("case", ["missing_model", "corrupt_model", "missing_image", "corrupt_image"])
def test_infer_bad_paths_give_one_line_error(tmp_path, case):
    bad_dir = tmp_path / "model"
    bad_file = tmp_path / "image.png"
    if case == "corrupt_model":
        bad_dir.mkdir()
        (bad_dir / "config.json").write_text("{not json")
    if case == "corrupt_image":
        bad_file.write_bytes(b"\x89PNG but not really")
    args = ["--model", str(bad_dir)] if "model" in case else ["--image", str(bad_file)]
    proc = run_infer(*args)
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert str(bad_dir if "model" in case else bad_file) in lines[0]


def test_loader_refuses_dir_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load(tmp_path)


def test_every_subpackage_is_installed_by_a_normal_install():
    """pyproject lists packages explicitly (modeling/ is mapped in): a new subpackage must be listed too."""
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parent.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "pypto_gym").rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)


@pytest.mark.parametrize("name", [f.name for f in models.tiny_families()])
def test_every_shipped_tiny_checkpoint_names_its_architecture(name, tmp_path):
    """vLLM reads `architectures` to pick the model class (without it a checkpoint is served as a pooling model):
    every shipped config names the class transformers builds from it, and make-tiny-model writes exactly the
    shipped config and weights."""
    family = models.FAMILIES[name]
    shipped = json.loads((family.tiny_dir / "config.json").read_text())
    model, _ = family.load(family.tiny_dir, "bfloat16")
    assert shipped.get("architectures") == [type(model).__name__]
    if family.multimodal:
        return  # its builder also renders the sample images: the text families show the rule
    import transformers

    assert cli_main(["make-tiny-model", "--family", name, "--out", str(tmp_path / "tiny")]) == 0
    assert (tmp_path / "tiny" / "model.safetensors").read_bytes() == (family.tiny_dir / "model.safetensors").read_bytes()
    if transformers.__version__ != shipped.get("transformers_version"):
        pytest.skip(f"the shipped files were written by transformers {shipped.get('transformers_version')}; this is "
                    f"{transformers.__version__} (its config and tokenizer files are spelled otherwise); weights equal")
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "tiny" / f).read_bytes() == (family.tiny_dir / f).read_bytes(), f


def test_make_tiny_model_refuses_a_non_empty_out(tmp_path, capsys):
    """An export (or any other folder) named as --out is not overwritten into a mix of two models."""
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "model.safetensors").write_bytes(b"an export")
    assert cli_main(["make-tiny-model", "--family", "qwen3", "--out", str(tmp_path / "export")]) == 2
    err = capsys.readouterr().err
    assert "--out:" in err and "is not empty" in err and "--force" in err
    assert (tmp_path / "export" / "model.safetensors").read_bytes() == b"an export"
    assert cli_main(["make-tiny-model", "--family", "qwen3", "--out", str(tmp_path / "export"), "--force"]) == 0
