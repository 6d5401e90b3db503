"""`pypto-gym export` / quant.export: a W8A8 model as a compressed-tensors checkpoint, checked against its real
consumers: transformers' from_pretrained (through compressed-tensors) and pypto-gym's own loader."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pypto_gym import models, patch_model, unpatch_model
from pypto_gym.cli import main as cli_main
from pypto_gym.inference import open_image
from pypto_gym.models.qwen2_5_vl import SAMPLE_IMAGE
from pypto_gym.patching import PatchError
from pypto_gym.patching.api import _STATE_ATTR
from pypto_gym.quant import export
from pypto_gym.quant.linear import quant_linear_of

from models import assert_fold_scales_the_input


def _inputs(processor, family):
    if family.multimodal:
        return processor(["Read the text in the image."], [open_image(SAMPLE_IMAGE)], None)
    return processor(list(family.calibration_prompts[:2]), None, None)


def _logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits.float()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The embedded Qwen2.5-VL in fp32, W8A8 on cpu (every linear int8), its logits, and its export."""
    model, processor, family = models.load(None, "float32")
    patch_model(model, backend="cpu", quant="w8a8")
    out = tmp_path_factory.mktemp("ct") / "tiny_w8a8"
    wrote = export.save(model, out, processor)
    return model, processor, family, _logits(model, _inputs(processor, family)), out, wrote


