"""decoder_attention and the text attention rule (patching/rules/text_attention.py): the decoder's attention through
transformers' own attention interface (CI runs this module on 5.x and on 4.57).

The op's golden follows transformers' `sdpa_attention_forward` step by step; the independent evidence here is an
fp64 softmax attention with GQA and masks written out, hand-worked cases, and transformers' own function on the same
inputs (bit-equal). What would fail if the site silently did nothing or computed something else: every text
attention site's call count over prefill and decode, greedy tokens of padded batches equal to unpatched, the
configured implementation restored exactly on unpatch.
"""
import copy
import types

import pytest
import torch

import pypto_gym
from pypto_gym import ops
from pypto_gym.ops.defs.decoder_attention import decoder_attention
from pypto_gym.patching.rules import text_attention

from models import tiny_llama, tiny_qwen3

OP = ops.OPS["decoder_attention"]


def fp64_attention(q, k, v, scale, allowed):
    """softmax(q k^T * scale) v in fp64, query head h reading KV head h // (Hq / Hkv), `allowed` [B, 1, S, Skv]."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(groups, dim=1) for t in (k, v))
    s = q.double() @ k.transpose(-1, -2) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    return (s.softmax(-1) @ v).transpose(1, 2)


def test_the_golden_is_masked_gqa_softmax_attention():
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 8, 5, 16, generator=gen), torch.randn(2, 2, 9, 16, generator=gen), \
        torch.randn(2, 2, 9, 16, generator=gen)
    mask = OP.args[5].generate(torch.empty(2, 1, 5, 9, dtype=torch.bool, device="meta"), gen)
    for gqa in ("pack", "repeat"):
        got = decoder_attention(q, k, v, 0.3, True, mask, gqa)
        assert torch.allclose(got.double(), fp64_attention(q, k, v, 0.3, mask), rtol=1e-5, atol=1e-6)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
    got = decoder_attention(q, k[:, :, :5], v[:, :, :5], 0.3, True)  # no mask, S > 1: causal
    assert torch.allclose(got.double(), fp64_attention(q, k[:, :, :5], v[:, :, :5], 0.3, causal), atol=1e-6)
    # hand-worked: a decode step over one key returns that key's value; equal keys average the values
    v1 = torch.arange(6.0).reshape(1, 1, 3, 2)
    assert torch.equal(decoder_attention(torch.randn(1, 2, 1, 2), torch.randn(1, 1, 1, 2), v1[:, :, :1], 1.0, True),
                       v1[:, :, :1].expand(1, 1, 2, 2).transpose(1, 2).reshape(1, 1, 2, 2))
    got = decoder_attention(torch.randn(1, 1, 1, 2), torch.ones(1, 1, 3, 2), v1, 1.0, True)
    assert torch.allclose(got, v1.mean(2, keepdim=True))


@pytest.mark.parametrize("i", range(len(OP.examples)))
def test_the_golden_is_bit_identical_to_transformers_sdpa(i):
    """transformers' sdpa_attention_forward on the same inputs, with the GQA form the installed version uses."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v, scale, causal, mask, _ = OP.example_args(OP.examples[i])
    module = types.SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], is_causal=causal)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=scale)  # is_causal from the module, as models do
    assert torch.equal(decoder_attention(q, k, v, scale, causal, mask, text_attention.decode_gqa()), want)


def test_bad_heads_are_refused_naming_k():
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 3, 2, 8)
    with pytest.raises(ValueError, match="k: 3 KV heads for 4 query heads"):
        ops.decoder_attention(q, k, k, 0.5, True)


