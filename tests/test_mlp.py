"""The MLP rules on real transformers models: the SwiGLU rule (patching/rules/mlp.py) found, probed, patched, exact on
torch; the GELU MLP rule (gelu_mlp.py) on fc1 -> GELU -> fc2 MLPs."""
import copy
import math

import pytest
import torch
from torch import nn

import pypto_gym
from pypto_gym import ops
from pypto_gym.ops import OPS
from pypto_gym.precision import compare

from models import logits, tiny_llama, tiny_qwen2_vl, tiny_qwen3
from support import assert_close


def mlp_rows(report):
    return [r for r in report["sites"] if r["op"] == "swiglu"]


def test_every_qwen2_5_vl_mlp_is_a_site_text_and_vision(model32):
    rows = mlp_rows(pypto_gym.patch_model(model32, backend="torch").to_json())
    kinds = {r["path"]: r["kind"] for r in rows if r["status"] == "patched"}
    assert sorted(set(kinds.values())) == ["text.mlp", "vision.mlp"] and len(kinds) == 4 + 4
    vision = model32.model.visual.blocks[0].mlp
    assert vision.gate_proj.bias is not None and model32.model.language_model.layers[0].mlp.gate_proj.bias is None
    assert {r["D"] for r in rows} == {model32.config.text_config.intermediate_size,
                                      model32.config.vision_config.intermediate_size}


@pytest.mark.parametrize("build", ["qwen2_5_vl", "qwen3", "llama"])
def test_torch_backend_is_bit_identical_and_cpu_tokens_identical(build, tiny_loaded, sample_inputs):
    """torch: logits and generate bit-identical with every MLP fused; cpu: logits within SPEC 5's rule
    and greedy tokens identical over 16 tokens."""
    if build == "qwen2_5_vl":
        model, inputs = copy.deepcopy(tiny_loaded[0]), sample_inputs
    else:
        model = {"qwen3": tiny_qwen3, "llama": tiny_llama}[build]().to(torch.bfloat16)
        inputs = {"input_ids": torch.randint(0, 250, (1, 11), generator=torch.Generator().manual_seed(0))}
    with torch.no_grad():
        want = model(**inputs).logits
        want_tokens = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    exact = copy.deepcopy(model).float()
    with torch.no_grad():
        exact_want = exact(**inputs).logits
    with pypto_gym.patched(exact, backend="torch", sites="*.mlp"):
        with torch.no_grad():
            assert torch.equal(exact(**inputs).logits, exact_want)
    report = pypto_gym.patch_model(model, backend="cpu")
    with torch.no_grad():
        got = model(**inputs).logits
        got_tokens = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    c = compare(got.float(), want.float(), "logits")
    assert c.cosine >= 0.9999, c
    assert torch.equal(got_tokens, want_tokens)
    rows = [r for r in mlp_rows(report.to_json()) if r["status"] == "patched"]
    assert rows and all(r["calls"] > 0 and r["backend"] == "cpu" and not r["fallbacks"] for r in rows)


class GeluMLP(nn.Module):
    """Gemma-style: the same three projections, a GELU instead of SiLU."""

    def __init__(self, h=16, i=32):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(h, i), nn.Linear(h, i), nn.Linear(i, h)
        self.act_fn = nn.GELU(approximate="tanh")

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Stack(nn.Module):
    def __init__(self, *mlps):
        super().__init__()
        self.mlp = mlps[0]
        self.more = nn.ModuleList(mlps[1:])


def test_a_gelu_mlp_is_skipped_with_the_reason():
    model = Stack(GeluMLP())
    report = pypto_gym.patch_model(model, backend="torch", fuse_residual=False).to_json()
    (row,) = mlp_rows(report)
    assert row["status"] == "skipped" and "act_fn (GELU) is not SiLU" in row["reason"]
    assert "forward" not in model.mlp.__dict__


def test_a_quick_gelu_mlp_is_skipped_with_the_reason():
    """Qwen2-VL's vision MLP is fc1 -> QuickGELU -> fc2: not a SwiGLU site, and a GELU MLP site only where a fused
    epilogue computes its activation (oneDNN's are GELU's erf and tanh forms): skipped, saying so."""
    model = tiny_qwen2_vl()
    report = pypto_gym.patch_model(model, backend="torch").to_json()
    assert not [r for r in mlp_rows(report) if r["kind"] == "vision.mlp"]
    vision = [r for r in report["sites"] if r["kind"] == "vision.gelu_mlp"]
    assert vision and all(r["status"] == "skipped" and r["reason"].startswith("QuickGELU") for r in vision)
    assert all(r["status"] == "patched" for r in mlp_rows(report) if r["kind"] == "text.mlp")


