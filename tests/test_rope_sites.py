"""The rotary rule (patching/rules/rope.py) on real transformers models, on whichever transformers is installed
(CI runs this module on 5.x and on 4.57, whose attention calls a different function with the MRoPE planes).

What would fail if the patch silently did nothing (as a reassignment of transformers' function does on
5.x): every rope site's call count after a generate, and the tokens of the patched model on the op.
"""
import copy
import importlib
import pickle

import pytest
import torch
from torch import nn

import pypto_gym
from pypto_gym.patching.rules import rope as rope_rule

from models import randomise_norm_weights, tiny_llama, tiny_qwen3

qwen3 = importlib.import_module("transformers.models.qwen3.modeling_qwen3")
qwen2_5_vl = importlib.import_module("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl")


def rope_rows(report):
    return [r for r in report.to_json()["sites"] if r["kind"].endswith("rope")]


def qwen3_bf16():
    return tiny_qwen3().to(torch.bfloat16)


def text_inputs(seed=0):
    return {"input_ids": torch.randint(0, 250, (1, 11), generator=torch.Generator().manual_seed(seed))}


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("build", ["qwen2_5_vl", "qwen3", "llama"])
def test_greedy_tokens_identical_and_every_rope_site_called(build, backend, tiny_loaded, sample_inputs):
    if build == "qwen2_5_vl":
        model, inputs = copy.deepcopy(tiny_loaded[0]), sample_inputs
    else:
        model, inputs = {"qwen3": qwen3_bf16, "llama": lambda: tiny_llama().to(torch.bfloat16)}[build](), text_inputs()
    with torch.no_grad():
        want = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    report = pypto_gym.patch_model(model, backend=backend)
    with torch.no_grad():
        got = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    assert torch.equal(got, want)
    rows = rope_rows(report)
    kinds = {r["kind"] for r in rows}
    assert kinds == {"qwen2_5_vl": {"text.rope", "vision.rope"}, "qwen3": {"text.qk_norm_rope"},
                     "llama": {"text.rope"}}[build]
    for r in rows:  # every attention rotated through the op, on the backend asked for, nothing bypassed
        assert r["status"] == "patched" and r["calls"] > 0 and r["ran_on"] == {backend: r["calls"]}, r
        assert not r["fallbacks"] and not r["fusion_bypassed"] and r["rotary"]["rejected"] is None, r
    if build == "qwen2_5_vl":
        text_calls = [r["calls"] for r in rows if r["kind"] == "text.rope"]
        assert text_calls == [16] * 4  # one prefill and 15 decode steps per layer
        assert {r["rotary"]["cast_mode"] for r in rows if r["kind"] == "vision.rope"} == {"fp32"}  # HF's vision rounding


def test_qwen3_q_and_k_norms_are_fused_into_the_rotation_and_say_so():
    model = qwen3_bf16()
    report = pypto_gym.patch_model(model, backend="cpu")
    with torch.no_grad():
        model(**text_inputs())
    sites = {r["path"]: r for r in report.to_json()["sites"] if r["kind"] != "text.attention"}  # its own site too
    for layer in range(2):
        attn = f"model.layers.{layer}.self_attn"
        assert sites[attn]["op"] == "qk_norm_rope" and sites[attn]["calls"] == 1
        for norm in ("q_norm", "k_norm"):
            row = sites[f"{attn}.{norm}"]
            assert row["fused_into"] == f"qk_norm_rope at {attn}" and row["calls"] == 0
    assert "fused into qk_norm_rope at model.layers.0.self_attn" in str(report)


def test_without_its_norm_sites_a_qwen3_attention_rotates_only():
    """sites= leaves q_norm/k_norm out: the attention runs rope alone, its norms HF's own, exactly."""
    model = tiny_qwen3()  # fp32: the torch backend is bit-exact
    with torch.no_grad():
        want = model(**text_inputs()).logits
    report = pypto_gym.patch_model(model, backend="torch", sites="*.qk_norm_rope")
    with torch.no_grad():
        assert torch.equal(model(**text_inputs()).logits, want)
    rows = rope_rows(report)
    assert [r["op"] for r in rows] == ["rope", "rope"] and all(r["calls"] == 1 for r in rows)


