"""Patching real transformers models (SPEC 3): discovery, wrappers, fusion, switch, unpatch."""
import copy

import pytest
import torch

import pypto_gym
from pypto_gym.precision import compare

from models import GutenOcr3BVLRMSNorm, OnePlusWeightRMSNorm, logits, tiny_qwen2_vl, tiny_qwen3



def rms_norm_modules(model):
    return {n for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")}


def norm_rows(report):
    return [s for s in report["sites"] if s["op"] == "rms_norm"]


def test_every_qwen2_5_vl_norm_is_found_including_merger_ln_q(model32):
    report = pypto_gym.patch_model(model32, backend="torch").to_json()
    patched = {s["path"] for s in norm_rows(report) if s["status"] == "patched"}
    assert patched == rms_norm_modules(model32)
    assert any(p.endswith("visual.merger.ln_q") for p in patched)
    kinds = {s["kind"] for s in norm_rows(report)}
    assert kinds == {"vision.norm1", "vision.norm2", "vision.merger.ln_q", "text.input_layernorm",
                     "text.post_attention_layernorm", "text.norm"}
    assert report["summary"]["by_op"]["rms_norm"] == {"candidates": 18, "patched": 18}
    for field in ("path", "kind", "status", "reason", "backend", "D", "eps", "dtype", "device", "calls", "fallbacks"):
        assert field in report["sites"][0]
    assert report["summary"]["fused_layers"] == 4 + 4  # 4 decoder layers + 4 vision blocks


@pytest.mark.parametrize("fuse", [True, False])
def test_torch_backend_is_bit_identical_logits_and_tokens(model32, sample_inputs, fuse):
    ref_model = copy.deepcopy(model32)
    expected = logits(ref_model, sample_inputs)
    with torch.no_grad():
        expected_tokens = ref_model.generate(**sample_inputs, max_new_tokens=5, do_sample=False)
    report = pypto_gym.patch_model(model32, backend="torch", fuse_residual=fuse)
    assert torch.equal(logits(model32, sample_inputs), expected)
    with torch.no_grad():
        assert torch.equal(model32.generate(**sample_inputs, max_new_tokens=5, do_sample=False), expected_tokens)
    summary = report.to_json()["summary"]
    assert summary["calls"] > 0 and summary["fallbacks"] == {}
    assert (summary["fused_layers"] > 0) == fuse


def test_cpu_backend_bf16_logits_within_precision(tiny_loaded, sample_inputs):
    model = copy.deepcopy(tiny_loaded[0])
    expected = logits(model, sample_inputs)
    report = pypto_gym.patch_model(model, backend="cpu")
    got = logits(model, sample_inputs)
    c = compare(got, expected, "logits")
    assert c.cosine >= 0.9999, c
    assert c.max_abs <= 0.05 * float(expected.abs().max())
    rows = report.to_json()["sites"]
    assert all(r["backend"] == "cpu" and r["calls"] >= 1 and not r["fallbacks"] for r in rows)


def test_switch_off_is_bit_identical_and_counts_nothing(tiny_loaded, sample_inputs):
    model = copy.deepcopy(tiny_loaded[0])
    expected = logits(model, sample_inputs)
    report = pypto_gym.patch_model(model, backend="cpu")
    pypto_gym.set_enabled(False)
    assert torch.equal(logits(model, sample_inputs), expected)
    assert report.to_json()["summary"]["calls"] == 0
    pypto_gym.set_enabled(True)
    logits(model, sample_inputs)
    assert report.to_json()["summary"]["calls"] > 0


def test_unpatch_restores_types_keys_forwards_and_outputs(model32, sample_inputs):
    expected = logits(model32, sample_inputs)
    types_before = {n: type(m) for n, m in model32.named_modules()}
    keys_before = list(model32.state_dict())
    pypto_gym.patch_model(model32, backend="cpu")
    assert any("forward" in m.__dict__ for m in model32.modules())
    pypto_gym.unpatch_model(model32)
    assert {n: type(m) for n, m in model32.named_modules()} == types_before
    assert list(model32.state_dict()) == keys_before
    assert not any("forward" in m.__dict__ or "_pypto_gym_site" in m.__dict__ for m in model32.modules())
    assert pypto_gym.patch_report(model32) is None
    assert torch.equal(logits(model32, sample_inputs), expected)
    report = pypto_gym.patch_model(model32, backend="torch")  # patching after unpatch works
    assert report.to_json()["summary"]["by_op"]["rms_norm"]["patched"] == len(rms_norm_modules(model32))


def test_patching_twice_with_the_same_options_is_a_no_op(model32):
    first = pypto_gym.patch_model(model32, backend="torch")
    forwards = {n: m.__dict__.get("forward") for n, m in model32.named_modules()}
    second = pypto_gym.patch_model(model32, backend="torch")
    assert {n: m.__dict__.get("forward") for n, m in model32.named_modules()} == forwards
    assert second.to_json() == first.to_json()


def test_patching_again_with_other_options_is_refused_naming_the_existing_patch(model32):
    pypto_gym.patch_model(model32, backend="torch")
    for call in (lambda: pypto_gym.patch_model(model32, backend="cpu"),
                 lambda: pypto_gym.patched(model32, backend="cpu").__enter__()):
        with pytest.raises(pypto_gym.PatchError, match="already patched with backend='torch'.*got backend='cpu'"):
            call()
    assert pypto_gym.patch_report(model32).to_json()["backend"] == "torch"


def test_patch_keeps_parameters_and_save_pretrained_output(model32, tmp_path):
    from safetensors.torch import load_file

    weights = {n: p for n, p in model32.named_parameters()}
    model32.save_pretrained(tmp_path / "plain")
    pypto_gym.patch_model(model32, backend="cpu")
    assert all(p is weights[n] for n, p in model32.named_parameters())
    model32.save_pretrained(tmp_path / "patched")
    a, b = load_file(tmp_path / "plain" / "model.safetensors"), load_file(tmp_path / "patched" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_patched_context_and_forward_hooks(model32, sample_inputs):
    seen = []
    norm = model32.model.language_model.norm if hasattr(model32.model, "language_model") else model32.model.norm
    handle = norm.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    with pypto_gym.patched(model32, backend="cpu") as report:
        logits(model32, sample_inputs)
        assert report.to_json()["summary"]["calls"] > 0
    assert pypto_gym.patch_report(model32) is None
    assert len(seen) == 1  # the user's hook ran on the patched module
    handle.remove()


def test_site_globs_select_by_kind_and_path(model32):
    report = pypto_gym.patch_model(model32, backend="torch", sites="text.*,*.merger.ln_q").to_json()
    status = {s["path"]: (s["kind"], s["status"], s["reason"]) for s in report["sites"]}
    for path, (kind, st, reason) in status.items():
        if kind.startswith("text.") or kind == "vision.merger.ln_q":
            assert st == "patched", path
        else:
            assert st == "skipped" and "not selected by sites=" in reason


def test_qwen2_vl_vision_layernorms_are_layer_norm_sites_and_text_rmsnorms_norm_sites():
    """Qwen2-VL's vision tower normalises with nn.LayerNorm (with a bias): those are layer_norm sites, found by
    structure and an exact probe, not skipped rms_norm candidates; the text RMSNorms are norm sites; a LayerNorm
    outside the vision tower is neither rule's; outputs equal unpatched on torch."""
    model = tiny_qwen2_vl()
    vision_ln = {n for n, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)}
    model.model.language_model.extra_ln = torch.nn.LayerNorm(8)  # not a site: outside the vision tower
    ids = torch.randint(0, 256, (1, 7))
    with torch.no_grad():
        expected = model(ids).logits
    report = pypto_gym.patch_model(model, backend="torch").to_json()
    rows = report["sites"]
    assert {s["path"] for s in norm_rows(report) if s["status"] == "patched"} == rms_norm_modules(model)
    assert not [s for s in norm_rows(report) if s["status"] != "patched"]
    ln = {s["path"]: s for s in rows if s["op"] == "layer_norm"}
    assert set(ln) == vision_ln and len(vision_ln) >= 3 and all(s["status"] == "patched" for s in ln.values())
    assert {s["kind"] for s in ln.values()} == {"vision.norm1", "vision.norm2", "vision.merger.ln_q"}
    assert "layer norm sites patched" in str(pypto_gym.patch_report(model))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)
    pypto_gym.unpatch_model(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_qwen3_q_k_norms_on_4d_inputs_and_identical_generate():
    model = tiny_qwen3()
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        expected = model(ids).logits
        expected_tokens = model.generate(ids, max_new_tokens=4, do_sample=False)
    report = pypto_gym.patch_model(model, backend="torch").to_json()
    kinds = {s["kind"] for s in norm_rows(report) if s["status"] == "patched"}
    assert {"text.q_norm", "text.k_norm", "text.input_layernorm", "text.post_attention_layernorm",
            "text.norm"} == kinds
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), expected_tokens)
    q_norm = next(s for s in report["sites"] if s["kind"] == "text.q_norm")
    assert q_norm["D"] == 32
    assert report["summary"]["fused_layers"] == 2