def test_a_hook_on_act_fn_runs_the_original_forward_counted(model32, sample_inputs):
    seen = []
    act = model32.model.language_model.layers[0].mlp.act_fn
    act.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    want = logits(copy.deepcopy(model32), sample_inputs)
    seen.clear()
    report = pypto_gym.patch_model(model32, backend="torch")
    assert torch.equal(logits(model32, sample_inputs), want) and len(seen) == 1
    row = next(r for r in mlp_rows(report.to_json()) if r["path"].endswith("layers.0.mlp"))
    assert row["fusion_bypassed"] == {"act_fn has hooks": 1} and row["calls"] == 0


def test_sites_globs_select_and_exclude_mlps(model32):
    report = pypto_gym.patch_model(model32, backend="torch", sites="!*.mlp").to_json()
    assert all(r["status"] == "skipped" and r["reason"].startswith("not selected") for r in mlp_rows(report))
    assert all(r["status"] == "patched" for r in report["sites"] if r["op"] == "rms_norm")
    pypto_gym.unpatch_model(model32)
    report = pypto_gym.patch_model(model32, backend="torch", sites="text.mlp").to_json()
    assert {r["kind"] for r in report["sites"] if r["status"] == "patched"} == {"text.mlp"}


def test_the_switch_runs_the_original_mlp(model32, sample_inputs):
    want = logits(copy.deepcopy(model32), sample_inputs)
    report = pypto_gym.patch_model(model32, backend="cpu", sites="*.mlp")
    with pypto_gym.config.scoped(enabled=False):
        assert torch.equal(logits(model32, sample_inputs), want)
    assert report.to_json()["summary"]["calls"] == 0


