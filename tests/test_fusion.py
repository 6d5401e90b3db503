"""The residual-fusion rewriter: each pattern, each refusal reason, the report rows, the numerical check."""
import ast
import textwrap

import pytest
import torch
from torch import nn

import pypto_gym
from pypto_gym.patching import residual as fusion

from models import GutenOcr3BVLRMSNorm


def rewritten(source: str, norms=("norm",)) -> tuple[str, list]:
    body = ast.parse(textwrap.dedent(source)).body
    new, fused = fusion.rewrite_body(body, set(norms))
    return ast.unparse(ast.fix_missing_locations(ast.Module(body=new, type_ignores=[]))), fused


def test_decoder_pattern():
    src, fused = rewritten("""
        h = r + h
        r = h
        out = self.norm(h)
        y = r + out
    """)
    assert fused == ["norm"]
    assert src.splitlines() == ["_pypto_gym_normed, r = _pypto_gym_add_norm(self.norm, h, r)", "h = r",
                                "out = _pypto_gym_normed", "y = r + out"]


def test_decoder_pattern_with_operands_swapped_keeps_their_order():
    src, _ = rewritten("h = h + r\nr = h\nout = self.norm(h)")
    # x_out = residual + hidden: `h + r` passes h as the residual operand, r as the hidden one
    assert src.splitlines()[0] == "_pypto_gym_normed, r = _pypto_gym_add_norm(self.norm, r, h)"


def test_vision_pattern():
    src, fused = rewritten("""
        h = h + self.attn(self.norm1(h))
        h = h + self.mlp(self.norm2(h))
    """, norms=("norm1", "norm2"))
    assert fused == ["norm2"]
    assert src.splitlines() == ["_pypto_gym_normed, h = _pypto_gym_add_norm(self.norm2, self.attn(self.norm1(h)), h)",
                                "h = h + self.mlp(_pypto_gym_normed)"]


@pytest.mark.parametrize("source", [
    "h = r + h\nr = h\nout = self.other(h)",  # the call is not a patched norm
    "h = r + h\nx = h\nout = self.norm(h)",  # the residual is not re-bound to the sum
    "h = r + h\nr = h\nout = self.norm(h, scale=2)",  # extra arguments
    "h = r * h\nr = h\nout = self.norm(h)",  # not an add
    "h = r + h\nr = h\nout = self.norm(h) + self.norm(h)",  # two calls: ambiguous
])
def test_near_misses_are_left_alone(source):
    src, fused = rewritten(source)
    assert fused == [] and src == ast.unparse(ast.parse(source))


# ---- whole classes: refusal reasons and report rows ---------------------------------------------
class NoPatternLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.post_attention_layernorm = GutenOcr3BVLRMSNorm(16)
        self.proj = nn.Linear(16, 16)

    def forward(self, h):
        return self.proj(self.post_attention_layernorm(h)) + h


class DecoderLikeLayer(nn.Module):
    def __init__(self, residual_dtype=None):
        super().__init__()
        self.post_attention_layernorm = GutenOcr3BVLRMSNorm(16)
        self.attn, self.mlp = nn.Linear(16, 16), nn.Linear(16, 16)
        self.residual_dtype = residual_dtype

    def forward(self, h):
        r = h if self.residual_dtype is None else h.to(self.residual_dtype)
        h = self.attn(h)
        h = r + h
        r = h
        h = self.post_attention_layernorm(h).to(self.mlp.weight.dtype)
        return r + self.mlp(h)


class Stack(nn.Module):
    def __init__(self, *layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, h):
        for layer in self.layers:
            h = layer(h)
        return h


def _randomised(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1 if p.dim() == 1 else 0))
    return model


def test_a_layer_without_the_pattern_is_reported():
    model = _randomised(Stack(NoPatternLayer()))
    report = pypto_gym.patch_model(model, backend="torch").to_json()
    assert report["summary"]["fused_layers"] == 0
    assert report["fusion_skipped"] == [
        {"path": "layers.0", "reason": "NoPatternLayer.forward has no residual-add + norm pattern"}]


def test_a_layer_built_without_source_is_reported():
    namespace = {}
    exec(textwrap.dedent("""
        class Sourceless(DecoderLikeLayer):
            def forward(self, h):
                return DecoderLikeLayer.forward(self, h)
    """), {"DecoderLikeLayer": DecoderLikeLayer}, namespace)
    model = _randomised(Stack(namespace["Sourceless"]()))
    report = pypto_gym.patch_model(model, backend="torch").to_json()
    assert report["fusion_skipped"][0]["reason"] == "source of Sourceless.forward unavailable (OSError)"