def test_patching_is_instance_scoped_and_unpatch_is_exact():
    patched_model, other = qwen3_bf16(), qwen3_bf16()
    functions_before = dict(vars(qwen3))
    inputs = text_inputs()
    with torch.no_grad():
        want = other(**inputs).logits
    report = pypto_gym.patch_model(patched_model, backend="cpu")
    assert dict(vars(qwen3)) == functions_before  # no function of transformers reassigned
    assert type(patched_model.model.layers[0].self_attn).forward is qwen3.Qwen3Attention.forward
    assert not any("forward" in m.__dict__ for m in other.modules())  # the other model is untouched
    with torch.no_grad():
        other(**inputs)
    assert sum(r["calls"] for r in rope_rows(report)) == 0  # ... and never calls the op
    pypto_gym.unpatch_model(patched_model)
    assert not any("forward" in m.__dict__ or "_pypto_gym_site" in m.__dict__ for m in patched_model.modules())
    with torch.no_grad():
        assert torch.equal(patched_model(**inputs).logits, want)


def test_the_switch_turns_the_rotation_back_to_hfs_per_call():
    model = qwen3_bf16()
    inputs = text_inputs()
    with torch.no_grad():
        want = model(**inputs).logits
    report = pypto_gym.patch_model(model, backend="cpu")
    with pypto_gym.config.scoped(enabled=False), torch.no_grad():
        assert torch.equal(model(**inputs).logits, want)
    assert sum(r["calls"] for r in rope_rows(report)) == 0


def test_a_pickled_patched_model_comes_back_rotating_through_the_op():
    model = qwen3_bf16()
    pypto_gym.patch_model(model, backend="cpu")
    inputs = text_inputs()
    with torch.no_grad():
        want = model(**inputs).logits
    clone = pickle.loads(pickle.dumps(model))
    with torch.no_grad():
        assert torch.equal(clone(**inputs).logits, want)
    assert all(r["calls"] == 2 for r in rope_rows(pypto_gym.patch_report(clone)))  # its counters carried on


def test_a_rotary_function_reassigned_after_patching_runs_and_is_counted(monkeypatch):
    """Liger-style: replacing the module's function later is seen by the patched model (the call runs the
    replacement, not the op), counted as a bypass."""
    model = qwen3_bf16()
    report = pypto_gym.patch_model(model, backend="cpu")
    with torch.no_grad():  # in use first: the rewrite's first-call check (once per process and class, so only in
        model(**text_inputs())  # a process that had not run one yet) happens here, not in the call counted below
    calls = {r["path"]: r["calls"] for r in rope_rows(report)}
    seen = []

    def replacement(q, k, cos, sin, *args, **kwargs):
        seen.append(q.shape)
        return q, k

    monkeypatch.setattr(qwen3, "apply_rotary_pos_emb", replacement)
    with torch.no_grad():
        model(**text_inputs())
    assert len(seen) == 2
    for r in rope_rows(report):
        assert r["calls"] == calls[r["path"]] == 1, r
        assert r["fusion_bypassed"] == {"replacement was replaced after patching": 1}, r


def test_hooks_on_a_fused_norm_see_it_run():
    model = qwen3_bf16()
    report = pypto_gym.patch_model(model, backend="cpu")
    seen = []
    model.model.layers[0].self_attn.q_norm.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    with torch.no_grad():
        model(**text_inputs())
    assert seen == [torch.Size([1, 11, 4, 32])]  # HF's own [B, S, H, D] norm input, as unpatched
    sites = {r["path"]: r for r in rope_rows(report)}
    assert sites["model.layers.0.self_attn"]["fusion_bypassed"] == {"q_norm/k_norm has hooks": 1}
    assert sites["model.layers.1.self_attn"]["calls"] == 1


def apply_rotary_fake(q, k, cos, sin):
    """Named like a rotary function, computes something else."""
    return q * cos.unsqueeze(1), k * sin.unsqueeze(1)