def test_remote_code_class_is_patched_and_one_plus_weight_is_skipped(model32):
    layers = model32.model.language_model.layers
    for layer in layers:
        old = layer.input_layernorm
        new = GutenOcr3BVLRMSNorm(old.weight.shape[0], old.variance_epsilon)
        new.weight = old.weight
        layer.input_layernorm = new
    gemma = OnePlusWeightRMSNorm(layers[0].post_attention_layernorm.weight.shape[0])
    with torch.no_grad():
        gemma.weight.normal_()
    layers[0].post_attention_layernorm = gemma
    report = pypto_gym.patch_model(model32, backend="torch").to_json()
    rows = {s["path"]: s for s in report["sites"]}
    remote = [r for p, r in rows.items() if p.endswith("input_layernorm")]
    assert len(remote) == 4 and all(r["status"] == "patched" for r in remote)
    skipped = rows["model.language_model.layers.0.post_attention_layernorm"]
    assert skipped["status"] == "skipped" and "differs from the RMSNorm formula" in skipped["reason"]


def test_accelerate_cpu_and_disk_offload_runs_patched(tmp_path, sample_inputs):
    from accelerate import dispatch_model

    from pypto_gym.models.qwen2_5_vl import TINY_DIR, load

    model, _ = load(TINY_DIR, dtype="float32")
    expected = logits(model, sample_inputs)
    lm = "model.language_model"
    device_map = {"model.visual": "cpu", f"{lm}.embed_tokens": "cpu", f"{lm}.layers.0": "cpu",
                  f"{lm}.layers.1": "disk", f"{lm}.layers.2": "cpu", f"{lm}.layers.3": "disk",
                  f"{lm}.norm": "disk", f"{lm}.rotary_emb": "cpu", "lm_head": "cpu"}
    model = dispatch_model(model, device_map=device_map, offload_dir=str(tmp_path), main_device="cpu")
    assert model.get_submodule(f"{lm}.norm").weight.is_meta  # really offloaded to disk
    report = pypto_gym.patch_model(model, backend="cpu").to_json()
    assert report["summary"]["by_op"] == {"rms_norm": {"candidates": 18, "patched": 18},
                                          "swiglu": {"candidates": 8, "patched": 8},
                                          "rope": {"candidates": 8, "patched": 8},
                                          "varlen_attention": {"candidates": 4, "patched": 4},
                                          "decoder_attention": {"candidates": 4, "patched": 4},
                                          "patch_embed": {"candidates": 1, "patched": 1}}
    got = logits(model, sample_inputs)
    assert compare(got, expected).cosine >= 0.9999
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)
    disk_norm = next(s for s in report["sites"] if s["path"] == f"{lm}.norm")
    assert pypto_gym.patch_report(model).to_json()["sites"][report["sites"].index(disk_norm)]["calls"] == 1