def test_the_export_holds_the_int8_weights_and_scales_the_model_runs(exported):
    model, _, _, _, out, wrote = exported
    tensors = load_file(str(out / "model.safetensors"))
    assert len(wrote["int8"]) == 50 and wrote["ignore"] == ["lm_head"]  # the tied lm_head is the embedding's table
    for path in wrote["int8"]:
        ql = quant_linear_of(model.get_submodule(path))
        assert tensors[f"{path}.weight"].dtype == torch.int8 and torch.equal(tensors[f"{path}.weight"], ql.w_q)
        scale = tensors[f"{path}.weight_scale"]
        assert scale.dtype == torch.float32 and scale.shape == (ql.w_q.shape[0], 1)
        assert torch.equal(scale.flatten(), ql.w_scale)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "int-quantized" and qc["ignore"] == ["lm_head"]
    group = qc["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "channel" and group["input_activations"]["strategy"] == "token"
    assert group["input_activations"]["dynamic"] is True
    from compressed_tensors.quantization import QuantizationConfig

    parsed = QuantizationConfig.model_validate(qc)  # compressed-tensors' own schema accepts it
    assert parsed.config_groups["group_0"].weights.num_bits == 8
    for name in ("tokenizer.json", "preprocessor_config.json", "generation_config.json", "chat_template.jinja"):
        assert (out / name).is_file(), name


def test_transformers_loads_the_export_and_agrees(exported):
    """transformers + compressed-tensors run the export as W8A8 emulation (int8 weights dequantised, activations
    quantised per token with their own rounding): the logits agree with ours within the format's precision."""
    from transformers import AutoModelForImageTextToText

    model, processor, family, ours, out, wrote = exported
    hf = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    theirs = _logits(hf, _inputs(processor, family))
    float_model = models.load(None, "float32")[0]
    ref = _logits(float_model, _inputs(processor, family))
    live = ref.abs().amax(-1) > 0
    cos = torch.nn.functional.cosine_similarity(theirs[live], ours[live], dim=-1)
    assert float(cos.min()) > 0.999, float(cos.min())
    path = wrote["int8"][0]  # the weight transformers runs is ours, dequantised
    ql = quant_linear_of(model.get_submodule(path))
    w = hf.get_submodule(path).weight
    assert torch.allclose(w.float(), ql.w_q.float() * ql.w_scale.unsqueeze(-1), rtol=1e-6, atol=0)


def test_pypto_gym_loads_the_export_onto_the_fused_kernels_with_equal_logits(exported):
    model, processor, family, ours, out, wrote = exported
    loaded, loaded_processor, fam, report = export.load(out, backend="cpu")
    assert fam is family
    assert torch.equal(_logits(loaded, _inputs(loaded_processor, family)), ours)
    q = report.to_json()["w8a8"]
    assert q["summary"]["int8"] == 50 and q["summary"]["linears"] == 51 and q["summary"]["fallbacks"] == 0
    assert quant_linear_of(loaded.get_submodule("lm_head")) is None  # float, as written
    stored = [p for p in wrote["int8"] if quant_linear_of(loaded.get_submodule(p)).stored]
    assert len(stored) == 50 and all(loaded.get_submodule(p).weight.is_meta for p in stored)  # no float copy
    with pytest.raises(PatchError, match="loaded from an int8 checkpoint: there are no float weights"):
        unpatch_model(loaded)


def test_a_checkpoint_with_the_legacy_tensor_names_loads_the_same(exported, tmp_path):
    """transformers 5.x's own save_pretrained writes Qwen2.5-VL as `model.layers.*` / `visual.*` (the 4.x layout),
    and llm-compressor writes back the layout it read: the loader maps them to the module paths."""
    model, processor, family, ours, out, _ = exported

    def legacy(t, c):
        for k in list(t):
            new = k.replace("model.language_model.", "model.", 1).replace("model.visual.", "visual.", 1)
            t[new] = t.pop(k)

    bad = _damaged(out, tmp_path, legacy)
    assert any(k.startswith("visual.") for k in load_file(str(bad / "model.safetensors")))
    loaded, loaded_processor, _, _ = export.load(bad, backend="cpu")
    assert torch.equal(_logits(loaded, _inputs(loaded_processor, family)), ours)


def test_a_text_family_round_trips(tmp_path):
    family = models.FAMILIES["qwen3"]
    model, processor = family.load(family.tiny_dir, "float32", "cpu")
    patch_model(model, backend="cpu", quant="w8a8")
    ours = _logits(model, _inputs(processor, family))
    export.save(model, tmp_path / "q3", processor)
    loaded, loaded_processor, _, _ = export.load(tmp_path / "q3", backend="cpu")
    assert torch.equal(_logits(loaded, _inputs(loaded_processor, family)), ours)


@pytest.mark.parametrize("fmt", export.FORMATS)
def test_an_int8_lm_head_is_written_only_on_request_and_says_who_loads_it(tmp_path, capsys, fmt):
    """Default: lm_head float, in `ignore` (vLLM's ParallelLMHead is never quantised). --int8-lm-head on the
    untied tiny Llama writes its int8 weight and scale, says which consumers load it, and loads back int8."""
    out = tmp_path / "default"
    assert cli_main(["export", "--model", str(models.FAMILIES["llama"].tiny_dir), "--format", fmt, str(out)]) == 0
    assert "lm_head float (in the ignore list" in capsys.readouterr().out
    if fmt == "compressed-tensors":
        assert "lm_head" in json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    else:
        assert json.loads((out / export.MSMODELSLIM_JSON).read_text())["lm_head.weight"] == "FLOAT"
    out = tmp_path / "int8"
    assert cli_main(["export", "--model", str(models.FAMILIES["llama"].tiny_dir), "--format", fmt, "--int8-lm-head",
                     str(out)]) == 0
    said = capsys.readouterr().out
    assert f"lm_head int8 (--int8-lm-head: {export.LM_HEAD_CONSUMERS[fmt]})" in said
    assert ("vLLM refuses it" if fmt == "compressed-tensors" else "vllm-ascend quantises") in said
    weights = out / ("model.safetensors" if fmt == "compressed-tensors" else export.MSMODELSLIM_WEIGHTS)
    assert load_file(str(weights))["lm_head.weight"].dtype == torch.int8
    loaded, _, _, report = export.load(out, backend="cpu")
    assert quant_linear_of(loaded.get_submodule("lm_head")).stored
    assert report.to_json()["w8a8"]["summary"]["int8"] == 29


def test_an_interrupted_or_failed_export_leaves_nothing(tmp_path, monkeypatch):
    """Everything is staged in a folder beside OUT_DIR and renamed at the end: Ctrl-C after the weights were
    written, or a full disk, leaves no config.json without its quantization_config (which transformers loads as a
    float model of int8 codes), no staging folder, and a rerun works."""
    import errno

    from pypto_gym.models.common import TextProcessor

    family = models.FAMILIES["qwen3"]
    model, processor = family.load(family.tiny_dir, "float32", "cpu")
    patch_model(model, backend="cpu", quant="w8a8")
    for error in (KeyboardInterrupt(), OSError(errno.ENOSPC, "No space left on device"), RuntimeError("disk")):
        def fail(self, out, error=error):
            raise error
        monkeypatch.setattr(TextProcessor, "save_pretrained", fail)
        with pytest.raises((KeyboardInterrupt, OSError)) as got:
            export.save(model, tmp_path / "out", processor)
        if isinstance(error, RuntimeError):  # safetensors' and transformers' own errors become one OSError line
            assert "writing" in str(got.value) and "nothing written" in str(got.value)
        assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    (tmp_path / "out").mkdir()  # an empty folder the user made is taken
    export.save(model, tmp_path / "out", processor)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "out").iterdir()}
    import os

    umask = os.umask(0)
    os.umask(umask)
    assert set(modes.values()) == {0o666 & ~umask}, modes  # the weights file too (save_pretrained wrote it 0600)


def test_an_export_into_a_symlink_goes_into_the_directory_it_names(tmp_path):
    """A symlink to an empty directory ran the whole export, then failed with "Not a directory" renaming the staged
    folder over the link (issue 45, item 8): the export now goes into the directory the link names; a link to
    nothing is refused before any work."""
    family = models.FAMILIES["qwen3"]
    model, processor = family.load(family.tiny_dir, "float32", "cpu")
    patch_model(model, backend="cpu", quant="w8a8")
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    export.save(model, tmp_path / "link", processor)
    assert (tmp_path / "link").is_symlink() and (tmp_path / "target" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "target"]  # no staging folder left
    assert export.load(tmp_path / "link")[0] is not None
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="dangling is a symlink to .*nowhere, which does not exist"):
        export.check_out_dir(tmp_path / "dangling")