@pytest.mark.parametrize("act", ["gelu", "gelu_new", "gelu_pytorch_tanh", "quick_gelu", "gelu_fast", "silu"])
def test_a_geglu_mlp_with_small_gate_weights_is_not_taken_for_swiglu(act):
    """Gate outputs near 0 (small gate weights on the old probe's N(0, 1) input) made gelu(z) ~ silu(z) ~ z/2 within
    bf16's rounding: a GELU-gated MLP (Llama/Gemma-style GeGLU) was patched as SwiGLU. The probe scales its input
    to gate outputs of order 2 and asks which activation the output is closest to."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, hidden_act=act)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        model.model.layers[0].mlp.gate_proj.weight.mul_(0.05)
    (row,) = mlp_rows(pypto_gym.patch_model(model, backend="torch").to_json())
    if act == "silu":
        assert row["status"] == "patched", row
    else:
        assert row["status"] == "skipped" and "not SiLU" in row["reason"], row


class FcMLP(nn.Module):
    """fc1 -> act -> fc2 with biases, as a vision MLP: Qwen3-VL's (tanh GELU) or a ViT's (erf GELU)."""

    def __init__(self, act, h=32, i=96):
        super().__init__()
        self.linear_fc1, self.linear_fc2, self.act_fn = nn.Linear(h, i), nn.Linear(i, h), act

    def forward(self, x):
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


@pytest.mark.parametrize("act,activation", [(nn.GELU(), "gelu"), (nn.GELU(approximate="tanh"), "gelu_tanh")])
def test_a_gelu_mlp_runs_fc1_and_its_gelu_as_one_linear_call(act, activation):
    """The probe names the GELU's form; on torch the site is bit-identical to the module (HF's two roundings), on cpu
    one `linear` call with the GELU in the GEMM's epilogue per forward, within precision; a hook on fc1 runs the
    original forward, counted; on PyPTO the site is skipped, saying why (the NPU's: test_npu_contract.py)."""
    gen = torch.Generator().manual_seed(0)
    model = Stack(FcMLP(act)).to(torch.bfloat16)
    x = torch.randn(2, 7, 32, generator=gen).bfloat16()
    with torch.no_grad():
        want = model.mlp(x)
    for backend in ("torch", "cpu"):
        report = pypto_gym.patch_model(model, backend=backend, strict=True)
        (row,) = [r for r in report.to_json()["sites"] if r["op"] == "linear"]
        assert row["status"] == "patched" and row["kind"] == "text.gelu_mlp" and row["activation"] == activation
        with torch.no_grad():
            got = model.mlp(x)
        if backend == "torch":
            assert torch.equal(got, want)
        else:
            assert_close(got, want, OPS["linear"].outputs)  # judged as a linear output: by its row's scale
        (row,) = [r for r in report.to_json()["sites"] if r["op"] == "linear"]
        assert row["calls"] == 1 and row["ran_on"] == {backend: 1}, row
        pypto_gym.unpatch_model(model)
    handle = model.mlp.linear_fc1.register_forward_hook(lambda *a: None)
    report = pypto_gym.patch_model(model, backend="cpu")
    with torch.no_grad():
        assert torch.equal(model.mlp(x), want)
    (row,) = [r for r in report.to_json()["sites"] if r["op"] == "linear"]
    assert row["fusion_bypassed"] == {"fc1 has hooks": 1}
    pypto_gym.unpatch_model(model)
    handle.remove()
    (row,) = [r for r in pypto_gym.patch_model(model, backend="pypto").to_json()["sites"] if r["op"] == "linear"]
    assert row["status"] == "skipped" and "no linear + GELU for the pypto backend" in row["reason"]
    pypto_gym.unpatch_model(model)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_linear_applies_the_gelu_form_it_is_asked_for(backend):
    """The erf and tanh GELUs differ by ~10 % of the result in the left tail (x in [-4, -2.5]: gelu(-3) is -0.00405
    against -0.00364), where bf16 resolves it though the precision rule of a whole row would not: each backend's
    output is within a bf16 step of its own form and far from the other (the cpu epilogue's form was swapped once,
    unseen by the op's examples)."""
    x = torch.linspace(-4, -2.5, 64).bfloat16().reshape(1, 64)
    eye, zero = torch.eye(64).bfloat16(), torch.zeros(64).bfloat16()
    forms = {"gelu": "none", "gelu_tanh": "tanh"}
    for activation, approximate in forms.items():
        y = ops.linear(x, eye, zero, activation=activation, backend=backend).double()
        own = torch.nn.functional.gelu(x.double(), approximate=approximate)
        other = torch.nn.functional.gelu(x.double(), approximate=forms[next(a for a in forms if a != activation)])
        assert float(((y - own).abs() / own.abs()).max()) < 2 ** -7, activation
        assert float(((y - other).abs() / other.abs()).max()) > 0.05, activation


class MergerMLP(nn.Module):
    """A patch merger (Qwen3-VL's): LayerNorm over each patch (or, post-shuffle, over 4 patches as one row), 4
    patches regrouped into one row, fc1 -> GELU -> fc2. `inline`: F.gelu in the forward, no activation module."""

    def __init__(self, post=False, inline=False, h=16, out=24):
        super().__init__()
        self.h4, self.post, self.inline = 4 * h, post, inline
        self.norm = nn.LayerNorm(self.h4 if post else h, eps=1e-6)
        self.linear_fc1, self.linear_fc2 = nn.Linear(self.h4, self.h4), nn.Linear(self.h4, out)
        if not inline:
            self.act_fn = nn.GELU()

    def forward(self, x):
        x = self.norm(x.view(-1, self.h4) if self.post else x).view(-1, self.h4)
        h = self.linear_fc1(x)
        return self.linear_fc2(nn.functional.gelu(h) if self.inline else self.act_fn(h))


class ScaledMerger(MergerMLP):
    """A merger whose fc1 reads twice the norm's rows: not the math the site computes."""

    def forward(self, x):
        return self.linear_fc2(self.act_fn(self.linear_fc1(self.norm(x).view(-1, self.h4) * 2)))


@pytest.mark.parametrize("post", [False, True], ids=["norm before the regrouping", "after"])
def test_a_patch_mergers_mlp_runs_its_norm_then_fc1_and_its_gelu_as_one_linear_call(post):
    """A merger's norm, its regrouping of 4 patches into one row and its fc1 -> GELU -> fc2: the site runs the norm as
    a module, then one `linear` call with the GELU (erf, named by its activation module) on fc1: bit-identical on
    torch, within precision on cpu. Its fc1 reads the regrouped rows: a probe that skipped the regrouping would not
    match the module, and the site would be skipped."""
    gen = torch.Generator().manual_seed(0)
    merger = MergerMLP(post).to(torch.bfloat16)
    x = torch.randn(12, 16, generator=gen).bfloat16()
    with torch.no_grad():
        want = merger(x)
    model = Stack(merger)
    for backend in ("torch", "cpu"):
        report = pypto_gym.patch_model(model, backend=backend, strict=True)
        with torch.no_grad():
            got = merger(x)
        (row,) = [r for r in report.to_json()["sites"] if r["op"] == "linear"]
        assert (row["status"], row["activation"], row["norm_first"], row["calls"]) == ("patched", "gelu", True, 1)
        if backend == "torch":
            assert torch.equal(got, want)
        else:
            assert_close(got, want, OPS["linear"].outputs)
        pypto_gym.unpatch_model(model)


def test_a_merger_whose_gelu_form_the_probe_cannot_tell_is_skipped_with_the_reason():
    """With no activation module to ask, the form is read off the whole forward; fc1's output kept near 0 (where the
    erf and tanh GELUs agree in bf16) matches both: skipped, not guessed. A forward of other math: skipped too."""
    merger = MergerMLP(inline=True).to(torch.bfloat16)
    with torch.no_grad():
        merger.linear_fc1.weight.mul_(1e-3)
        merger.linear_fc1.bias.zero_()
    (row,) = [r for r in pypto_gym.patch_model(Stack(merger), backend="cpu").to_json()["sites"] if r["op"] == "linear"]
    assert row["status"] == "skipped" and "both GELU forms'" in row["reason"], row
    other = ScaledMerger().to(torch.bfloat16)
    (row,) = [r for r in pypto_gym.patch_model(Stack(other), backend="cpu").to_json()["sites"] if r["op"] == "linear"]
    assert row["status"] == "skipped" and "output is not fc2(gelu(fc1(norm(x) regrouped)))" in row["reason"], row


# ---- gelu_dynamic_quant / gelu_quant: a GELU MLP's middle in W8A8 ---------------------------------------------------
def _gelu64(x, approximate):
    """GELU in fp64 from its formula (math.erf, math.tanh), independent of torch's kernel."""
    if approximate == "tanh":
        f = lambda v: 0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3)))  # noqa: E731
    else:
        f = lambda v: 0.5 * v * (1 + math.erf(v / math.sqrt(2)))  # noqa: E731
    return torch.tensor([[f(float(v)) for v in row] for row in x.double()], dtype=torch.float64)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_quant_ops_hand_worked_example(approximate):
    """One fp32 row [0, 1, -1, 2]: GELU = [0, 0.8413, -0.1587, 1.9545] (erf) or [0, 0.8412, -0.1588, 1.9546] (tanh);
    dynamic: scale = 1.9545 / 127, codes [0, 55, -10, 127]; static under scale 0.02 and offset -3: rint(a / 0.02 - 3)
    = [-3, 39, -11, 95]."""
    x = torch.tensor([[0.0, 1.0, -1.0, 2.0]])
    a = _gelu64(x, approximate)
    y, scale = ops.gelu_dynamic_quant(x, approximate=approximate, backend="torch")
    assert float(scale[0]) == pytest.approx(float(a[0, 3]) / 127, rel=1e-6)
    assert y.tolist() == torch.round(a / (a[0, 3] / 127)).tolist() == [[0, 55, -10, 127]]
    q = ops.gelu_quant(x, torch.tensor([0.02]), torch.tensor([-3.0]), approximate=approximate, backend="torch")
    assert q.tolist() == torch.round(a / 0.02 - 3).tolist() == [[-3, 39, -11, 95]]