def _prompts(model):
    """Two prompts of different lengths in one left-padded batch: the mask path (padding) and the causal one."""
    ids = torch.tensor([[0, 0, 0, 5, 17, 33, 2, 9], [4, 8, 15, 16, 23, 42, 7, 1]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8])
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("build", [tiny_qwen3, tiny_llama], ids=["qwen3", "llama"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_patched_decoders_generate_the_same_tokens_and_every_site_is_called(build, backend):
    base = build().float()
    model = copy.deepcopy(base)
    inputs = _prompts(base)
    with torch.no_grad():
        want = base.generate(**inputs, max_new_tokens=10, do_sample=False, pad_token_id=0)
        report = pypto_gym.patch_model(model, backend=backend)
        assert model.config._attn_implementation == "pypto_gym"
        got = model.generate(**inputs, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)
    rows = [r for r in report.to_json()["sites"] if r["kind"] == "text.attention"]
    assert len(rows) == 2 and all(r["status"] == "patched" for r in rows)
    assert all(r["calls"] == 10 and r["ran_on"] == {backend: 10} and not r["fusion_bypassed"] for r in rows), rows
    assert "2/2 text attention sites patched" in str(report)
    pypto_gym.unpatch_model(model)
    assert model.config._attn_implementation == "sdpa"


def test_the_embedded_model_takes_its_text_attention_and_leaves_the_vision_config_alone(tiny_loaded):
    model = copy.deepcopy(tiny_loaded[0])
    report = pypto_gym.patch_model(model, backend="cpu")
    rows = [r for r in report.to_json()["sites"] if r["kind"] == "text.attention"]
    assert [r["status"] for r in rows] == ["patched"] * 4
    text_config, vision_config = model.config.text_config, model.config.vision_config
    assert text_config._attn_implementation == "pypto_gym" and vision_config._attn_implementation == "sdpa"
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        model(input_ids=ids)
    assert all(r["calls"] == 1 for r in report.to_json()["sites"] if r["kind"] == "text.attention")
    pypto_gym.unpatch_model(model)
    assert text_config._attn_implementation == "sdpa"


def test_an_eager_model_is_left_alone_with_the_reason():
    model = tiny_qwen3()
    model.config._attn_implementation = "eager"
    report = pypto_gym.patch_model(model, backend="torch")
    rows = [r for r in report.to_json()["sites"] if r["kind"] == "text.attention"]
    assert rows and all(r["status"] == "skipped" and "'eager' configured" in r["reason"] for r in rows)
    assert model.config._attn_implementation == "eager"


def test_declined_calls_run_transformers_sdpa_and_are_counted():
    """A call needing gradients (decoder_attention has no backward) and the switch off both run sdpa itself."""
    base = tiny_qwen3().float()
    model = copy.deepcopy(base)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    report = pypto_gym.patch_model(model, backend="torch")
    got, want = model(input_ids=ids).logits, base(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got.sum().backward()
    assert all(p.grad is not None for p in model.model.layers[0].self_attn.q_proj.parameters())
    rows = [r for r in report.to_json()["sites"] if r["kind"] == "text.attention"]
    assert all(r["fusion_bypassed"] == {"autograd: decoder_attention has no backward": 1} and r["calls"] == 0
               for r in rows), rows
    with torch.no_grad(), pypto_gym.config.scoped(enabled=False):
        model(input_ids=ids)
    assert all(r["calls"] == 0 for r in report.to_json()["sites"] if r["kind"] == "text.attention")


def test_a_kernel_defect_falls_back_counted_and_strict_mode_stops(monkeypatch, lenient):
    def broken(backend, *args):
        raise RuntimeError("kernel defect")

    monkeypatch.setattr(OP.impls["cpu"], "fn", broken)
    base = tiny_qwen3().float()
    model = copy.deepcopy(base)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    report = pypto_gym.patch_model(model, backend="cpu", sites="text.attention")  # the other sites' cpu kernels aside
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="kernel defect"):
        torch.testing.assert_close(model(input_ids=ids).logits, base(input_ids=ids).logits, rtol=0, atol=0)
    rows = [r for r in report.to_json()["sites"] if r["kind"] == "text.attention"]
    assert all(r["ran_on"] == {"torch": 1} and r["fallbacks"] for r in rows), rows
    pypto_gym.unpatch_model(model)
    pypto_gym.patch_model(model, backend="cpu", sites="text.attention", strict=True)
    with torch.no_grad(), pytest.raises(Exception, match="kernel defect"):
        model(input_ids=ids)


def test_a_patched_model_deep_copies_and_its_copy_runs_the_sites():
    model = tiny_qwen3().float()
    pypto_gym.patch_model(model, backend="torch")
    twin = copy.deepcopy(model)
    ids = torch.tensor([[3, 1, 4]])
    with torch.no_grad():
        torch.testing.assert_close(twin(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
    site = twin.model.layers[0].self_attn.__dict__[text_attention.SLOT]
    assert site.module is twin.model.layers[0].self_attn and site.stats.calls == 1
