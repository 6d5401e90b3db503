"""Qwen3-VL, patched: a tiny random Qwen3-VL (LayerNorms with a bias and a GELU MLP in the vision tower, full
attention per image, DeepStack features added into the first decoder layers, interleaved MRoPE, Qwen3's q/k norms)
runs every site kind it has on the fused ops, strict, with greedy tokens and logits as unpatched; and the family
(models/qwen3_vl.py): its tiny checkpoint through the main job, W8A8 and both export formats."""
import re

import pytest
import torch

import pypto_gym
from pypto_gym import ops
from pypto_gym.precision import compare_outputs

from models import qwen3_vl_inputs, tiny_qwen3_vl

pytest.importorskip("transformers.models.qwen3_vl")

KINDS = {"rms_norm", "swiglu", "rope", "qk_norm_rope", "varlen_attention", "decoder_attention", "patch_embed",
         "layer_norm", "linear"}  # add_layer_norm runs in layer_norm's sites (their rows' op)


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3_vl()


def _run(model, inputs):
    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=6, do_sample=False), model(**inputs).logits


def _margins(model, inputs) -> list:
    """The unpatched greedy run's top-1 minus top-2 logit at each step (a random bf16 model has near-ties)."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    return [float((lambda t: t[0] - t[1])(s[0].float().topk(2).values)) for s in out.scores]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("grids", [((1, 4, 6),), ((1, 4, 6), (1, 6, 4), (1, 2, 2))], ids=["one image", "three"])
def test_patched_qwen3_vl_generates_as_unpatched(model, backend, grids):
    inputs = qwen3_vl_inputs(model, grids)
    want_tokens, want_logits = _run(model, inputs)
    margins = _margins(model, inputs)
    report = pypto_gym.patch_model(model, backend=backend, strict=True)
    try:
        tokens, logits = _run(model, inputs)
        rows = report.to_json()["sites"]
        ran = {r["op"] for r in rows if r["calls"]}
        assert ran == KINDS and all(r["status"] == "patched" for r in rows if r["op"] in KINDS)
        # the blocks' MLPs (HF's gelu_pytorch_tanh) and the patch mergers' (their norm first, nn.GELU(): erf), each
        # named by its probe
        mlps = {r["path"].split("visual.")[1]: r for r in rows if r["kind"] == "vision.gelu_mlp"}
        depth, taps = model.config.vision_config.depth, len(model.config.vision_config.deepstack_visual_indexes)
        assert {p: (r["activation"], r["norm_first"]) for p, r in mlps.items()} == {
            **{f"blocks.{i}.mlp": ("gelu_tanh", False) for i in range(depth)}, "merger": ("gelu", True),
            **{f"deepstack_merger_list.{i}": ("gelu", True) for i in range(taps)}}
        assert all(r["calls"] for r in mlps.values())
        assert all(set(r["ran_on"]) <= {backend} for r in rows) and not report.to_json()["summary"]["fallbacks"]
        kinds = {r["kind"] for r in rows if r["op"] == "layer_norm"}
        assert kinds == {"vision.norm1", "vision.norm2", "vision.merger.norm", "vision.deepstack_merger.norm"}
        # every decoder layer and every vision block: its residual add fused into norm2 (add_layer_norm)
        assert report.to_json()["summary"]["fused_layers"] == \
            model.config.text_config.num_hidden_layers + model.config.vision_config.depth
        norm2 = [r for r in rows if r["kind"] == "vision.norm2"]
        assert norm2 and all(r["fused_residual"] and r["calls"] for r in norm2)
        if backend == "torch":  # the goldens are HF's own functions: bit for bit, DeepStack adds included
            assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)
        else:  # the same tokens, or apart first where the unpatched run had a near-tie (the cpu kernels round within
            # an ulp of the goldens, in another order on every CPU: an AVX2 one emulates bf16)
            new, ref = tokens[0, -6:].tolist(), want_tokens[0, -6:].tolist()
            first = next((i for i, (a, b) in enumerate(zip(new, ref)) if a != b), None)
            assert first is None or margins[first] < 0.05, (new, ref, margins)
            cos = torch.nn.functional.cosine_similarity(logits.float().flatten(1), want_logits.float().flatten(1))
            assert float(cos.min()) > 0.999
    finally:
        pypto_gym.unpatch_model(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert torch.equal(_run(model, inputs)[1], want_logits)


def test_a_fused_add_norm_does_not_swallow_the_deepstack_add():
    """DeepStack adds visual features to the hidden states of the first decoder layers at the image positions, between
    one layer's output and the next layer's input norm; fused layers (residual + h into post_attention_layernorm)
    must leave it where it is. The features matter to this model's logits (zeroing the DeepStack mergers changes
    them), and the patched model with fused layers gives the unpatched logits bit for bit on torch, with the
    features and without them."""
    model = tiny_qwen3_vl()
    inputs = qwen3_vl_inputs(model)
    with_features = _run(model, inputs)[1]
    for zeroed in (False, True):
        if zeroed:
            with torch.no_grad():
                for merger in model.model.visual.deepstack_merger_list:
                    merger.linear_fc2.weight.zero_()
                    merger.linear_fc2.bias.zero_()
        _, want = _run(model, inputs)
        assert torch.equal(want, with_features) is not zeroed  # the features change this model's logits
        report = pypto_gym.patch_model(model, backend="torch", strict=True)
        try:
            # every decoder layer and every vision block: its residual add fused into norm2 (add_layer_norm)
            assert report.to_json()["summary"]["fused_layers"] == \
                model.config.text_config.num_hidden_layers + model.config.vision_config.depth
            assert torch.equal(_run(model, inputs)[1], want)
        finally:
            pypto_gym.unpatch_model(model)


# ---- the family: its tiny checkpoint, the main job, W8A8 and both export formats -------------------------------------
def _logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits.float()


def test_the_tiny_checkpoint_runs_the_main_job_with_every_site_kind_patched(capsys):
    """`pypto-gym infer --model modeling/tiny_qwen3_vl --use_pto` runs as command 1 does on Qwen2.5-VL: the family is
    found from config.json, the sample image goes through the vision tower, every site patched, nothing fell back."""
    from pypto_gym.cli import main
    from pypto_gym.models import qwen3_vl

    assert main(["infer", "--model", str(qwen3_vl.TINY_DIR), "--use_pto", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    report = out[out.index("pypto-gym patch report:"):].splitlines()[0]
    for label in ("norm", "mlp", "rope", "qk-norm+rope", "vision attention", "text attention", "patch embedding",
                  "layer norm", "GELU MLP"):
        counts = re.search(rf"(\d+)/(\d+) {re.escape(label)} sites patched", report)
        assert counts and int(counts[1]) == int(counts[2]) > 0, (label, report)
    assert "fallbacks=0" in report


@pytest.fixture(scope="module")
def quantised():
    """The tiny Qwen3-VL checkpoint in fp32 with dynamic W8A8, an image batch, its float and W8A8 logits."""
    from pypto_gym import models
    from pypto_gym.inference import open_image
    from pypto_gym.quant import W8A8, quantize

    family = models.FAMILIES["qwen3_vl"]
    model, processor = family.load(family.tiny_dir, "float32")
    batch = processor([family.calibration_prompts[0]], [open_image(family.images[0])], model)
    want = _logits(model, batch)
    report = quantize(model, W8A8())
    return family, model, processor, batch, want, _logits(model, batch), report.to_json()["w8a8"]


def _linear_count(model) -> tuple[int, int]:
    """(decoder linears, vision linears) of a Qwen3-VL: 7 per layer; qkv, proj, fc1, fc2 per block and two per merger
    (the main one and one per DeepStack tap)."""
    vc = model.config.vision_config
    return 7 * model.config.text_config.num_hidden_layers, 4 * vc.depth + 2 * (1 + len(vc.deepstack_visual_indexes))


def test_w8a8_runs_every_linear_but_lm_head_int8(quantised):
    """Dynamic W8A8 of the tiny Qwen3-VL: every decoder linear int8, its norms and MLPs handing over int8 rows (the
    DeepStack adds between the first layers included); every vision linear int8 too: each linear_fc2 reading the int8
    rows its GELU MLP site's gelu_dynamic_quant hands over (blocks and mergers, every call), the others quantising
    their own input (the LayerNorms hand over none); lm_head float; logits close to the float model's."""
    family, model, _, _, want, got, q = quantised
    text_count, vision_count = _linear_count(model)
    text = [r for r in q["linears"] if ".language_model." in r["path"]]
    vision = [r for r in q["linears"] if ".visual." in r["path"]]
    assert len(text) == text_count and len(vision) == vision_count
    assert q["summary"]["int8"] == text_count + vision_count and q["summary"]["fallbacks"] == 0
    assert [r["path"] for r in q["linears"] if r["became"] != "w8a8"] == ["lm_head"]
    for r in text + vision:
        fed = r["input"].startswith("int8 rows from")
        assert fed == (r in text and not r["path"].endswith("o_proj") or r["path"].endswith("linear_fc2")), r
        assert r["calls"] >= 1 and (r["handed_over"] if fed else r["quantized_here"]) == r["calls"], r
    sites = pypto_gym.patch_report(model).to_json()["sites"]
    blocks = [r for r in sites if r["kind"] == "vision.gelu_mlp" and r["status"] == "patched"]  # and the mergers'
    vc = model.config.vision_config
    assert len(blocks) == vc.depth + 1 + len(vc.deepstack_visual_indexes)
    assert all(r["quant"]["int8_to"] == [f"{r['path']}.linear_fc2"] and not r["quant"]["bypassed"]
               and not r["fusion_bypassed"] and r["calls"] == r["ran_on"]["cpu"] >= 1 for r in blocks), blocks
    cos = torch.nn.functional.cosine_similarity(got.flatten(1), want.flatten(1))
    assert float(cos.min()) > 0.99, float(cos.min())