class FakeRotaryAttention(nn.Module):
    head_dim = 8

    def forward(self, q, k, cos, sin):
        q, k = apply_rotary_fake(q, k, cos, sin)
        return q + 0, k


def test_a_function_that_is_not_a_rotation_is_skipped_with_the_reason():
    model = nn.Sequential(FakeRotaryAttention())
    rows = rope_rows(pypto_gym.patch_model(model, backend="torch", fuse_residual=False))
    assert len(rows) == 1 and rows[0]["status"] == "skipped"
    assert "probe: apply_rotary_fake is not a rotate-half rotation of q and k" in rows[0]["reason"]


def test_a_call_the_probe_did_not_see_runs_hfs_function_counted():
    model = tiny_llama()
    report = pypto_gym.patch_model(model, backend="cpu")
    site = model.model.layers[0].self_attn.__dict__["_pypto_gym_site"]
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16)
    cos, sin = torch.randn(1, 3, 16), torch.randn(1, 3, 16)
    fn = site.form.fn
    expected = fn(q, k, cos, sin)
    got = site.apply(fn, (q, k, cos, sin), {"unsqueeze_dim": 1})  # bound by the signature: still the op
    assert all(torch.equal(a, b) for a, b in zip(got, expected)) and site.stats.calls == 1
    with pytest.raises(TypeError, match="bogus"):  # HF's function itself says what is wrong, as unpatched
        site.apply(fn, (q, k, cos, sin), {"bogus": 1})
    assert site.bypassed == {"a call with arguments the probe did not see": 1} and site.stats.calls == 1
    assert report.to_json()["summary"]["calls"] == 1


def test_torch_compile_fullgraph_over_a_patched_attention():
    torch._dynamo.reset()
    model = tiny_qwen3()
    pypto_gym.patch_model(model, backend="cpu")
    text = model.model
    ids = text_inputs()["input_ids"]
    with torch.no_grad():
        eager = text(input_ids=ids, use_cache=False).last_hidden_state
        compiled = torch.compile(text, fullgraph=True)(input_ids=ids, use_cache=False).last_hidden_state
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    site = model.model.layers[0].self_attn.__dict__["_pypto_gym_site"]
    assert site.stats.ran.get("cpu", 0) >= 2  # the compiled graph's op ran on the backend and counted


def test_the_probe_reads_each_function_by_its_math():
    form, reason = rope_rule.probe(qwen2_5_vl.apply_rotary_pos_emb_vision, 16)
    assert reason == "" and (form.unsqueeze_dim, form.cast_mode, form.mrope) == (-2, "fp32", False)
    text_fn = getattr(qwen2_5_vl, "apply_multimodal_rotary_pos_emb", None) or qwen2_5_vl.apply_rotary_pos_emb
    form, reason = rope_rule.probe(text_fn, 16)
    assert reason == "" and (form.unsqueeze_dim, form.cast_mode) == (1, "hf")
    assert form.mrope == hasattr(qwen2_5_vl, "apply_multimodal_rotary_pos_emb")


def _tiny_olmo2(dtype):
    from transformers import Olmo2Config, Olmo2ForCausalLM

    cfg = Olmo2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, eos_token_id=None, pad_token_id=None,
                      bos_token_id=None)
    torch.manual_seed(0)
    model = Olmo2ForCausalLM(cfg).eval()
    randomise_norm_weights(model)  # one rounding or two only differ with weights other than ones
    return model.to(dtype)


