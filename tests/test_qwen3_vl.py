"""Qwen3-VL, patched: a tiny random Qwen3-VL (LayerNorms with a bias and a GELU MLP in the vision tower, full
attention per image, DeepStack features added into the first decoder layers, interleaved MRoPE, Qwen3's q/k norms)
runs every site kind it has on the fused ops, strict, with greedy tokens and logits as unpatched."""
import pytest
import torch

import pypto_gym

from models import qwen3_vl_inputs, tiny_qwen3_vl

pytest.importorskip("transformers.models.qwen3_vl")

KINDS = {"rms_norm", "swiglu", "rope", "qk_norm_rope", "varlen_attention", "decoder_attention", "patch_embed",
         "layer_norm"}


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
        assert all(set(r["ran_on"]) <= {backend} for r in rows) and not report.to_json()["summary"]["fallbacks"]
        kinds = {r["kind"] for r in rows if r["op"] == "layer_norm"}
        assert kinds == {"vision.norm1", "vision.norm2", "vision.merger.norm", "vision.deepstack_merger.norm"}
        assert report.to_json()["summary"]["fused_layers"] == model.config.text_config.num_hidden_layers
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
            assert report.to_json()["summary"]["fused_layers"] == model.config.text_config.num_hidden_layers
            assert torch.equal(_run(model, inputs)[1], want)
        finally:
            pypto_gym.unpatch_model(model)