@pytest.mark.parametrize("out,needle", [("missing/parent/out", "does not exist (create it first)"),
                                        ("afile", "is a file"), ("full", "exists and is not empty"),
                                        ("ro/out", "cannot write in")])
def test_cli_export_refuses_an_unusable_out_before_loading(tmp_path, capsys, monkeypatch, out, needle):
    import os

    from pypto_gym.cli import common

    (tmp_path / "afile").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    (tmp_path / "ro").mkdir()
    os.chmod(tmp_path / "ro", 0o555)
    monkeypatch.setattr(common, "load_model", lambda *a: pytest.fail("loaded a model before refusing OUT_DIR"))
    try:
        if out == "ro/out" and os.access(tmp_path / "ro", os.W_OK):
            pytest.skip("running as a user who can write into a 0555 folder")
        assert cli_main(["export", str(tmp_path / out)]) == 2
    finally:
        os.chmod(tmp_path / "ro", 0o755)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "out: " in err and needle in err, err
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize("value,needle", [("", "expected comma-separated globs"), (",", "expected comma-separated"),
                                          ("!text.q_proj", "'!' exclusions are not supported here")])
def test_float_linears_that_name_nothing_are_refused(capsys, value, needle):
    assert cli_main(["export", "--float-linears", value, "/nonexistent/x"]) == 2
    assert f"--float-linears: got {value!r}" in capsys.readouterr().err
    assert cli_main(["infer", "--use_pto", "--quant", "w8a8", "--float-linears", value]) == 2
    assert needle in capsys.readouterr().err
    with pytest.raises(ValueError, match=needle):
        patch_model(models.load(None, "float32")[0], backend="cpu", quant="w8a8", float_linears=value)


def _damaged(src, tmp_path, edit, weights="model.safetensors", description="config.json"):
    """A copy of the export `src` with its weights file and its JSON (config.json, or msModelSlim's
    description) passed through `edit(tensors, json)`."""
    dst = tmp_path / "bad"
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(dst / weights))
    data = json.loads((dst / description).read_text())
    edit(tensors, data)
    save_file(tensors, str(dst / weights), metadata={"format": "pt"})
    (dst / description).write_text(json.dumps(data))
    return dst


O_PROJ = "model.language_model.layers.0.self_attn.o_proj"


@pytest.mark.parametrize("edit,match", [
    (lambda t, c: t.pop(f"{O_PROJ}.weight_scale"), f"tensor '{O_PROJ}.weight' is int8 but has no '{O_PROJ}.weight_scale'"),
    (lambda t, c: t.__setitem__(f"{O_PROJ}.weight_scale", t[f"{O_PROJ}.weight_scale"][:-1]),
     rf"tensor '{O_PROJ}.weight_scale' is float32 \[127, 1\]; expected a float \[128, 1\]"),
    (lambda t, c: t.__setitem__(f"{O_PROJ}.weight", t[f"{O_PROJ}.weight"].float()),
     rf"tensor '{O_PROJ}.weight' is float32 \[128, 128\]; expected int8"),
    (lambda t, c: t.__setitem__(f"{O_PROJ}.weight", t[f"{O_PROJ}.weight"][:, :64].contiguous()),
     rf"tensor '{O_PROJ}.weight' is \[128, 64\]; the model's {O_PROJ} is \[128, 128\]"),
    (lambda t, c: t.pop("model.language_model.norm.weight"), "no tensor 'model.language_model.norm.weight'"),
    (lambda t, c: t.__setitem__("model.extra.weight", torch.zeros(2)), "tensor 'model.extra.weight' names nothing"),
    (lambda t, c: c["quantization_config"]["config_groups"]["group_0"]["input_activations"].__setitem__("dynamic",
                                                                                                        False),
     r"config_groups.group_0.input_activations.strategy is 'token'; expected 'tensor'"),  # static: per tensor
    (lambda t, c: c["quantization_config"].__setitem__("format", "pack-quantized"),
     "quantization_config.format 'pack-quantized'; expected 'int-quantized'"),
])
def test_a_malformed_export_is_refused_naming_the_tensor(exported, tmp_path, edit, match):
    with pytest.raises(ValueError, match=match):
        export.load(_damaged(exported[4], tmp_path, edit), backend="cpu")


def test_the_sidecar_naming_a_missing_linear_is_refused(exported, tmp_path):
    bad = _damaged(exported[4], tmp_path, lambda t, c: None)
    (bad / export.SIDECAR).write_text(json.dumps({"quantised_from_float": ["model.nothing"]}))
    with pytest.raises(ValueError, match="names 'model.nothing' as a linear quantised from its float table; the model "
                                         "has no such linear"):
        export.load(bad, backend="cpu")


