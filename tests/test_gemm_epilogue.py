"""The bias in the GEMM's epilogue (patching/gemm.py): a site's bf16 linears on the cpu backend run as oneDNN's matmul
adding the bias as it writes the product, instead of F.linear's copy of the bias into the output first.

Evidence it is the same linear: bit-equal to F.linear (the reference) and within bf16 rounding of an fp64 product;
a patched vision tower bit-equal with and without it; where it must not apply (the torch reference, fp32, W8A8, a
linear without bias or with hooks) it is not installed; autograd and the switch run the linear's own forward (the
autograd declines counted); unpatch restores every linear exactly.
"""
import copy
import types

import pytest
import torch
import torch.nn.functional as F

import pypto_gym
from pypto_gym import hardware
from pypto_gym.ops import Stats, registry
from pypto_gym.ops.op import Impl
from pypto_gym.patching import gemm

from test_attention import _run, _tower

needs_onednn_bf16 = pytest.mark.skipif(not hardware.onednn_bf16(), reason="oneDNN has no bf16 matmul on this CPU (AVX2 "
                                       "only): the epilogue never applies (the last test here)")


def _epilogue(linear):
    """The linear installed as a site's child would be: a stand-in site holding it and its bypass counts."""
    site = types.SimpleNamespace(module=types.SimpleNamespace(proj=linear), bypassed={}, kind="vision.attention",
                                 stats=Stats(site="vision.attention"), requested_backend="cpu")
    installed = gemm.install(site, ("proj",), types.SimpleNamespace(backend="cpu", quant=None))
    assert [e.name for e in installed] == ["proj"]
    return site, installed[0]