@pytest.mark.parametrize("approximate,act", [("none", nn.GELU()), ("tanh", nn.GELU(approximate="tanh"))])
def test_gelu_quant_ops_quantise_exactly_the_tensor_the_modules_fc2_reads(approximate, act):
    """The codes are those of the module's own activation (one rounding to bf16), smoothed, bit for bit with
    dynamic_quant / static_quant of it; against fp64 from that activation at most one code apart (the fp32 division),
    and the activation itself is the fp64 GELU within bf16's rounding."""
    torch.manual_seed(5)
    x, smooth = (torch.randn(3, 7, 512) * 3).bfloat16(), torch.rand(512) + 0.5
    with torch.no_grad():
        a = act(x)
    assert torch.allclose(a.double(), _gelu64(x.reshape(-1, 512), approximate).reshape(a.shape), rtol=2 ** -8,
                          atol=1e-6)
    y, scale = ops.gelu_dynamic_quant(x, smooth, approximate=approximate, backend="torch")
    want = ops.dynamic_quant(a, smooth, backend="torch")
    assert torch.equal(y, want[0]) and torch.equal(scale, want[1])
    n = a.double() * smooth.double()
    codes = torch.round(n / (n.abs().amax(-1, keepdim=True) / 127))
    assert int((y.double() - codes).abs().max()) <= 1 and float((y.double() != codes).double().mean()) < 1e-3
    s, o = torch.tensor([0.05]), torch.tensor([4.0])
    assert torch.equal(ops.gelu_quant(x, s, o, smooth, approximate=approximate, backend="torch"),
                       ops.static_quant(a, s, o, smooth, backend="torch"))