def test_a_recognised_layer_is_fused_and_bit_identical():
    model = _randomised(Stack(DecoderLikeLayer(), DecoderLikeLayer()))
    x = torch.randn(3, 16)
    expected = model(x)
    report = pypto_gym.patch_model(model, backend="torch")
    assert torch.equal(model(x), expected)
    assert report.to_json()["summary"]["fused_layers"] == 2 and report.to_json()["fusion_skipped"] == []


def test_a_promoting_residual_add_runs_unfused_and_is_counted():
    """A float32 residual stream around a bfloat16 norm: `r + h` promotes, which the fused op does not
    do; that call adds and normalises separately (exactly the original), and the report says why."""
    model = _randomised(Stack(DecoderLikeLayer(residual_dtype=torch.float32))).to(torch.bfloat16)
    x = torch.randn(3, 16).to(torch.bfloat16)
    expected = model(x)
    report = pypto_gym.patch_model(model, backend="torch")
    assert torch.equal(model(x), expected)
    row = next(r for r in report.to_json()["sites"] if r["kind"] == "text.post_attention_layernorm")
    assert row["fusion_bypassed"] == {"the residual add promotes or broadcasts": 1}


class LockedLayer(DecoderLikeLayer):
    def forward(self, h, lock=None):  # an argument the check cannot copy
        lock.acquire()
        r = h
        h = self.attn(h)
        h = r + h
        r = h
        h = self.post_attention_layernorm(h)
        lock.release()
        return r + self.mlp(h)


def test_a_rewrite_the_check_cannot_run_is_not_used():
    import threading

    model = _randomised(LockedLayer())
    x, lock = torch.randn(3, 16), threading.Lock()
    expected = model(x, lock=lock)
    report = pypto_gym.patch_model(model, backend="torch")
    assert torch.equal(model(x, lock=lock), expected)
    data = report.to_json()
    assert data["summary"]["fused_layers"] == 0 and not any(r["fused_residual"] for r in data["sites"])
    assert data["fusion_skipped"] == [{"path": "", "reason": "numerical check could not run (TypeError: cannot "
                                                             "pickle '_thread.lock' object)"}]


def test_a_rewrite_that_changes_the_result_is_rejected():
    class Drifting(DecoderLikeLayer):  # a distinct class: the verdict is cached per class
        pass

    model = _randomised(Stack(Drifting(), Drifting()))
    x = torch.randn(3, 16)
    expected = model(x)
    pypto_gym.patch_model(model, backend="torch")
    layer = model.layers[0].__dict__[fusion._LAYER_SLOT]
    honest = layer.function
    for m in model.layers:  # make the installed rewrite wrong: it forgets the residual of the MLP
        m.__dict__[fusion._LAYER_SLOT]._fn = lambda self, h: honest(self, h) - h
    assert torch.equal(model(x), expected)  # caught on the first call, the original ran
    rows = pypto_gym.patch_report(model).to_json()["fusion_skipped"]
    assert [r["path"] for r in rows] == ["layers.0", "layers.1"]
    assert rows[0]["reason"].startswith("numerical check failed: the rewritten forward differs from the original")
    assert torch.equal(model(x), expected)


def test_a_grad_enabled_first_call_is_checked_not_rejected():
    """A training-style first call passes activations inside an autograd graph (not deep-copyable): the check
    copies them detached, accepts the rewrite, and gradients still flow through the fused layers."""
    class Trained(DecoderLikeLayer):  # a distinct class: the verdict is cached per class
        pass

    model = _randomised(Stack(Trained(), Trained()))
    reference = _randomised(Stack(Trained(), Trained()))
    reference.load_state_dict(model.state_dict())
    x = torch.randn(3, 16)
    pypto_gym.patch_model(model, backend="torch")
    y = model(nn.functional.linear(x, torch.eye(16, requires_grad=True)))  # not a leaf: inside a graph
    assert pypto_gym.patch_report(model).to_json()["fusion_skipped"] == []
    assert pypto_gym.patch_report(model).to_json()["summary"]["fused_layers"] == 2
    y.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert torch.allclose(y, reference(x), rtol=1e-5, atol=1e-6)


def test_the_check_does_not_charge_the_sites_or_fire_hooks():
    class Checked(DecoderLikeLayer):
        pass

    model = _randomised(Stack(Checked()))
    calls = []
    model.layers[0].attn.register_forward_hook(lambda *a: calls.append(1))
    report = pypto_gym.patch_model(model, backend="torch")
    model(torch.randn(2, 16))
    assert calls == [1]  # the user's hook saw one forward, not the check's two extra ones
    assert report.to_json()["summary"]["calls"] == 1