def test_save_refuses_what_it_cannot_write(tmp_path, exported):
    model = models.load(None, "float32")[0]
    with pytest.raises(ValueError, match="not patched with quant='w8a8'"):
        export.save(model, tmp_path / "a")
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        export.save(exported[0], exported[4])


def test_cli_export(tmp_path, capsys):
    assert cli_main(["export", str(tmp_path / "cli")]) == 0
    assert "compressed-tensors checkpoint written to" in capsys.readouterr().out
    assert (tmp_path / "cli" / "model.safetensors").is_file()
    assert cli_main(["export", "--calibration", str(tmp_path / "none.safetensors"), str(tmp_path / "x")]) == 2
    assert "--calibration: no file at" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_cli_export_of_a_calibrated_model(tmp_path, capsys):
    calib = tmp_path / "s.safetensors"
    assert cli_main(["calibrate", "--max-new-tokens", "1", "--prompt", "Read the text.", "--out", str(calib)]) == 0
    assert cli_main(["export", "--format", "msmodelslim", "--calibration", str(calib), str(tmp_path / "ms")]) == 0
    said = capsys.readouterr().out.split("msmodelslim checkpoint written to")[1]
    assert "50 int8 linears" in said and "smoothing folded into the weights" in said
    assert "lm_head float (in the ignore list: what vLLM and vllm-ascend load)" in said
    assert json.loads((tmp_path / "ms" / "config.json").read_text())["tie_word_embeddings"] is True


@pytest.fixture(scope="module")
def smoothed(tmp_path_factory):
    """The embedded Qwen2.5-VL in fp32, calibrated (alpha 0.5) and W8A8 with every linear int8, its logits, and
    its compressed-tensors export (smoothing folded)."""
    from pypto_gym.quant import calibration

    model, processor, family = models.load(None, "float32")
    with calibration.Calibrator(model) as cal:
        _logits(model, _inputs(processor, family))
    tmp = tmp_path_factory.mktemp("smooth")
    calibration.save(tmp / "s.safetensors", calibration.smooth_scales(model, cal.absmax, 0.5), 0.5,
                     model.config.model_type, ["one input"])
    float_state = {k: v.clone() for k, v in model.state_dict().items()}
    patch_model(model, backend="cpu", quant="w8a8", calibration=tmp / "s.safetensors")
    wrote = export.save(model, tmp / "out", processor)
    return model, processor, family, _logits(model, _inputs(processor, family)), tmp / "out", wrote, float_state


def test_a_smoothed_export_folds_every_smooth_scale_into_what_writes_its_rows(smoothed):
    """Each 1/s lands where llm-compressor puts it: a norm's weight, up_proj's rows (an int8 one: its weight_scale),
    v_proj's rows for o_proj (one scale per kv head's channel), qkv's v third for the vision attn.proj, ln_q's
    weight for the merger's mlp.0; the int8 codes are the ones the model runs."""
    model, _, _, _, out, wrote, float_state = smoothed
    t = load_file(str(out / "model.safetensors"))
    plan = model.__dict__[_STATE_ATTR].quant
    layer = "model.language_model.layers.1"
    norm = plan.norms[f"{layer}.input_layernorm"]
    assert torch.equal(t[f"{layer}.input_layernorm.weight"], float_state[f"{layer}.input_layernorm.weight"] *
                       norm.inv_smooth)
    up = quant_linear_of(model.get_submodule(f"{layer}.mlp.up_proj"))
    assert torch.equal(t[f"{layer}.mlp.up_proj.weight"], up.w_q)  # the codes: unchanged
    assert torch.equal(t[f"{layer}.mlp.up_proj.weight_scale"].flatten(), up.w_scale * plan.mlps[f"{layer}.mlp"].inv_smooth)
    o = quant_linear_of(model.get_submodule(f"{layer}.self_attn.o_proj"))
    v = quant_linear_of(model.get_submodule(f"{layer}.self_attn.v_proj"))
    d, groups = model.get_submodule(f"{layer}.self_attn").head_dim, 2  # tiny: 4 query heads, 2 kv heads
    inv = o.inv_smooth.reshape(-1, groups, d)  # [kv head, its query heads, channel]
    assert torch.equal(inv[:, 0], inv[:, 1])  # one scale per kv head's channel: it folds
    assert torch.equal(t[f"{layer}.self_attn.v_proj.weight_scale"].flatten(), v.w_scale * inv[:, 0].flatten())
    assert torch.equal(t[f"{layer}.self_attn.v_proj.bias"], float_state[f"{layer}.self_attn.v_proj.bias"] *
                       inv[:, 0].flatten())
    proj = quant_linear_of(model.get_submodule("model.visual.blocks.0.attn.proj"))
    qkv = quant_linear_of(model.get_submodule("model.visual.blocks.0.attn.qkv"))
    n = proj.module.in_features
    want = torch.cat([torch.ones(2 * n), proj.inv_smooth])
    assert torch.equal(t["model.visual.blocks.0.attn.qkv.weight_scale"].flatten(), qkv.w_scale * want)
    mlp0 = quant_linear_of(model.get_submodule("model.visual.merger.mlp.0"))
    D = float_state["model.visual.merger.ln_q.weight"].shape[0]
    assert torch.equal(t["model.visual.merger.ln_q.weight"], float_state["model.visual.merger.ln_q.weight"] *
                       mlp0.inv_smooth[:D])
    assert quant_linear_of(model.get_submodule("model.visual.merger.mlp.2")).inv_smooth is None  # after GELU
    # the final norm hands nothing over (it is not smoothed): the tied lm_head stays the embedding's float table
    final = "model.language_model.norm.weight"
    assert torch.equal(t[final], float_state[final]) and "lm_head.weight" not in t
    assert wrote["lm_head"] == "float" and "lm_head" in wrote["ignore"]
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True