def test_each_gelu_mlp_quantises_its_own_gelu_form_for_fc2(quantised, monkeypatch):
    """The W8A8 GELU MLP sites call gelu_dynamic_quant in the form their module computes (the blocks' act_fn is HF's
    gelu_pytorch_tanh, the mergers' nn.GELU() erf) on fc1's output, and fc2 reads exactly those codes (a hook on fc2
    sees the float rows they stand for)."""
    from pypto_gym.quant import gelu_mlp

    _, model, *_ = quantised
    calls, run = [], ops.gelu_dynamic_quant

    def spy(h, smooth, **kw):
        out = run(h, smooth, **kw)
        calls.append((h, kw["approximate"], out))
        return out

    monkeypatch.setattr(gelu_mlp.ops, "gelu_dynamic_quant", spy, raising=False)
    for path, form in (("model.visual.blocks.0.mlp", "tanh"), ("model.visual.merger", "none"),
                       ("model.visual.deepstack_merger_list.0", "none")):
        mlp = model.get_submodule(path)
        site = mlp.__dict__["_pypto_gym_site"]
        seen = []
        hook = site.fc2.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
        x = torch.randn(8, site.norm_width or site.fc1.in_features, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            mlp(x)
        hook.remove()
        (h, approximate, (q, scale)), = calls
        calls.clear()
        assert approximate == form and torch.equal(seen[0], (q.float() * scale.unsqueeze(-1)).to(h.dtype)), path
        want = ops.dynamic_quant(torch.nn.functional.gelu(h, approximate=form), backend="torch")
        for c in compare_outputs((q, scale), want, ("y", "scale")):  # the cpu kernel's GELU: within an fp32 ulp
            assert c.passed, (path, c.reason)


def test_both_export_formats_load_back_bit_for_bit(quantised, tmp_path):
    """Each export format loads back through export.load (transformers 5.x) with the quantised model's logits bit for
    bit, every linear but lm_head int8 in it, and transformers (through compressed-tensors) loads the
    compressed-tensors export."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("export.load builds the model as transformers 5.x does (tests/test_export.py runs on 5.x only)")
    from transformers import AutoModelForImageTextToText

    from pypto_gym.quant import export

    family, model, processor, batch, _, got, _ = quantised
    for fmt in export.FORMATS:
        wrote = export.save(model, tmp_path / fmt, processor, fmt)
        assert len(wrote["int8"]) == sum(_linear_count(model)) and wrote["ignore"] == ["lm_head"]
        loaded, _, loaded_family, _ = export.load(tmp_path / fmt, backend="cpu", dtype="float32")
        assert loaded_family is family and torch.equal(_logits(loaded, batch), got), fmt
    hf = AutoModelForImageTextToText.from_pretrained(tmp_path / "compressed-tensors", dtype=torch.float32)
    cos = torch.nn.functional.cosine_similarity(_logits(hf, batch).flatten(1), got.flatten(1))
    assert float(cos.min()) > 0.99, float(cos.min())


def test_each_vision_fold_source_writes_the_channels_the_table_says():
    """The family table's folds (models/qwen3_vl.py), checked on the running model: the blocks' qkv and linear_fc1
    read norm1's and norm2's rows as they are, attn.proj qkv's v third, the main merger's linear_fc1 its norm's rows
    regrouped (4 rows of D as one of 4D), a DeepStack merger's linear_fc1 its post-shuffle norm's; no linear_fc2 (after
    GELU) has one."""
    from pypto_gym import models
    from pypto_gym.inference import open_image
    from pypto_gym.quant.fold import folds

    from models import assert_fold_scales_the_input

    family = models.FAMILIES["qwen3_vl"]
    model, processor = family.load(family.tiny_dir, "float32")
    batch = processor([family.calibration_prompts[0]], [open_image(family.images[0])], model)
    found = folds(model)
    assert not [p for p in found if p.endswith("linear_fc2")]
    want = {"model.visual.blocks.1.attn.qkv": "model.visual.blocks.1.norm1",
            "model.visual.blocks.1.mlp.linear_fc1": "model.visual.blocks.1.norm2",
            "model.visual.blocks.1.attn.proj": "model.visual.blocks.1.attn.qkv",
            "model.visual.merger.linear_fc1": "model.visual.merger.norm",
            "model.visual.deepstack_merger_list.1.linear_fc1": "model.visual.deepstack_merger_list.1.norm"}
    for path, source in want.items():
        assert found[path].source_path == source, path
        assert_fold_scales_the_input(model, batch, found[path])


def test_calibrated_static_w8a8_exports_bit_for_bit_with_the_vision_tower_int8(tmp_path):
    """`calibrate` then static W8A8 (msModelSlim's scheme): every vision linear int8 under its static scale (each
    linear_fc2 reading gelu_quant's rows under its own calibrated scale and offset), the smooth scales folded where
    the table says (a LayerNorm's weight and bias: norm1 for qkv); both formats load back
    with the model's logits bit for bit and transformers loads the compressed-tensors export."""
    import transformers
    from safetensors.torch import load_file

    from pypto_gym import models
    from pypto_gym.cli import main
    from pypto_gym.inference import open_image
    from pypto_gym.quant import W8A8, export, quantize
    from pypto_gym.quant.linear import quant_linear_of

    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("export.load builds the model as transformers 5.x does (tests/test_export.py runs on 5.x only)")
    family = models.FAMILIES["qwen3_vl"]
    calibration = tmp_path / "smooth.safetensors"
    assert main(["calibrate", "--model", str(family.tiny_dir), "--dtype", "float32", "--max-new-tokens", "2",
                 "--out", str(calibration)]) == 0
    model, processor = family.load(family.tiny_dir, "float32")
    batch = processor([family.calibration_prompts[0]], [open_image(family.images[0])], model)
    want = _logits(model, batch)
    norm1 = {k: model.get_submodule("model.visual.blocks.0.norm1").get_parameter(k).detach().clone()
             for k in ("weight", "bias")}
    q = quantize(model, W8A8("static", calibration=str(calibration))).to_json()["w8a8"]
    got = _logits(model, batch)
    assert q["summary"]["int8"] == sum(_linear_count(model)) and q["summary"]["fallbacks"] == 0
    assert float(torch.nn.functional.cosine_similarity(got.flatten(1), want.flatten(1)).min()) > 0.99
    qkv = quant_linear_of(model.get_submodule("model.visual.blocks.0.attn.qkv"))
    assert qkv.static is not None and qkv.inv_smooth is not None
    ran = pypto_gym.patch_report(model).to_json()["w8a8"]["linears"]
    fc2 = [r for r in ran if r["path"].startswith("model.visual.") and r["path"].endswith("linear_fc2")]
    assert len(fc2) == 7 and all(r["handed_over"] == r["calls"] >= 1 for r in fc2), fc2  # gelu_quant's rows
    assert all(r["quant"]["static"] for r in pypto_gym.patch_report(model).to_json()["sites"]
               if r["kind"] == "vision.gelu_mlp")
    for fmt in export.FORMATS:
        export.save(model, tmp_path / fmt, processor, fmt)
        (weights,) = (tmp_path / fmt).glob("*.safetensors")  # one file (msModelSlim names it its own way)
        t = load_file(str(weights))
        for k, v in norm1.items():  # 1/s folded into the LayerNorm that writes qkv's input rows, bias included
            assert torch.equal(t[f"model.visual.blocks.0.norm1.{k}"], (v * qkv.inv_smooth).to(v.dtype)), (fmt, k)
        loaded, _, _, _ = export.load(tmp_path / fmt, backend="cpu", dtype="float32")
        assert torch.equal(_logits(loaded, batch), got), fmt
    hf = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "compressed-tensors", dtype=torch.float32)
    assert float(torch.nn.functional.cosine_similarity(_logits(hf, batch).flatten(1), got.flatten(1)).min()) > 0.999


def test_capture_builds_random_weights_at_qwen3_vl_2b_dimensions(tmp_path):
    """`capture --config modeling/qwen3_vl_2b/config.json` (what the qwen3_vl_2b.json recipe runs, with fewer layers):
    the family's random_model at the published dimensions, driven by the embedded tokenizer and Qwen3-VL's patch-16
    image processor."""
    from pypto_gym.capture import load_cases
    from pypto_gym.cli import main
    from pypto_gym.models import qwen3_vl

    out = tmp_path / "cases.json"
    assert main(["capture", "--config", str(qwen3_vl.QWEN3_VL_2B_CONFIG), "--num-layers", "1", "--vision-depth", "1",
                 "--out", str(out)]) == 0
    widths = {}
    for c in load_cases(out):
        widths.setdefault(c["op"], set()).add(c["args"][0].shape[-1])
    assert widths["layer_norm"] == {1024} and widths["varlen_attention"] == {64}  # no DeepStack tap in one block
    assert widths["qk_norm_rope"] == {128} and widths["swiglu"] == {6144}


def test_qwen2_vls_layer_norm_vision_tower_goes_int8_by_the_same_table():
    """Qwen2-VL's vision tower (LayerNorms, QuickGELU fc1/fc2, the merger's ln_q -> mlp.0 -> GELU -> mlp.2) takes the
    same LayerNorm vision table (models/common.py): every linear but lm_head int8 under dynamic W8A8, each vision one
    quantising its own input, logits close to the float model's; its folds write the channels the table says."""
    from pypto_gym.quant import W8A8, quantize
    from pypto_gym.quant.fold import folds

    from models import assert_fold_scales_the_input, tiny_qwen2_vl

    model = tiny_qwen2_vl()
    inputs = qwen3_vl_inputs(model, ((1, 4, 4),))
    inputs["pixel_values"] = inputs["pixel_values"].float()
    found = folds(model)
    for path in ("model.visual.blocks.0.attn.qkv", "model.visual.blocks.0.mlp.fc1", "model.visual.merger.mlp.0"):
        assert_fold_scales_the_input(model, inputs, found[path])
    assert "model.visual.blocks.0.mlp.fc2" not in found and "model.visual.merger.mlp.2" not in found
    want = _logits(model, inputs)
    report = quantize(model, W8A8())
    got = _logits(model, inputs)
    q = report.to_json()["w8a8"]
    vision = [r for r in q["linears"] if ".visual." in r["path"]]
    assert len(vision) == 4 * model.config.vision_config.depth + 2
    assert all(r["became"] == "w8a8" and r["calls"] == r["quantized_here"] >= 1 for r in vision), vision
    assert [r["path"] for r in q["linears"] if r["became"] != "w8a8"] == ["lm_head"]
    assert float(torch.nn.functional.cosine_similarity(got.flatten(1), want.flatten(1)).min()) > 0.99


def test_a_text_only_export_is_qwen3_and_computes_the_decoder_bit_for_bit(tmp_path, capsys):
    """`export --text-only` (static W8A8, calibrated, both formats): Qwen3ForCausalLM's config and the decoder's
    tensors under `model.*`, nothing of the vision tower, the tokenizer without the image processor; pypto-gym loads
    it as a Qwen3 and its logits on a text-only prompt are the Qwen3-VL model's bit for bit. A family without a
    text-only model is refused in one line before anything is loaded."""
    import json

    import transformers
    from safetensors.torch import load_file

    from pypto_gym import models
    from pypto_gym.cli import main
    from pypto_gym.quant import W8A8, export, quantize

    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("export.load builds the model as transformers 5.x does (tests/test_export.py runs on 5.x only)")
    family = models.FAMILIES["qwen3_vl"]
    assert main(["export", "--text-only", str(tmp_path / "refused")]) == 2  # the default model: Qwen2.5-VL
    assert "--text-only: the qwen2_5_vl family has no text-only export (families with one: qwen3_vl)" in \
        capsys.readouterr().err and not (tmp_path / "refused").exists()
    calibration = tmp_path / "smooth.safetensors"
    assert main(["calibrate", "--model", str(family.tiny_dir), "--max-new-tokens", "2", "--out", str(calibration)]) == 0
    model, processor = family.load(family.tiny_dir, "bfloat16")
    quantize(model, W8A8("static", calibration=str(calibration)))
    ids = processor(["Count from one to ten."], None, None)["input_ids"]
    want = _logits(model, {"input_ids": ids})
    for fmt in export.FORMATS:
        out = tmp_path / fmt
        assert main(["export", "--model", str(family.tiny_dir), "--quant", "w8a8_static", "--calibration",
                     str(calibration), "--format", fmt, "--text-only", str(out)]) == 0
        assert f"{fmt} text-only (Qwen3ForCausalLM) checkpoint written" in capsys.readouterr().out
        config = json.loads((out / "config.json").read_text())
        assert (config["model_type"], config["architectures"]) == ("qwen3", ["Qwen3ForCausalLM"])
        assert not (out / "preprocessor_config.json").exists()
        (weights,) = out.glob("*.safetensors")
        names = set(load_file(str(weights)))
        assert not [n for n in names if "visual" in n or "language_model" in n]
        assert "model.layers.0.self_attn.q_proj.weight" in names
        loaded, _, loaded_family, report = export.load(out, backend="cpu")
        assert loaded_family is models.FAMILIES["qwen3"] and report.to_json()["w8a8"]["summary"]["loaded_int8"] == 28
        assert torch.equal(_logits(loaded, {"input_ids": ids}), want), fmt


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_batch_of_two_images_of_different_sizes_generates_as_unpatched(backend):
    """The embedded Qwen3-VL on a batch of two prompts, the text line (224x56) and it resized to 96x128: left-padded
    rows of different lengths, two images of different sizes in one vision call, every site kind patched,
    strict; greedy tokens as unpatched on torch (bit for bit) and on cpu (the same tokens, or apart first where the
    unpatched run had a near-tie)."""
    from pypto_gym import models
    from pypto_gym.inference import open_image

    family = models.FAMILIES["qwen3_vl"]
    model, processor = family.load(family.tiny_dir, "bfloat16")
    line = open_image(family.images[0])
    batch = processor([family.calibration_prompts[0]] * 2, [line, line.resize((96, 128))], model)
    assert batch["attention_mask"].min() == 0 and len({tuple(g.tolist()) for g in batch["image_grid_thw"]}) == 2
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=6, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    want = out.sequences
    margins = [(s.float().topk(2, dim=-1).values.diff(dim=-1).abs().min()) for s in out.scores]
    report = pypto_gym.patch_model(model, backend=backend, strict=True)
    try:
        with torch.no_grad():
            got = model.generate(**batch, max_new_tokens=6, do_sample=False)
        rows = report.to_json()["sites"]
        assert {r["op"] for r in rows if r["calls"]} == KINDS and not report.to_json()["summary"]["fallbacks"]
    finally:
        pypto_gym.unpatch_model(model)
    if backend == "torch":
        assert torch.equal(got, want)
    else:
        for new, ref in zip(got[:, -6:].tolist(), want[:, -6:].tolist()):
            first = next((i for i, (a, b) in enumerate(zip(new, ref)) if a != b), None)
            assert first is None or float(margins[first]) < 0.05, (new, ref)