@needs_onednn_bf16
@pytest.mark.parametrize("shape", [(300, 96, 200), (1, 64, 48), (2, 5, 64, 32), (17, 80, 240)])
def test_the_epilogue_gemm_is_f_linear_bit_for_bit(shape):
    *rows, K, N = shape
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(K, N).to(torch.bfloat16)
    x = torch.randn(*rows, K, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        want = F.linear(x, linear.weight, linear.bias)
        exact = x.double() @ linear.weight.double().T + linear.bias.double()
        _, epilogue = _epilogue(linear)
        got = linear(x)
    assert epilogue.calls == 1 and got.shape == want.shape
    assert torch.equal(got, want)
    assert ((got.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-2).all()  # one bf16 rounding of fp32 sums
    epilogue.uninstall()
    assert "forward" not in linear.__dict__ and gemm.EpilogueLinear.SLOT not in linear.__dict__


@needs_onednn_bf16
def test_a_patched_vision_tower_is_bit_equal_with_and_without_the_epilogue(tiny_loaded, monkeypatch):
    model, vision, pixels, grid = _tower("qwen2_5_vl", tiny_loaded)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():  # the embedded checkpoint's biases are zeros: a dropped bias would go unseen
        for m in vision.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.copy_(torch.randn(m.bias.shape, generator=gen) * 0.1)
    twin = copy.deepcopy(model)
    report = pypto_gym.patch_model(model, backend="cpu")
    got = _run(vision, pixels, grid)
    rows = {r["path"]: r["bias_epilogue"] for r in report.to_json()["sites"] if r["path"].startswith("model.visual")}
    blocks = len(vision.blocks)
    for i in range(blocks):  # (the first block's calls include its layer rewrite's first-call check)
        assert set(rows[f"model.visual.blocks.{i}.mlp"]) == {"gate_proj", "up_proj", "down_proj"}
        assert set(rows[f"model.visual.blocks.{i}.attn"]) == {"qkv", "proj"}
        assert all(n >= 1 for kind in ("mlp", "attn") for n in rows[f"model.visual.blocks.{i}.{kind}"].values())
    text_layers = model.config.text_config.num_hidden_layers  # Qwen2's q/k/v have a bias, o_proj none
    assert report.to_json()["summary"]["bias_epilogue_linears"] == 5 * blocks + 3 * text_layers
    assert "bias in the GEMM epilogue: gate_proj, up_proj, down_proj" in str(report)
    assert "bias in the GEMM epilogue: qkv, proj" in str(report)
    monkeypatch.setattr(gemm, "eligible", lambda module: False)
    twin_report = pypto_gym.patch_model(twin, backend="cpu")
    assert not any(r["bias_epilogue"] for r in twin_report.to_json()["sites"])
    assert all(torch.equal(g, w) for g, w in zip(got, _run(next(m for n, m in twin.named_modules()
                                                                if n.endswith("visual")), pixels, grid)))
    pypto_gym.unpatch_model(model)
    assert not any("forward" in m.__dict__ or gemm.EpilogueLinear.SLOT in m.__dict__ for m in model.modules())


@needs_onednn_bf16
@pytest.mark.parametrize("case", ["torch backend", "float32", "w8a8", "no bias", "hooked"])
def test_the_epilogue_is_not_installed_where_it_does_not_apply(case, tiny_loaded):
    model = copy.deepcopy(tiny_loaded[0])
    kwargs = {"backend": "torch" if case == "torch backend" else "cpu"}
    if case == "float32":
        model.float()
    if case == "w8a8":
        kwargs["quant"] = "w8a8"
    mlp = model.model.visual.blocks[0].mlp
    if case == "no bias":
        mlp.gate_proj.bias = None
    if case == "hooked":
        mlp.gate_proj.register_forward_hook(lambda *a: None)
    report = pypto_gym.patch_model(model, **kwargs)
    epilogues = {r["path"]: r["bias_epilogue"] for r in report.to_json()["sites"]}
    if case in ("no bias", "hooked"):  # only that linear stays F.linear
        assert epilogues["model.visual.blocks.0.mlp"] == {"up_proj": 0, "down_proj": 0}
        assert epilogues["model.visual.blocks.1.mlp"] == {"gate_proj": 0, "up_proj": 0, "down_proj": 0}
    else:
        assert not any(epilogues.values()), epilogues
    pypto_gym.unpatch_model(model)


@needs_onednn_bf16
def test_autograd_and_the_switch_run_the_linears_own_forward(tiny_loaded):
    model, vision, pixels, grid = _tower("qwen2_5_vl", tiny_loaded)
    report = pypto_gym.patch_model(model, backend="cpu")
    mlp = vision.blocks[0].mlp
    site = mlp.__dict__["_pypto_gym_site"]
    x = torch.randn(4, mlp.gate_proj.in_features).to(torch.bfloat16)
    out = mlp.down_proj(torch.ones(4, mlp.down_proj.in_features, dtype=torch.bfloat16))  # grad on, weights need it
    out.float().sum().backward()
    assert mlp.down_proj.weight.grad is not None
    assert site.bypassed == {"down_proj: autograd (the epilogue GEMM has no backward)": 1}
    row = lambda: next(r for r in report.to_json()["sites"] if r["path"] == "model.visual.blocks.0.mlp")
    assert row()["bias_epilogue"]["down_proj"] == 0
    with torch.no_grad():
        pypto_gym.set_enabled(False)
        try:
            off = mlp.gate_proj(x)
        finally:
            pypto_gym.set_enabled(True)
        assert row()["bias_epilogue"]["gate_proj"] == 0
        assert torch.equal(off, F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias))
        mlp.gate_proj(x)
    assert row()["bias_epilogue"]["gate_proj"] == 1


def test_nothing_is_installed_without_onednns_bf16_matmul(tiny_loaded, sample_inputs, monkeypatch):
    monkeypatch.setattr(hardware, "onednn_bf16", lambda: False)  # as on an AVX2-only CPU
    model = copy.deepcopy(tiny_loaded[0])
    report = pypto_gym.patch_model(model, backend="cpu")
    with torch.no_grad():
        model(**sample_inputs)
    rows = report.to_json()["sites"]
    assert any(r["kind"] == "vision.mlp" and r["calls"] for r in rows) and not any(r["bias_epilogue"] for r in rows)
    assert not any(gemm.EpilogueLinear.SLOT in m.__dict__ for m in model.modules())


@needs_onednn_bf16
def test_the_epilogue_linears_are_op_calls_counted_per_backend_and_captured(tiny_loaded):
    """Every epilogue linear call goes through the `linear` op: charged to the backend that ran it, a fallback counted
    in its site's row with the linear named, and recorded by ShapeRecorder as its site's `linear` cases."""
    model, vision, pixels, grid = _tower("qwen2_5_vl", tiny_loaded)
    report = pypto_gym.patch_model(model, backend="cpu")
    with pypto_gym.ShapeRecorder(model) as rec:
        _run(vision, pixels, grid)
    linears = [c for c in rec.cases() if c["op"] == "linear"]
    assert {s for c in linears for s in c["sites"]} == {"vision.mlp", "vision.attention"}
    assert all(c["input"]["hidden_states"]["dtype"] == "bfloat16" and "bias" in c["input"] for c in linears)
    site = vision.blocks[0].mlp.__dict__["_pypto_gym_site"]
    assert {linear.name: dict(linear.stats.ran) for linear in site.linears} == \
        {name: {"cpu": linear.calls} for name, linear in zip(("gate_proj", "up_proj", "down_proj"), site.linears)}
    impls = pypto_gym.ops.OPS["linear"].impls
    real = impls["cpu"]
    impls["cpu"] = Impl("cpu", real.fn, lambda *a: "broken")
    registry.availability_changed()  # resolved calls are resolved again (here, and after the real one is back)
    try:
        with pypto_gym.config.scoped(strict=False), torch.no_grad():
            vision.blocks[0].mlp.gate_proj(torch.ones(2, vision.blocks[0].mlp.gate_proj.in_features,
                                                      dtype=torch.bfloat16))
    finally:
        impls["cpu"] = real
        registry.availability_changed()
    row = next(r for r in report.to_json()["sites"] if r["path"] == "model.visual.blocks.0.mlp")
    assert row["fallbacks"] == {"gate_proj (linear): cpu: broken": 1}
    pypto_gym.unpatch_model(model)