def test_a_smoothed_export_runs_the_smoothed_model(smoothed):
    """Folding is exact in real arithmetic: pypto-gym's loader and transformers' from_pretrained both compute the
    calibrated model's logits within rounding (the int8 codes of a row can move by one where a folded weight
    rounds differently)."""
    from transformers import AutoModelForImageTextToText

    model, processor, family, ours, out, wrote, _ = smoothed
    loaded, loaded_processor, _, report = export.load(out, backend="cpu")
    batch = _inputs(loaded_processor, family)
    back = _logits(loaded, batch)
    assert report.to_json()["w8a8"]["summary"]["int8"] == 50 and report.to_json()["w8a8"]["summary"]["loaded_int8"] == 50
    hf = _logits(AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32), batch)
    live = ours.abs().amax(-1) > 0
    for got, bound in ((back, 0.9999), (hf, 0.9995)):  # W8A8 itself is 0.9997 from the float model
        cos = torch.nn.functional.cosine_similarity(got[live], ours[live], dim=-1)
        assert float(cos.min()) > bound, float(cos.min())


def test_a_smoothed_msmodelslim_export_holds_the_same_folded_model(smoothed, tmp_path):
    model, processor, family, _, out, _, _ = smoothed
    export.save(model, tmp_path / "ms", processor, "msmodelslim")
    desc = json.loads((tmp_path / "ms" / "quant_model_description.json").read_text())
    assert "lm_head.weight" not in desc and desc["model.language_model.embed_tokens.weight"] == "FLOAT"  # tied, float
    assert json.loads((tmp_path / "ms" / "config.json").read_text())["tie_word_embeddings"] is True
    ms, ms_processor, _, _ = export.load(tmp_path / "ms", backend="cpu")
    ct, ct_processor, _, _ = export.load(out, backend="cpu")
    assert torch.equal(_logits(ms, _inputs(ms_processor, family)), _logits(ct, _inputs(ct_processor, family)))