def test_a_one_rounding_norm_is_patched_with_its_own_rounding():
    """Olmo2's RMSNorm (and T5's, GPT-OSS's, Olmo3's...) multiplies the weight with the fp32 normalised x and
    rounds once; HF-Llama's rounds twice. The probe tells them apart, the site runs the module's own rounding (the
    fp32 cast mode), and the torch backend is bit-identical in bf16, q/k norms and residual fusion included."""
    model = _tiny_olmo2(torch.bfloat16)
    ids = torch.randint(0, 120, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    report = pypto_gym.patch_model(model, backend="torch")
    norms = [r for r in report.to_json()["sites"] if r["op"] == "rms_norm"]
    assert norms and all(r["status"] == "patched" and r["cast_mode"] == "fp32" for r in norms), norms
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
    qwen = tiny_qwen3().to(torch.bfloat16)  # Llama-style norms keep the two roundings
    rows = pypto_gym.patch_model(qwen, backend="torch").to_json()["sites"]
    assert {r["cast_mode"] for r in rows if r["op"] == "rms_norm"} == {"hf"}


def test_the_rotary_verdict_is_per_dtype_and_keeps_hfs_output_dtype():
    """Olmo2's rotary embedding hands fp32 cos/sin to bf16 q/k and its function casts the results back to q's dtype.
    After an fp32 Olmo2 was patched, a bf16 one reused that first-call verdict and the op's hf mode returned fp32
    (SDPA then raised). The probe now sees the cast back, the verdict is per dtype: both models are bit-identical
    to their unpatched selves on torch, and run on cpu."""
    ids = torch.randint(0, 120, (1, 9), generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16):
        model = _tiny_olmo2(dtype)
        with torch.no_grad():
            want = model(ids).logits
        fused = copy.deepcopy(model)
        report = pypto_gym.patch_model(model, backend="torch")
        with torch.no_grad():
            assert torch.equal(model(ids).logits, want)
        rows = [r for r in report.to_json()["sites"] if "rope" in r["kind"]]
        assert rows and all(r["status"] == "patched" and r["calls"] > 0 and r["rotary"]["rejected"] is None
                            for r in rows), rows
        pypto_gym.patch_model(fused, backend="cpu")
        with torch.no_grad():
            got = fused(ids).logits
        assert got.dtype == want.dtype and float(torch.nn.functional.cosine_similarity(
            got.flatten().float(), want.flatten().float(), 0)) > 0.9999


def test_a_rotary_function_monkeypatched_after_one_patch_is_the_one_the_next_patch_probes(monkeypatch):
    """The rotary function was frozen per class at the first patch: after a monkeypatch every later model of the
    class named (and probed) a function no longer in use."""
    from transformers.models.olmo2 import modeling_olmo2

    first = _tiny_olmo2(torch.float32)
    pypto_gym.patch_model(first, backend="torch")
    original = modeling_olmo2.apply_rotary_pos_emb

    def replacement_rotary(q, k, cos, sin, unsqueeze_dim=1):
        return original(q, k, cos, sin, unsqueeze_dim)

    monkeypatch.setattr(modeling_olmo2, "apply_rotary_pos_emb", replacement_rotary)
    second = _tiny_olmo2(torch.float32)
    report = pypto_gym.patch_model(second, backend="torch")
    rows = [r for r in report.to_json()["sites"] if "rope" in r["kind"]]
    assert rows and all(r["status"] == "patched" and r["rotary"]["function"] == "replacement_rotary" for r in rows)
    ids = torch.randint(0, 120, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        second(ids)
    assert all(r["calls"] > 0 and not r["fusion_bypassed"] for r in pypto_gym.patch_report(second).to_json()["sites"]
               if "rope" in r["kind"])


def _my_rotary(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    half = q.shape[-1] // 2
    rot = lambda x: torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # noqa: E731
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def test_a_rotary_function_the_kernels_hub_wrapped_is_probed_and_named_as_itself():
    """transformers >= 5.25 depends on `kernels`, whose `use_kernel_forward_from_hub` turns apply_rotary_pos_emb
    into a `Func` module calling it: the rule takes the module (what the attention calls), with the function's
    signature and name."""
    import inspect

    from pypto_gym.patching.rules.rope import function_name, plain_function, probe

    kernels = pytest.importorskip("kernels")
    wrapped = kernels.use_kernel_forward_from_hub("rotary_pos_emb")(_my_rotary)
    assert isinstance(wrapped, torch.nn.Module) and not hasattr(wrapped, "__name__")
    assert plain_function(wrapped) is _my_rotary and function_name(wrapped) == "_my_rotary"
    form, why = probe(wrapped, 16)
    assert why == "" and form.fn is wrapped and form.signature == inspect.signature(_my_rotary)
