"""patch_embed and the patch-embedding rule (patching/rules/patch_embed.py) on real transformers vision towers (CI runs this
module on 5.x and on 4.57).

The op's golden is HF's forward (the conv3d); the independent evidence is an fp64 product of each flattened patch
with the flattened kernel, and a hand-worked patch. What would fail if the site did nothing or computed something
else: the site's call count, the tower's output bit-equal to HF's on the torch backend and within precision on
the cpu backend (the GEMM), the cpu backend's calls counted on it, exact unpatch.
"""
import copy

import pytest
import torch

import pypto_gym
from pypto_gym import ops
from pypto_gym.ops.defs.patch_embed import patch_embed
from pypto_gym.precision import compare

from test_attention import _run, _tower, _vision


def test_the_golden_is_each_patch_dotted_with_the_kernel():
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(7, 3 * 2 * 4 * 4, generator=gen), torch.randn(5, 3, 2, 4, 4, generator=gen), \
        torch.randn(5, generator=gen)
    want = x.double() @ w.double().reshape(5, -1).T + b.double()
    assert torch.allclose(patch_embed(x, w, b).double(), want, rtol=1e-5, atol=1e-5)
    # hand-worked: a kernel of ones sums the patch; one output channel per kernel
    ones = torch.ones(1, 1, 1, 2, 2)
    assert torch.equal(patch_embed(torch.arange(8.0).reshape(2, 4), ones), torch.tensor([[6.0], [22.0]]))


def test_rows_that_are_not_one_patch_are_refused_naming_x():
    with pytest.raises(ValueError, match=r"x: rows of K=95 values; expected one patch of C\*T\*H\*W = 3 \* 2 \* 4 \* 4"):
        ops.patch_embed(torch.randn(4, 95), torch.randn(8, 3, 2, 4, 4))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("build", ["qwen2_5_vl", "qwen2_vl"])
def test_the_vision_tower_embeds_its_patches_as_one_gemm(build, backend, tiny_loaded):
    model, vision, pixels, grid = _tower(build, tiny_loaded)
    want = _run(vision, pixels, grid)
    report = pypto_gym.patch_model(model, backend=backend)
    got = _run(vision, pixels, grid)
    rows = [r for r in report.to_json()["sites"] if r["kind"] == "vision.patch_embed"]
    assert [(r["path"].rsplit(".", 1)[-1], r["status"]) for r in rows] == [("patch_embed", "patched")]
    assert rows[0]["calls"] == 1 and rows[0]["ran_on"] == {backend: 1} and not rows[0]["fallbacks"]
    if backend == "torch":  # the golden is HF's conv3d
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    else:
        assert all(compare(g, w, "tower", "mixture").passed for g, w in zip(got, want))
    pypto_gym.unpatch_model(model)
    assert "forward" not in vision.patch_embed.__dict__ and "_pypto_gym_site" not in vision.patch_embed.__dict__
    assert all(torch.equal(g, w) for g, w in zip(_run(vision, pixels, grid), want))


def test_the_switch_off_and_autograd_run_hfs_conv(tiny_loaded):
    model, vision, pixels, grid = _tower("qwen2_5_vl", tiny_loaded)
    want = _run(vision, pixels, grid)
    report = pypto_gym.patch_model(model, backend="cpu")
    with pypto_gym.config.scoped(enabled=False):
        assert all(torch.equal(g, w) for g, w in zip(_run(vision, pixels, grid), want))
    embed = vision.patch_embed
    x = pixels.float().requires_grad_()
    embed.float()(x).sum().backward()  # the op has no backward: HF's own forward, the reason counted
    row = next(r for r in report.to_json()["sites"] if r["kind"] == "vision.patch_embed")
    assert row["fusion_bypassed"] == {"autograd: patch_embed has no backward": 1} and row["calls"] == 0
    want_grad = embed.proj.weight.reshape(embed.proj.weight.shape[0], -1).sum(0)
    assert torch.allclose(x.grad, want_grad.expand_as(x), rtol=1e-4, atol=1e-4)


class _Doubled(torch.nn.Module):
    """Shaped like a patch embedding, but its forward does something else with its pixels."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Conv3d(3, 8, kernel_size=(2, 4, 4), stride=(2, 4, 4), bias=False)

    def forward(self, x):
        return 2 * self.proj(x.view(-1, 3, 2, 4, 4)).view(-1, 8)


class _Sliding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Conv3d(3, 8, kernel_size=(2, 4, 4), stride=(1, 2, 2), bias=False)


def test_only_a_conv_that_sees_each_patch_once_and_is_the_forward_is_patched():
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionPatchEmbed

    hf = Qwen2_5_VisionPatchEmbed(patch_size=4, temporal_patch_size=2, in_channels=3, embed_dim=8)
    model = torch.nn.ModuleDict({"visual": torch.nn.ModuleDict({"patch_embed": hf, "doubled": _Doubled(),
                                                                "sliding": _Sliding()})})
    report = pypto_gym.patch_model(model, backend="cpu", strict=True)
    rows = {r["path"]: r for r in report.to_json()["sites"]}
    assert set(rows) == {"visual.patch_embed", "visual.doubled"}  # the sliding conv is no candidate at all
    assert rows["visual.patch_embed"]["status"] == "patched" and rows["visual.doubled"]["status"] == "skipped"
    assert "forward is not proj's conv over its rows viewed as patches" in rows["visual.doubled"]["reason"]


def test_a_backend_without_the_op_leaves_the_conv_to_hf_saying_why(tiny_loaded):
    model = copy.deepcopy(tiny_loaded[0])
    report = pypto_gym.patch_model(model, backend="pypto", strict=False)  # lenient: pypto itself may be absent
    row = next(r for r in report.to_json()["sites"] if r["kind"] == "vision.patch_embed")
    assert row["status"] == "skipped" and row["reason"].startswith("patch_embed has no PyPTO kernel")
    assert "forward" not in _vision(model).patch_embed.__dict__