def test_a_scale_that_cannot_fold_is_refused_before_anything_is_written(tmp_path):
    """A calibration file whose o_proj scale differs between two query heads of one kv head (not what calibrate
    writes) runs in memory, but there is no single v_proj row to fold it into: export says so."""
    from pypto_gym.quant import calibration

    model, processor, family = models.load(None, "float32")
    with calibration.Calibrator(model) as cal:
        _logits(model, _inputs(processor, family))
    scales = calibration.smooth_scales(model, cal.absmax, 0.5)
    o_proj = "model.language_model.layers.0.self_attn.o_proj"
    scales[o_proj] = scales[o_proj].clone()
    scales[o_proj][0] *= 2  # query head 0's channel 0 only; query head 1 shares its kv head
    calibration.save(tmp_path / "s.safetensors", scales, 0.5, model.config.model_type, ["one input"])
    patch_model(model, backend="cpu", quant="w8a8", calibration=tmp_path / "s.safetensors")
    with pytest.raises(ValueError, match=f"export: {o_proj}'s smooth scale differs across the input channels that "
                                         f"channel 0 of model.language_model.layers.0.self_attn.v_proj feeds"):
        export.save(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_each_fold_source_writes_the_channels_the_table_says(tiny_fp32):
    """The family tables' claim, checked on the running model: scaling the source's output channel c by f_c
    scales the linear's input channel j by f[index[j]] (attention mixes positions, not channels; the merger
    regroups ln_q's rows), for o_proj under GQA, the vision attn.proj and the merger's mlp.0."""
    from pypto_gym.quant.fold import folds

    model, processor, family = tiny_fp32
    batch = _inputs(processor, family)
    found = folds(model)
    assert sum(p.endswith("self_attn.o_proj") for p in found) == 4 and sum(p.endswith("attn.proj") for p in found) == 4
    assert "model.visual.merger.mlp.0" in found and "model.visual.merger.mlp.2" not in found  # after GELU: none
    for path in ("model.language_model.layers.0.self_attn.o_proj", "model.visual.blocks.0.attn.proj",
                 "model.visual.merger.mlp.0"):
        assert_fold_scales_the_input(model, batch, found[path])


@pytest.fixture(scope="module")
def tiny_fp32():
    return models.load(None, "float32")


LLMC = Path(__file__).parent / "fixtures" / "llmcompressor_w8a8"


def test_a_checkpoint_written_by_llm_compressor_runs_on_the_fused_kernels():
    """scripts/make_llmcompressor_fixture.py: llm-compressor 0.14's SmoothQuant + W8A8 (int8 dynamic-token) recipe
    on the embedded checkpoint, the decoder int8, lm_head and the vision tower float. pypto-gym runs its int8
    linears on the stored weights (its smoothing is folded into them and the norms), within the format's
    precision of compressed-tensors' own forward of the same directory."""
    from transformers import AutoModelForImageTextToText

    model, processor, family, report = export.load(LLMC, backend="cpu")
    q = report.to_json()["w8a8"]
    assert q["summary"]["int8"] == 28 and q["summary"]["fallbacks"] == 0  # 4 layers x q/k/v/o/gate/up/down
    assert all(quant_linear_of(model.get_submodule(r["path"])).stored for r in q["linears"] if r["became"] == "w8a8")
    batch = _inputs(processor, family)
    ours = _logits(model, batch)
    theirs = _logits(AutoModelForImageTextToText.from_pretrained(LLMC, dtype=torch.float32), batch)
    live = theirs.abs().amax(-1) > 0
    cos = torch.nn.functional.cosine_similarity(ours[live], theirs[live], dim=-1)
    assert float(cos.min()) > 0.999, float(cos.min())
    rows = {r["path"]: r for r in report.to_json()["w8a8"]["linears"]}
    assert rows["model.language_model.layers.0.mlp.down_proj"]["handed_over"] >= 1  # fed by the fused MLP


# ---- msModelSlim W8A8_DYNAMIC (vllm-ascend --quantization ascend) -----------------------------------------
@pytest.fixture(scope="module")
def msmodelslim(tmp_path_factory):
    model, processor, family = models.load(None, "bfloat16")
    patch_model(model, backend="cpu", quant="w8a8")
    out = tmp_path_factory.mktemp("ms") / "tiny_w8a8"
    export.save(model, out, processor, "msmodelslim")
    return model, processor, family, _logits(model, _inputs(processor, family)), out


def test_the_msmodelslim_export_has_the_layout_vllm_ascend_reads(msmodelslim):
    """msModelSlim's save/ascendv1.py layout: quant_model_weights.safetensors + quant_model_description.json naming
    every tensor's type; per W8A8_DYNAMIC linear weight int8, weight_scale and weight_offset fp32 [out, 1] (offset
    zero: symmetric), its bias fp32 FLOAT; the JSON's global keys; config.json without quantization_config;
    tensor names as transformers names Qwen2.5-VL's modules."""
    model, _, _, _, out = msmodelslim
    tensors = load_file(str(out / "quant_model_weights.safetensors"))
    desc = json.loads((out / "quant_model_description.json").read_text())
    assert {k: desc[k] for k in ("version", "model_quant_type", "metadata", "group_size")} == \
        {"version": "1.0.0", "model_quant_type": "W8A8_DYNAMIC", "metadata": {}, "group_size": 0}
    named = {k: v for k, v in desc.items() if k not in ("version", "model_quant_type", "metadata", "group_size")}
    assert set(named) == set(tensors)
    q_proj = "model.language_model.layers.0.self_attn.q_proj"
    assert named[f"{q_proj}.weight"] == named[f"{q_proj}.weight_scale"] == named[f"{q_proj}.weight_offset"] \
        == "W8A8_DYNAMIC" and named[f"{q_proj}.bias"] == "FLOAT"
    assert tensors[f"{q_proj}.weight"].dtype == torch.int8 and tensors[f"{q_proj}.bias"].dtype == torch.float32
    for scale in ("weight_scale", "weight_offset"):
        assert tensors[f"{q_proj}.{scale}"].dtype == torch.float32 and tensors[f"{q_proj}.{scale}"].shape == (128, 1)
    assert not tensors[f"{q_proj}.weight_offset"].any()
    assert named["model.language_model.embed_tokens.weight"] == "FLOAT"
    assert sum(v == "W8A8_DYNAMIC" for v in named.values()) == 3 * 50
    assert set(tensors) - {k for k in tensors if k.endswith(("weight_scale", "weight_offset"))} <= \
        set(model.state_dict())  # transformers' own names
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def test_the_msmodelslim_export_loads_back_with_equal_logits(msmodelslim):
    model, processor, family, ours, out = msmodelslim
    loaded, loaded_processor, _, report = export.load(out, backend="cpu")
    assert torch.equal(_logits(loaded, _inputs(loaded_processor, family)), ours)
    assert report.to_json()["w8a8"]["summary"]["int8"] == 50


@pytest.mark.parametrize("edit,match", [
    (lambda t, d: d.__setitem__("model.ghost.weight", "FLOAT"),
     "quant_model_description.json names tensor 'model.ghost.weight', which the weights do not hold"),
    (lambda t, d: d.pop(f"{O_PROJ}.weight_scale"), f"tensor '{O_PROJ}.weight_scale' is not named"),
    (lambda t, d: t[f"{O_PROJ}.weight_offset"].add_(1), f"tensor '{O_PROJ}.weight_offset' is not zero"),
    (lambda t, d: d.__setitem__(f"{O_PROJ}.weight", "FLOAT"), f"tensor '{O_PROJ}.weight' is int8 but"),
    (lambda t, d: d.__setitem__("model_quant_type", "W8A16"),
     "model_quant_type 'W8A16'; expected 'W8A8_DYNAMIC' or 'W8A8'"),
    (lambda t, d: d.__setitem__("model_quant_type", "W8A8"),  # the static scheme's name on a dynamic checkpoint
     "gives '.*' type 'W8A8_DYNAMIC'; expected 'W8A8' or 'FLOAT'"),
    (lambda t, d: (t.pop(f"{O_PROJ}.weight_scale"), d.pop(f"{O_PROJ}.weight_scale")),
     f"tensor '{O_PROJ}.weight' is int8 but has no '{O_PROJ}.weight_scale'"),
])
def test_a_malformed_msmodelslim_export_is_refused_naming_the_tensor(msmodelslim, tmp_path, edit, match):
    with pytest.raises(ValueError, match=match):
        export.load(_damaged(msmodelslim[4], tmp_path, edit, "quant_model_weights.safetensors",
                             "quant_model_description.json"), backend="cpu")


def test_infer_runs_an_export_and_other_commands_refuse_one(tmp_path, capsys):
    out = tmp_path / "ms"
    assert cli_main(["export", str(out), "--format", "msmodelslim"]) == 0
    assert cli_main(["infer", "--model", str(out), "--use_pto", "--quant", "w8a8", "--max-new-tokens", "2"]) == 0
    printed = capsys.readouterr().out
    assert "W8A8: 50/51 linears int8" in printed and "loaded from an int8 checkpoint as stored" in printed
    assert "fallbacks=0" in printed
    for argv, message in [(["infer", "--model", str(out)], "is a msmodelslim W8A8 checkpoint (int8 weights, no float "
                                                            "ones); run it with --use_pto --quant w8a8"),
                          (["calibrate", "--model", str(out), "--out", str(tmp_path / "c.safetensors")],
                           "is an int8 checkpoint; only `infer --use_pto --quant w8a8` runs one")]:
        assert cli_main(argv) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if "Loading weights" not in line]
        assert len(err) == 1 and message in err[0], err