def test_torch_compile_fullgraph_over_patched_text_model(model32):
    text = model32.model.language_model
    ids = torch.randint(0, 600, (1, 12))
    with torch.no_grad():
        eager_ref = text(input_ids=ids, use_cache=False).last_hidden_state
    pypto_gym.patch_model(model32, backend="cpu")
    torch._dynamo.reset()
    with torch.no_grad():
        eager = text(input_ids=ids, use_cache=False).last_hidden_state
        compiled = torch.compile(text, fullgraph=True)(input_ids=ids, use_cache=False).last_hidden_state
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(eager, eager_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_training_gradients_match_unpatched(backend, checkpointing):
    model = tiny_qwen3().train()
    if checkpointing:  # layers re-run their (rewritten) forward during backward
        model.gradient_checkpointing_enable()
    ids = torch.randint(0, 256, (2, 10))

    def grads(m):
        m.zero_grad()
        m(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    plain = copy.deepcopy(model)
    expected = grads(plain)
    report = pypto_gym.patch_model(model, backend=backend)
    got = grads(model)
    calls = report.to_json()["summary"]["calls"]
    # per layer: input norm, add + post-attn norm, the MLP, q/k norms + rope in one; the final norm
    # (checkpointing runs layers again)
    assert calls == 2 * 4 + 1 or (checkpointing and calls > 2 * 4 + 1)
    assert got.keys() == expected.keys()
    for name in expected:
        if backend == "torch":
            torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6)
        else:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"backend": "gpu"}, ValueError, "backend: got 'gpu'"),
    ({"cast_mode": "x"}, ValueError, "cast_mode: got 'x'"),
    ({"sites": 5}, TypeError, "sites: got 5 \\(int\\)"),
    ({"sites": ["text.*", 3]}, TypeError, "sites: got"),
    ({"fuse_residual": "no"}, TypeError, "fuse_residual: got 'no' \\(str\\); expected True or False"),
])
def test_patch_refuses_bad_arguments_naming_them(model32, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        pypto_gym.patch_model(model32, **kwargs)
    assert pypto_gym.patch_report(model32) is None
    assert not any("forward" in m.__dict__ for m in model32.modules())


def test_meta_device_model_is_classified_by_class_and_attributes():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
        model.model.layers[0].post_attention_layernorm = GemmaRMSNorm(32)
    report = pypto_gym.patch_model(model, backend="torch").to_json()
    rows = {s["path"]: s for s in report["sites"]}
    assert rows["model.norm"]["status"] == "patched" and rows["model.norm"]["device"] == "meta"
    assert rows["model.layers.0.self_attn.q_norm"]["status"] == "patched"
    skipped = rows["model.layers.0.post_attention_layernorm"]
    assert skipped["status"] == "skipped" and "not recognised as an RMSNorm by name" in skipped["reason"]


def test_deepcopy_of_a_patched_model_is_independent(model32, sample_inputs):
    pypto_gym.patch_model(model32, backend="torch")
    twin = copy.deepcopy(model32)
    logits(twin, sample_inputs)
    assert pypto_gym.patch_report(twin).to_json()["summary"]["calls"] > 0
    assert pypto_gym.patch_report(model32).to_json()["summary"]["calls"] == 0  # own counters
    pypto_gym.set_enabled(False)
    expected = logits(twin, sample_inputs)  # switch off: the copy's own original forwards
    pypto_gym.set_enabled(True)
    pypto_gym.unpatch_model(twin)
    assert torch.equal(logits(twin, sample_inputs), expected)
    assert pypto_gym.patch_report(model32) is not None  # the original is still patched


def test_a_sites_selection_matching_nothing_is_refused_and_patches_nothing(model32):
    with pytest.raises(pypto_gym.NoSitesError, match=r"sites: 'nomatch\*' matched none of the 43 sites"):
        pypto_gym.patch_model(model32, backend="torch", sites=["nomatch*"])
    assert pypto_gym.patch_report(model32) is None and not any("forward" in m.__dict__ for m in model32.modules())


def test_pypto_gym_sites_and_fuse_residual_are_the_python_defaults_too(model32, monkeypatch):
    monkeypatch.setenv("PYPTO_GYM_SITES", "text.*")
    monkeypatch.setenv("PYPTO_GYM_FUSE_RESIDUAL", "off")
    report = pypto_gym.patch_model(model32, backend="torch").to_json()
    assert report["sites"] and {r["kind"].split(".")[0] for r in report["sites"] if r["status"] == "patched"} == {"text"}
    assert report["summary"]["fused_layers"] == 0 and report["fuse_residual"] is False
    pypto_gym.unpatch_model(model32)
    monkeypatch.setenv("PYPTO_GYM_SITES", "nothing.here")
    with pytest.raises(pypto_gym.NoSitesError, match="PYPTO_GYM_SITES: 'nothing.here' matched none"):
        pypto_gym.patch_model(model32, backend="torch")
    report = pypto_gym.patch_model(model32, backend="torch", sites="vision.*", fuse_residual=True)  # arguments win
    assert report.to_json()["summary"]["fused_layers"] > 0


def test_an_empty_pypto_gym_cache_means_the_default(monkeypatch):
    from pathlib import Path

    from pypto_gym import config

    monkeypatch.setenv("PYPTO_GYM_CACHE", "  ")
    assert config.cache_dir() == Path.home() / ".cache" / "pypto_gym"