def test_a_loaded_model_switched_off_says_its_float_weights_were_never_loaded(exported):
    import pypto_gym

    loaded, processor, family, _ = export.load(exported[4], backend="cpu")
    pypto_gym.set_enabled(False)
    try:
        with pytest.raises(RuntimeError, match="float weight was never loaded \\(an int8 checkpoint\\)"):
            _logits(loaded, _inputs(processor, family))
    finally:
        pypto_gym.set_enabled(True)


# ---- damaged checkpoints: one line naming the file and the problem, exit 2 (issue 27, defect 7) -----------------
@pytest.fixture(scope="module")
def qwen3_exports(tmp_path_factory):
    """The tiny Qwen3's W8A8 export in both formats (default options)."""
    root = tmp_path_factory.mktemp("q3")
    for fmt in export.FORMATS:
        assert cli_main(["export", "--model", str(models.FAMILIES["qwen3"].tiny_dir), "--format", fmt,
                         str(root / fmt)]) == 0
    return root


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _scale_of(weights, name, value):
    t = load_file(str(weights))
    t[name] = torch.full_like(t[name], value)
    save_file(t, str(weights), metadata={"format": "pt"})


Q3_O = "model.layers.0.self_attn.o_proj"
DAMAGES = {  # name -> (format, edit(dir), words of the one-line refusal)
    "truncated weights": ("compressed-tensors", lambda d: (d / "model.safetensors").write_bytes(
        (d / "model.safetensors").read_bytes()[:5000]), "model.safetensors is not a readable safetensors file"),
    "garbage weights": ("compressed-tensors", lambda d: (d / "model.safetensors").write_bytes(b"\x00garbage" * 99),
                        "model.safetensors is not a readable safetensors file"),
    "config a list": ("compressed-tensors", lambda d: (d / "config.json").write_text("[1, 2]"),
                      "config.json holds a JSON list; expected an object"),
    "config a string": ("compressed-tensors", lambda d: (d / "config.json").write_text('"x"'),
                        "config.json holds a JSON str; expected an object"),
    "config not JSON": ("compressed-tensors", lambda d: (d / "config.json").write_text("{"),
                        "config.json is not valid JSON"),
    "description a list": ("msmodelslim", lambda d: (d / export.MSMODELSLIM_JSON).write_text("[]"),
                           "quant_model_description.json holds a JSON list"),
    "dtype bogus": ("compressed-tensors", lambda d: (d / "config.json").write_text(  # whatever dtype it was written in
        re.sub(r'"dtype": "[a-z0-9]+"', '"dtype": "bogus"', (d / "config.json").read_text())),
        "config.json dtype 'bogus'; expected"),
    "absurd scale": ("compressed-tensors", lambda d: _scale_of(d / "model.safetensors", f"{Q3_O}.weight_scale", 3e38),
                     f"tensor '{Q3_O}.weight_scale': a dequantised weight of up to"),
    "subnormal scale": ("compressed-tensors", lambda d: _scale_of(d / "model.safetensors", f"{Q3_O}.weight_scale",
                                                                 1e-40), "has subnormal values"),
    "group size": ("compressed-tensors", lambda d: _edit_group(d, "weights", "group_size", 128),
                   "config_groups.group_0.weights.group_size is 128; expected None"),
    "static per-token activations": ("compressed-tensors",
                                     lambda d: _edit_group(d, "input_activations", "dynamic", False),
                                     "input_activations.strategy is 'token'; expected 'tensor'"),
    "unknown field": ("compressed-tensors", lambda d: _edit_group(d, "weights", "zero_point_shift", 1),
                      "weights.zero_point_shift is a field the loader does not know"),
    "targets": ("compressed-tensors", lambda d: _edit_group(d, None, "targets", ["Embedding"]),
                "targets is ['Embedding']; expected ['Linear']"),
    "ignore contradicts": ("compressed-tensors", lambda d: _edit_qc(d, "ignore", ["lm_head", Q3_O]),
                           f"ignore keeps {Q3_O} float, but its weight is int8"),
    "ignore missing": ("compressed-tensors", lambda d: _edit_qc(d, "ignore", []),
                       "lm_head is not in quantization_config.ignore"),
}


def _edit_qc(d, key, value):
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"][key] = value
    (d / "config.json").write_text(json.dumps(config))


def _edit_group(d, part, key, value):
    config = json.loads((d / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    (group if part is None else group[part])[key] = value
    (d / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_int8_checkpoint_is_refused_in_one_line(qwen3_exports, tmp_path, capsys, damage):
    fmt, edit, words = DAMAGES[damage]
    bad = _copy(qwen3_exports / fmt, tmp_path / "bad")
    edit(bad)
    assert cli_main(["infer", "--model", str(bad), "--use_pto", "--quant", "w8a8", "--max-new-tokens", "1"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and words in err[0] and "Traceback" not in err[0], err


def test_an_all_zero_int8_linear_loads_and_is_said(qwen3_exports, tmp_path):
    bad = _copy(qwen3_exports / "compressed-tensors", tmp_path / "zero")
    _scale_of(bad / "model.safetensors", f"{Q3_O}.weight_scale", 0.0)
    with pytest.warns(RuntimeWarning, match=f"int8 linear {Q3_O} is all zeros"):
        export.load(bad, backend="cpu")


def test_a_fifo_named_like_the_weights_is_not_opened(qwen3_exports, tmp_path):
    """A FIFO named model.safetensors hung the loader (open() waits for a writer): only regular files are read."""
    import os

    bad = _copy(qwen3_exports / "compressed-tensors", tmp_path / "fifo")
    (bad / "model.safetensors").unlink()
    os.mkfifo(bad / "model.safetensors")
    proc = subprocess.run([sys.executable, "-m", "pypto_gym.cli", "infer", "--model", str(bad), "--use_pto", "--quant",
                           "w8a8"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "model.safetensors is not a regular file" in proc.stderr, proc.stderr


def test_two_greedy_runs_are_compared_by_vllms_rule():
    """compare.agreement: tokens equal up to a divergence; a divergence both top-k lists explain (a near-tie) is
    close, one they do not is not; logprob differences and top-k boundary gaps in bf16 ulps (ulp 2^-5 at -6)."""
    from pypto_gym.vllm import compare

    def run(tokens, steps):
        return {"outputs": [{"token_ids": tokens, "logprobs": steps}]}

    a = run([1, 2, 9], [{"1": -6.0, "5": -6.03125}, {"2": -6.0, "3": -6.0625}, {"9": -1.0}])
    near_tie = run([1, 3, 4], [{"1": -6.0, "5": -6.0625}, {"3": -6.03125, "2": -6.03125}, {"4": -1.0}])
    got = compare.agreement(a, near_tie)
    assert not got["tokens_equal"] and got["close"] and got["diverged_at"] == [1]
    assert got["max_logprob_diff"] == 0.03125 and got["max_logprob_diff_ulps"] == 1.0
    far = run([1, 7, 4], [{"1": -6.0, "6": -6.0}, {"7": -1.0, "8": -2.0}, {"4": -1.0}])
    got = compare.agreement(a, far)
    assert not got["close"]
    assert got["max_topk_gap_ulps"] == (-1.0 - -6.0625) / 2 ** -5  # token 7 sits 162 ulps above a's 2nd best
    assert compare.agreement(a, a) == {**compare.agreement(a, a), "tokens_equal": True, "close": True,
                                       "max_logprob_diff": 0.0}
