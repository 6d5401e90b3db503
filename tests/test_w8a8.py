"""W8A8: the int8 GEMM op, int8 linears fed by the fused norm + quant ops, calibration, unpatching.

Goldens are independent of the code under test: integer products in int64, scales and rounding
in float64. Accuracy figures and speed live in `bench w8a8` / `bench e2e --quant w8a8`; the
accuracy assertion here is a coarse guard (cosine >= 0.99 on the embedded checkpoint).
"""
import copy
import math

import pytest
import torch

import pypto_gym
from pypto_gym import ops, patch_model, unpatch_model
from pypto_gym.capture import ShapeRecorder
from pypto_gym.capture.cases import load_cases
from pypto_gym.capture.runner import run_file
from pypto_gym.cli import main as cli_main
from pypto_gym.inference import generate, open_image
from pypto_gym.models.qwen2_5_vl import DOCUMENT_IMAGE, SAMPLE_IMAGE
from pypto_gym.ops import OPS, registry
from pypto_gym.kernels.cpu import quant_matmul
from support import run_on
from pypto_gym.ops.quantize import quantize_rows
from pypto_gym.patching import PatchError
from pypto_gym.quant import activations, calibration
from pypto_gym.quant.topology import own_input_linears
import pypto_gym.quant.linear as quant_linear


CALIBRATE = ["calibrate", "--dtype", "bfloat16", "--max-new-tokens", "2", "--prompt", "Read the text."]


def int8(shape, gen):
    return torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)


def golden_matmul(x_q, w_q, x_scale, w_scale, bias):
    """float64 from the exact int64 product."""
    acc = x_q.reshape(-1, x_q.shape[-1]).long() @ w_q.long().T
    y = acc.double() * x_scale.reshape(-1, 1).double() * w_scale.double()
    if bias is not None:
        y = y + bias.detach().double()
    return acc, y.reshape(*x_q.shape[:-1], w_q.shape[0])


# ---- the op ------------------------------------------------------------------------------------
def test_reference_integer_product_is_exact_past_fp32_range():
    gen = torch.Generator().manual_seed(0)
    x_q, w_q = int8((3, 16384), gen), int8((5, 16384), gen)
    x_q[0], w_q[0] = 127, torch.randint(100, 128, (16384,), generator=gen, dtype=torch.int8)  # sums near 2**28
    ones_m, ones_n = torch.ones(3), torch.ones(5)
    acc, _ = golden_matmul(x_q, w_q, ones_m, ones_n, None)
    assert int(acc[0, 0]) > 2 ** 27  # past what an fp32 accumulator holds exactly (2**24): a plain fp32 matmul may
    # or may not lose bits here (it did on AMD Zen 5, not on an AMX Xeon's MKL); the golden must not
    y = OPS["quant_matmul"].golden(x_q, w_q, ones_m, ones_n, None, torch.float32)
    assert torch.equal(y, acc.float())  # exactly the int32 result, rounded once to fp32


@pytest.mark.parametrize("bias", [False, True])
def test_reference_scales_follow_the_formula(bias):
    gen = torch.Generator().manual_seed(1)
    x_q, w_q = int8((2, 7, 300), gen), int8((24, 300), gen)
    x_scale, w_scale = torch.rand(2, 7, generator=gen) + 0.01, torch.rand(24, generator=gen) * 1e-3
    b = torch.randn(24, generator=gen) if bias else None
    _, gold = golden_matmul(x_q, w_q, x_scale, w_scale, b)
    y = OPS["quant_matmul"].golden(x_q, w_q, x_scale, w_scale, b, torch.float32)
    assert y.shape == (2, 7, 24)
    assert float(((y.double() - gold).abs() / gold.abs().clamp(min=1e-3)).max()) < 1e-5


@pytest.mark.parametrize("M,K,N", [(1, 2048, 64), (3, 3000, 40), (17, 16, 8), (64, 1280, 96)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_cpu_quant_matmul_is_bit_identical_to_reference(M, K, N, out_dtype):
    gen = torch.Generator().manual_seed(M * K + N)
    x_q, w_q = int8((M, K), gen), int8((N, K), gen)
    x_scale, w_scale = torch.rand(M, generator=gen) + 0.01, torch.rand(N, generator=gen) * 1e-3
    for bias in (None, torch.randn(N, generator=gen).to(out_dtype)):
        stats = ops.Stats()
        y = ops.quant_matmul(x_q, w_q, x_scale, w_scale, bias, out_dtype=out_dtype, backend="cpu", stats=stats)
        assert stats.ran == {"cpu": 1}
        assert torch.equal(y, OPS["quant_matmul"].golden(x_q, w_q, x_scale, w_scale, bias, out_dtype))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("grad", ["bias", "x_scale", "w_scale"])
def test_quant_matmul_output_never_requires_grad(backend, grad):
    gen = torch.Generator().manual_seed(3)
    x_q, w_q = int8((3, 32), gen), int8((8, 32), gen)
    args = {"x_scale": torch.rand(3, generator=gen), "w_scale": torch.rand(8, generator=gen),
            "bias": torch.nn.Parameter(torch.randn(8, generator=gen), requires_grad=grad == "bias")}
    args[grad].requires_grad_(True)
    y = ops.quant_matmul(x_q, w_q, args["x_scale"], args["w_scale"], args["bias"], out_dtype=torch.float32,
                         backend=backend)
    assert not y.requires_grad  # so backward() says so, instead of leaving bias.grad None silently
    with pytest.raises(RuntimeError, match="does not require grad"):
        y.sum().backward()


def test_biased_qkv_linears_in_w8a8_do_not_pretend_to_train(tiny_loaded, sample_inputs):
    """Qwen2.5-VL's q/k/v have biases (Parameters that require grad): their int8 outputs must not require grad."""
    model = copy.deepcopy(tiny_loaded[0]).float()
    patch_model(model, backend="cpu", quant="w8a8")
    attn = model.model.language_model.layers[0].self_attn
    assert attn.q_proj.bias.requires_grad
    seen = []
    attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(o.requires_grad))
    model(**sample_inputs)  # grad enabled
    assert seen == [False]


def test_quant_matmul_compiles_to_one_op():
    gen = torch.Generator().manual_seed(2)
    x_q, w_q = int8((4, 64), gen), int8((16, 64), gen)
    xs, ws = torch.rand(4, generator=gen), torch.rand(16, generator=gen)
    fn = torch.compile(lambda a, b, c, d: ops.quant_matmul(a, b, c, d, out_dtype=torch.float32, backend="cpu"),
                       fullgraph=True)
    assert torch.equal(fn(x_q, w_q, xs, ws), OPS["quant_matmul"].golden(x_q, w_q, xs, ws, None, torch.float32))


@pytest.mark.parametrize("change,match", [
    (dict(x_q=torch.zeros(2, 8)), "x_q: dtype float32"),
    (dict(w_q=torch.zeros(4, 9, dtype=torch.int8)), r"w_q: shape \(4, 9\)"),
    (dict(x_scale=torch.ones(3)), r"x_scale: shape \(3,\)"),
    (dict(w_scale=torch.ones(4, dtype=torch.float16)), "w_scale: dtype float16"),
    (dict(bias=torch.ones(5)), r"bias: shape \(5,\) does not match w_q; expected \(4,\)"),
    (dict(out_dtype=torch.int8), "out_dtype"),
])
def test_quant_matmul_refusals_name_the_argument(change, match):
    args = dict(x_q=torch.zeros(2, 8, dtype=torch.int8), w_q=torch.zeros(4, 8, dtype=torch.int8),
                x_scale=torch.ones(2), w_scale=torch.ones(4), bias=None, out_dtype=torch.bfloat16)
    args.update(change)
    out_dtype = args.pop("out_dtype")
    with pytest.raises((TypeError, ValueError), match=match):
        ops.quant_matmul(*args.values(), out_dtype=out_dtype, backend="cpu")


# ---- int8 linears in a model -------------------------------------------------------------------
@pytest.fixture(scope="module")
def calib_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "tiny.safetensors"
    assert cli_main(CALIBRATE + ["--out", str(path)]) == 0
    return path


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits.float()


def _check_rows_quantised(q, scale, x, what):
    """q/scale are a per-row symmetric int8 quantisation of x (float64 check)."""
    xd = x.double().reshape(-1, x.shape[-1])
    sd = scale.double().reshape(-1)
    want = xd.abs().amax(-1) / 127
    assert float(((sd - want).abs() / want.clamp(min=1e-30)).max()) < 1e-5, f"{what}: scales"
    zero = want == 0  # an all-zero row (e.g. the pad token's embedding): scale 0, codes 0
    assert not q.reshape(xd.shape)[zero].any(), f"{what}: codes of a zero row"
    err = (q.reshape(xd.shape).double() - xd / sd.unsqueeze(-1))[~zero].abs()
    assert float(err.max()) <= 0.5 + 1e-3, f"{what}: codes are not the rounded rows"


@pytest.mark.parametrize("smoothed", [False, True], ids=["no smoothing", "smoothed"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_every_int8_linear_does_the_int8_math(tiny_loaded, sample_inputs, calib_file, monkeypatch, smoothed,
                                              backend):
    model = copy.deepcopy(tiny_loaded[0]).float()  # fp32 outputs: the 1e-5 check is not hidden by a bf16 cast
    report = patch_model(model, backend=backend, quant="w8a8", calibration=calib_file if smoothed else None,
                         int8_lm_head=True)
    seen = {}
    real = quant_linear.ops.quant_matmul

    def spy(x_q, w_q, x_scale, w_scale, bias, *, out_dtype, backend, stats):
        y = real(x_q, w_q, x_scale, w_scale, bias, out_dtype=out_dtype, backend=backend, stats=stats)
        seen.setdefault(id(w_q), (x_q, x_scale, bias, y))
        return y

    monkeypatch.setattr(quant_linear.ops, "quant_matmul", spy)
    inputs_seen = {}
    qls = report._state.quant.linears
    handles = [ql.module.register_forward_pre_hook(lambda m, a, ql=ql: inputs_seen.setdefault(ql.path, a[0]))
               for ql in qls]
    _logits(model, sample_inputs)
    for h in handles:
        h.remove()
    assert len(qls) == 51  # every linear: 32 fed by the norms, 8 down_proj by the MLPs, 11 by themselves (lm_head)
    for ql in qls:
        x_q, x_scale, bias, y = seen[id(ql.w_q)]
        x = inputs_seen[ql.path].float()
        inv = torch.ones(x.shape[-1]) if ql.inv_smooth is None else ql.inv_smooth
        unsmoothed = ql.path.endswith("merger.mlp.2") or ql.path == "lm_head"  # after GELU; one row at decode
        assert (ql.inv_smooth is not None) == (smoothed and not unsmoothed)
        _check_rows_quantised(x_q, x_scale, x * inv, f"{ql.path} activations")
        w = ql.module.weight.detach().double()
        s = torch.ones(w.shape[1]) if ql.inv_smooth is None else 1 / ql.inv_smooth.float()
        _check_rows_quantised(ql.w_q, ql.w_scale, w * s.double(), f"{ql.path} weights")
        _, gold = golden_matmul(x_q, ql.w_q, x_scale, ql.w_scale, bias)
        rel = (y.detach().double() - gold).abs() / gold.abs().clamp(min=1e-3)
        assert float(rel.max()) < 1e-5, ql.path


def test_norm_fed_linears_take_the_norms_int8_rows_in_generate(tiny_loaded):
    model = copy.deepcopy(tiny_loaded[0])
    report = patch_model(model, backend="cpu", quant="w8a8", int8_lm_head=True)
    processor = tiny_loaded[1]
    generate(model, processor, ["Read the text in the image."], [open_image(SAMPLE_IMAGE)], 4)  # inference_mode
    rows = {r["path"]: r for r in report.to_json()["w8a8"]["linears"] if r["became"] == "w8a8"}
    assert rows["lm_head"]["quantized_here"] == rows["lm_head"]["calls"] == 4  # the last position's row only
    assert rows["lm_head"]["input"].startswith("quantised per row here")
    for path, r in rows.items():
        if r["input"].startswith("quantised per row here"):  # o_proj, attn.proj, the merger's (4 rows regrouped)
            assert r["quantized_here"] == r["calls"] >= 1 and r["handed_over"] == 0, path
        else:
            assert r["handed_over"] == r["calls"] >= 1 and r["quantized_here"] == 0, path
    summary = report.to_json()["summary"]
    assert summary["fallbacks"] == {} and set(summary["ran_on"]) == {"cpu"}


def test_rotary_and_mlp_sites_run_their_ops_in_w8a8(tiny_loaded, sample_inputs):
    """In W8A8 the attention's q/k come from int8 linears fed by a norm's int8 rows: the rotary rewrite's
    first-call check must still run (it copies the layer's inputs) and accept, and every MLP keep its op."""
    model = copy.deepcopy(tiny_loaded[0])
    report = patch_model(model, backend="cpu", quant="w8a8")
    _logits(model, sample_inputs)
    rows = [r for r in report.to_json()["sites"] if r["kind"].endswith(("rope", "mlp"))]
    assert {r["kind"] for r in rows} == {"text.rope", "vision.rope", "text.mlp", "vision.mlp"}
    for r in rows:
        assert r["status"] == "patched" and r["calls"] > 0 and not r["fallbacks"], r
        assert (r.get("rotary") or {}).get("rejected") is None, r


def test_weight_bytes_count_a_tied_lm_head_as_kept(tiny_loaded):
    model = copy.deepcopy(tiny_loaded[0])
    assert model.lm_head.weight is model.get_input_embeddings().weight  # the embedded checkpoint ties them
    q = patch_model(model, backend="cpu", quant="w8a8", int8_lm_head=True).to_json()["w8a8"]
    rows = {r["path"]: r for r in q["linears"] if r["became"] == "w8a8"}
    assert rows["lm_head"]["float_weight_shared"] and not any(r["float_weight_shared"] for p, r in rows.items()
                                                              if p != "lm_head")
    assert q["summary"]["releasable_float_bytes"] == sum(r["float_weight_bytes"] for p, r in rows.items()
                                                         if p != "lm_head")
    assert rows["lm_head"]["int8_weight_bytes"] == model.lm_head.weight.numel() + 4 * model.lm_head.out_features


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_handover_covers_whole_row_views_only(mode):
    owner, other = object(), object()
    x = torch.randn(2, 5, 8)
    q, scale = quantize_rows(x, "int8")
    with getattr(torch, mode)():
        y = activations.issue(q, scale, None, torch.float32, owner)
        assert y.handed_over(other) is None
        got_q, got_s = y[:, -1:, :].handed_over(owner)  # lm_head's slice of the last position
        assert torch.equal(got_q, q[:, -1:, :]) and torch.equal(got_s, scale[:, -1:])
        got_q, got_s = y[1].handed_over(owner)
        assert torch.equal(got_q, q[1]) and torch.equal(got_s, scale[1])
        got_q, got_s = y[:, -2].handed_over(owner)
        assert torch.equal(got_q, q[:, -2]) and torch.equal(got_s, scale[:, -2])
        assert y.handed_over(owner)[0] is not None
        part = y[..., :4]  # part of each row: not the same rows, so the float values are computed
        assert type(part) is torch.Tensor and y.handed_over(owner) is None
        assert torch.equal(part, (q.float() * scale.unsqueeze(-1))[..., :4])


EDITS = {  # every way of changing a norm's output in place: each must be seen by the int8 linears after it
    "mul_": lambda y: y.mul_(0.25),
    "setitem": lambda y: y.__setitem__((..., slice(0, 4)), 0),
    "data mul_": lambda y: y.data.mul_(0.25),
    "data setitem": lambda y: y.data.__setitem__((..., slice(0, 4)), 0),
    "a row view written": lambda y: y[1].zero_(),
    "copy_": lambda y: y.copy_(torch.zeros(2, 5, 8)),
}


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("edit", list(EDITS))
def test_an_in_place_edit_of_handed_over_rows_is_never_missed(mode, edit):
    x = torch.randn(2, 5, 8)
    q, scale = quantize_rows(x, "int8")
    dequantised = q.float() * scale.unsqueeze(-1)
    with getattr(torch, mode)():
        y = activations.issue(q, scale, None, torch.float32, "norm")
        last = y[:, -1:, :]  # a view taken before the edit (as lm_head's slice would be)
        EDITS[edit](y)
        assert y.handed_over("norm") is None and last.handed_over("norm") is None
        expected = dequantised.clone()
        EDITS[edit](expected)
        assert torch.equal(y.value(), expected) and torch.equal(last.value(), expected[:, -1:, :])


def test_fused_layers_run_the_fused_add_quant_op(tiny_loaded, sample_inputs, monkeypatch):
    fused = copy.deepcopy(tiny_loaded[0])
    unfused = copy.deepcopy(tiny_loaded[0])
    report = patch_model(fused, backend="cpu", quant="w8a8")
    patch_model(unfused, backend="cpu", quant="w8a8", fuse_residual=False)
    _logits(fused, sample_inputs)  # the first call of a rewritten class is checked against the original
    calls = []
    real = ops.add_rms_norm_dynamic_quant
    monkeypatch.setattr(ops, "add_rms_norm_dynamic_quant", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = _logits(fused, sample_inputs)
    assert len(calls) == report.to_json()["summary"]["fused_layers"] == 8
    assert torch.equal(got, _logits(unfused, sample_inputs))  # the add inside the op is the same bf16 add


def test_w8a8_logits_close_to_bf16_on_the_embedded_checkpoint(tiny_loaded, sample_inputs, calib_file):
    model = copy.deepcopy(tiny_loaded[0])
    ref = _logits(model, sample_inputs)
    for calib in (None, calib_file):
        with pypto_gym.patched(model, backend="cpu", quant="w8a8", calibration=calib):
            got = _logits(model, sample_inputs)
        cos = torch.nn.functional.cosine_similarity(ref.flatten(1), got.flatten(1)).min()
        assert float(cos) >= 0.99, calib


def test_unpatch_restores_the_float_model_bit_exactly(tiny_loaded, sample_inputs, calib_file):
    model = copy.deepcopy(tiny_loaded[0])
    before = _logits(model, sample_inputs)
    params = {k: v.clone() for k, v in model.state_dict().items()}
    patch_model(model, backend="cpu", quant="w8a8", calibration=calib_file)
    assert not torch.equal(_logits(model, sample_inputs), before)
    with pypto_gym.config.scoped(enabled=False):  # the switch: the float path, without unpatching
        assert torch.equal(_logits(model, sample_inputs), before)
    unpatch_model(model)
    assert torch.equal(_logits(model, sample_inputs), before)
    assert all(torch.equal(v, params[k]) for k, v in model.state_dict().items())
    assert not any("_pypto_gym" in k for m in model.modules() for k in m.__dict__)


def test_patch_options_are_checked(tiny_loaded, calib_file):
    model = copy.deepcopy(tiny_loaded[0])
    with pytest.raises(ValueError, match="calibration: given without quant"):
        patch_model(model, calibration=calib_file)
    with pytest.raises(ValueError, match="quant: got 'w4a4'"):
        patch_model(model, quant="w4a4")
    patch_model(model, backend="cpu", quant="w8a8")
    with pytest.raises(PatchError, match="quant='w8a8'"):
        patch_model(model, backend="cpu")



@pytest.mark.parametrize("scheme", ["dynamic", "static"])
def test_quantize_is_the_w8a8_pass_over_a_patched_model(tiny_loaded, sample_inputs, calib_file, scheme):
    """quantize(model, W8A8(...)) on a patched model keeps that patch's options, adds the same int8 linears and
    numbers as patch_model(quant=...), and unpatch restores the float model; bad configs are refused first."""
    from pypto_gym.patching.api import patch_options
    from pypto_gym.quant import W8A8, quantize

    model, twin = copy.deepcopy(tiny_loaded[0]), copy.deepcopy(tiny_loaded[0])
    before = _logits(model, sample_inputs)
    patch_model(model, backend="cpu", sites="text.*", fuse_residual=False)
    report = quantize(model, W8A8(scheme, calibration=calib_file)).to_json()
    kept = patch_options(model)
    assert (kept.backend, kept.sites, kept.fuse_residual) == ("cpu", ("text.*",), False)
    assert {r["kind"].split(".")[0] for r in report["sites"] if r["status"] == "patched"} == {"text"}
    assert report["quant"] == report["w8a8"]["mode"] == W8A8(scheme).mode and report["w8a8"]["summary"]["int8"] > 0
    patch_model(twin, backend="cpu", sites="text.*", fuse_residual=False, quant=W8A8(scheme).mode,
                calibration=calib_file)
    assert torch.equal(_logits(model, sample_inputs), _logits(twin, sample_inputs))
    with pytest.raises(ValueError, match="already quantised"):
        quantize(model, W8A8(scheme))
    unpatch_model(model)
    assert torch.equal(_logits(model, sample_inputs), before)
    with pytest.raises(ValueError, match="scheme: got 'w4a4'"):
        W8A8("w4a4")
    with pytest.raises(TypeError, match="config: got str"):
        quantize(model, "w8a8")
    with pytest.raises(TypeError, match="model: got int; expected a torch.nn.Module"):
        quantize(5, W8A8(scheme))
    patch_model(model, backend="cpu")
    with pytest.raises(ValueError, match="float_linears"):  # refused before the float patch is taken off
        quantize(model, W8A8(scheme, float_linears="!text.o_proj"))
    assert pypto_gym.patch_report(model).to_json()["quant"] is None


# ---- calibration -------------------------------------------------------------------------------
def test_calibration_is_deterministic_and_follows_the_smoothquant_formula(tiny_loaded, calib_file, tmp_path):
    again = tmp_path / "again.safetensors"
    assert cli_main(CALIBRATE + ["--out", str(again)]) == 0
    assert again.read_bytes() == calib_file.read_bytes()
    model = tiny_loaded[0]
    expected = {p: m.weight.shape[0] for p, m in model.named_modules() if p.endswith(("norm", "norm1", "norm2",
                                                                                       "layernorm"))}
    del expected["model.language_model.norm"]  # the final norm hands no rows over: no linear to smooth for
    mlps = {p: m.down_proj.in_features for p, m in model.named_modules() if hasattr(m, "down_proj")}
    own = {p: m.in_features for p, m in own_input_linears(model) if not p.endswith("merger.mlp.2")}
    assert len(mlps) == 8 and len(own) == 9  # 4 o_proj, 4 vision attn.proj, the merger's mlp.0 (mlp.2: after GELU)
    after_gelu = {p: m.in_features for p, m in own_input_linears(model) if p.endswith("merger.mlp.2")}
    scales, _, ranges = calibration.load(calib_file, {**expected, **mlps, **own}, unsmoothed=after_gelu)
    # the formula, from the absmax a recorder collects on the same run
    with calibration.Calibrator(model) as rec:  # the CLI's default images
        for image in (SAMPLE_IMAGE, DOCUMENT_IMAGE):
            generate(model, tiny_loaded[1], ["Read the text."], [open_image(image)], 2)
    path = "model.language_model.layers.1.input_layernorm"
    attn = model.get_submodule("model.language_model.layers.1.self_attn")
    wmax = torch.stack([getattr(attn, n).weight.detach().abs().amax(0).float() for n in ("q_proj", "k_proj", "v_proj")]).amax(0)
    want = rec.absmax[path].double().sqrt() / wmax.double().sqrt()
    assert float(((scales[path].double() - want).abs() / want).max()) < 1e-5
    # the static scheme's ranges: every source's per-channel min and max, as the recorder saw them, and the range
    # of the linear whose input is not smoothed (mlp.2 reads GELU's output)
    assert set(ranges) == set(scales) | set(after_gelu) and len(after_gelu) == 1
    assert torch.equal(ranges[path][0], rec.amin[path]) and torch.equal(ranges[path][1], rec.amax[path])
    assert bool((rec.amin[path] < 0).any()) and torch.equal(rec.absmax[path],
                                                             torch.maximum(-rec.amin[path], rec.amax[path]))
    other = calibration.smooth_scales(model, rec.absmax, 0.8)[path]
    want = rec.absmax[path].double() ** 0.8 / wmax.double() ** 0.2
    assert float(((other.double() - want).abs() / want).max()) < 1e-5
    # ln_q's linear reads its rows regrouped: that linear (merger.mlp.0) has its own scale
    assert set(scales) == set(expected) - {"model.visual.merger.ln_q"} | set(mlps) | set(own)
    # an MLP's: from the max |down_proj input| (silu(gate) * up) and down_proj's weight columns
    path = "model.language_model.layers.1.mlp"
    wmax = model.get_submodule(path).down_proj.weight.detach().abs().amax(0).float()
    want = rec.absmax[path].double().sqrt() / wmax.double().sqrt()
    assert float(((scales[path].double() - want).abs() / want).max()) < 1e-5
    # o_proj's: one scale per kv head's channel (it folds into v_proj's rows), from the max over its query heads
    path = "model.language_model.layers.1.self_attn.o_proj"
    d, kv = attn.head_dim, attn.config.num_key_value_heads
    a = rec.absmax[path].double().reshape(kv, -1, d).amax(1)
    w = attn.o_proj.weight.detach().abs().amax(0).double().reshape(kv, -1, d).amax(1)
    want = (a.sqrt() / w.sqrt()).unsqueeze(1).expand(kv, attn.o_proj.in_features // d // kv, d).flatten()
    assert float(((scales[path].double() - want).abs() / want).max()) < 1e-5
    path = "model.language_model.layers.1.mlp"
    mlp = model.get_submodule(path)
    with torch.no_grad():
        x = torch.randn(3, mlp.gate_proj.in_features).to(mlp.gate_proj.weight.dtype)
        act = (mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)).abs().amax(0).float()
    with calibration.Calibrator(model) as probe:
        with torch.no_grad():
            mlp(x)
    assert torch.equal(probe.absmax[path], act)  # what the hook records is down_proj's input


@pytest.mark.parametrize("damage,match", [
    ("nan", r"tensor 'model.language_model.layers.1.input_layernorm.smooth_scale' has 1 values that are not finite and positive"),
    ("zero", r"'model.language_model.layers.1.input_layernorm.smooth_scale' has 1 values that are not finite and positive"),
    ("wrong_d", r"tensor 'model.language_model.layers.1.input_layernorm.smooth_scale' is float32 \[64\]; expected float32 \[128\]"),
    ("extra", r"tensor 'model.other.norm.smooth_scale' names no norm, MLP or linear this model quantises"),
    ("missing", r"no tensor 'model.language_model.layers.1.input_layernorm.smooth_scale' for "
                r"model.language_model.layers.1.input_layernorm \(1 of 33 smooth scales missing"),
    ("fp16", r"'model.language_model.layers.1.input_layernorm.smooth_scale' is float16 \[128\]"),
    ("not_safetensors", "not a safetensors file"),
    ("format", "metadata format None"),
    ("format 2", r"metadata format 'pypto_gym-smoothquant-2'; .*\(format 2 gave scales a checkpoint cannot hold "
                 r"\(o_proj per query head, the merger's mlp.2\): run scripts/calibrate.py again\)"),
    ("tiny 1e-40", r"'model.language_model.layers.1.input_layernorm.smooth_scale' channel 3: smooth scale 1e-40 has no normal float32 "
                   r"reciprocal"),
    ("tiny 1.4e-45", r"'model.language_model.layers.1.input_layernorm.smooth_scale' channel 3: smooth scale 1.4e-45 has no normal"),
    ("huge 3.4e38", r"'model.language_model.layers.1.input_layernorm.smooth_scale' channel 3: smooth scale 3.4e\+38 has no normal "
                    r"float32 reciprocal"),
    ("one channel 1e-10", r"'model.language_model.layers.1.input_layernorm.smooth_scale' channel 3: smooth scale 1e-10 makes its max/min "
                          r".* above the bound of 100000"),
    ("one channel 1e10", r"channel 3: smooth scale 1e\+10 makes its max/min"),
    ("model_type", r"metadata model_type 'llama'; this model is 'qwen2_5_vl'"),
    ("alpha", r"metadata alpha 7; expected a number in \[0, 1\]"),
    ("huge metadata", r"metadata entry 'pypto_gym' is 100,\d{3} bytes; expected at most 65,536"),
])
def test_bad_calibration_files_are_refused_naming_the_tensor(tiny_loaded, calib_file, tmp_path, damage, match):
    from safetensors.torch import load_file, save_file

    tensors = load_file(calib_file)
    key = "model.language_model.layers.1.input_layernorm.smooth_scale"
    info = {"format": calibration.FORMAT, "alpha": 0.5, "model_type": "qwen2_5_vl"}
    extreme = {"tiny 1e-40": 1e-40, "tiny 1.4e-45": 1.4e-45, "huge 3.4e38": 3.4e38, "one channel 1e-10": 1e-10,
               "one channel 1e10": 1e10}
    if damage == "nan":
        tensors[key][3] = math.nan
    elif damage == "zero":
        tensors[key][5] = 0.0
    elif damage == "wrong_d":
        tensors[key] = tensors[key][:64].clone()
    elif damage == "extra":
        tensors["model.other.norm.smooth_scale"] = torch.ones(128)
    elif damage == "missing":
        del tensors[key]
    elif damage == "fp16":
        tensors[key] = tensors[key].half()
    elif damage in extreme:
        tensors[key][3] = extreme[damage]
    elif damage == "model_type":
        info["model_type"] = "llama"
    elif damage == "alpha":
        info["alpha"] = 7
    elif damage == "huge metadata":
        info["inputs"] = ["x" * 1000] * 100
    elif damage == "format 2":
        info["format"] = "pypto_gym-smoothquant-2"
    import json

    meta = {calibration.META_KEY: json.dumps(info)}
    if damage == "format":
        meta = {"something": "else"}
    bad = tmp_path / "bad.safetensors"
    if damage == "not_safetensors":
        bad.write_text("this is not a calibration file")
    else:
        save_file(tensors, bad, metadata=meta)
    model = copy.deepcopy(tiny_loaded[0])
    with pytest.raises(ValueError, match=match):
        patch_model(model, backend="cpu", quant="w8a8", calibration=bad)
    assert not any("_pypto_gym" in k for m in model.modules() for k in m.__dict__)  # nothing left half-patched


def test_missing_calibration_file_is_a_one_line_cli_error(tmp_path, capsys):
    assert cli_main(["infer", "--use_pto", "--quant", "w8a8", "--calibration", str(tmp_path / "none.st")]) == 2
    assert "--calibration: no file at" in capsys.readouterr().err
    assert cli_main(["infer", "--quant", "w8a8"]) == 2
    assert "--quant: needs patching on" in capsys.readouterr().err


# ---- capture -----------------------------------------------------------------------------------
def test_capture_in_w8a8_mode_records_quant_cases_that_pass_on_cpu(tiny_loaded, calib_file, tmp_path):
    model = copy.deepcopy(tiny_loaded[0])
    patch_model(model, backend="cpu", quant="w8a8", calibration=calib_file, int8_lm_head=True)
    with ShapeRecorder(model) as rec:
        generate(model, tiny_loaded[1], ["Read the text in the image."], [open_image(SAMPLE_IMAGE)], 2)
    out = tmp_path / "w8a8.json"
    rec.save(out, model_name="tiny w8a8")
    cases = load_cases(out)
    ops_seen = {c["op"] for c in cases}
    # rms_norm: the merger's ln_q (its linear reads regrouped rows); quant_matmul: every int8 linear's real shapes
    assert {"rms_norm", "rms_norm_dynamic_quant", "add_rms_norm_dynamic_quant", "dequant_swiglu_quant",
            "dynamic_quant", "quant_matmul", "int32_gemm"} <= ops_seen
    matmuls = [c for c in cases if c["op"] == "quant_matmul"]
    assert {tuple(c["args"][1].shape) for c in matmuls} >= {(128, 128), (640, 128)}  # q_proj's and lm_head's weights
    assert {"text.q_proj", "text.lm_head", "vision.qkv", "vision.mlp.0"} <= {s for c in matmuls for s in c["sites"]}
    quant = [c for c in cases if c["op"].endswith("quant") and c["sites"] != ["text.lm_head"]]
    assert all(c["args"][2] is not None and c["args"][-1] == "int8" for c in quant)  # a smooth scale, int8 (lm_head:
    # unsmoothed)
    assert {c["phase"] for c in quant} == {"prefill", "decode"}
    rows = run_file(out, "cpu", 1)
    assert rows and all(r["passed"] and r["backend"] == "cpu" for r in rows), rows


def _zero_first_channels(t):
    t[..., :64] = 0


MODEL_EDITS = {  # (module path, hook kind, edit): issue 21's attacks, each dropped by the old hand-over
    "norm output mul_": ("model.language_model.layers.1.input_layernorm", "forward", lambda t: t.mul_(0.25)),
    "norm output setitem": ("model.language_model.layers.1.input_layernorm", "forward", _zero_first_channels),
    "norm output .data": ("model.language_model.layers.1.input_layernorm", "forward",
                          lambda t: _zero_first_channels(t.data)),
    "q_proj input": ("model.language_model.layers.1.self_attn.q_proj", "pre", lambda t: t.mul_(0.25)),
    "v_proj input .data": ("model.language_model.layers.1.self_attn.v_proj", "pre",
                           lambda t: _zero_first_channels(t.data)),
    "lm_head input": ("lm_head", "pre", _zero_first_channels),
}


def _with_edit(model, name):
    path, kind, edit = MODEL_EDITS[name]
    module = model.get_submodule(path)
    if kind == "forward":
        module.register_forward_hook(lambda m, args, out: edit(out))
    else:
        module.register_forward_pre_hook(lambda m, args: edit(args[0]))
    return model


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("edit", list(MODEL_EDITS))
def test_hooks_editing_in_place_are_honoured_in_w8a8(tiny_loaded, sample_inputs, mode, edit):
    """The W8A8 model with a hook that edits a norm's output or a linear's input in place must follow
    the float model with the same hook (cosine 0.9998 with the edit honoured; 0.66-0.87 when dropped)."""
    float_model = _with_edit(copy.deepcopy(tiny_loaded[0]), edit)
    w8a8 = _with_edit(copy.deepcopy(tiny_loaded[0]), edit)
    report = patch_model(w8a8, backend="cpu", quant="w8a8", int8_lm_head=True)
    with getattr(torch, mode)():
        want = float_model(**sample_inputs).logits.float()
        got = w8a8(**sample_inputs).logits.float()
    assert float(torch.nn.functional.cosine_similarity(want.flatten(), got.flatten(), 0)) > 0.999
    if MODEL_EDITS[edit][0] == "lm_head":  # it quantises the rows it reads: the edited ones
        head = next(r for r in report.to_json()["w8a8"]["linears"] if r["path"] == "lm_head")
        assert head["became"] == "w8a8" and head["quantized_here"] == head["calls"] >= 1
        return
    bypassed = [r["quant"]["bypassed"] for r in report.to_json()["sites"] if r.get("quant")]
    assert any("hooks on the producer or a consumer" in why for b in bypassed for why in b)  # visible in the report


def test_a_calibration_file_for_the_whole_model_serves_a_sites_subset(tiny_loaded, calib_file):
    model = copy.deepcopy(tiny_loaded[0])
    report = patch_model(model, backend="cpu", quant="w8a8", calibration=calib_file, sites="text.*")
    q = report.to_json()["w8a8"]
    assert q["calibration_ignored"] and all(p.startswith("model.visual") for p in q["calibration_ignored"])
    assert "smooth scales ignored, for norms and MLPs this patch does not quantise" in str(report)
    assert all(r["smoothed"] for r in q["linears"] if r["became"] == "w8a8" and "visual" not in r["path"])


def test_float_linears_keeps_a_producers_linears_float_together(tiny_loaded, sample_inputs):
    """The recipe option: text.q_proj names q_proj; k_proj and v_proj read the same norm's rows, so the norm
    emits float rows and all three stay float (said per linear and per norm); everything else stays int8."""
    model = copy.deepcopy(tiny_loaded[0])
    report = patch_model(model, backend="cpu", quant="w8a8", float_linears="text.q_proj,*.merger.mlp.2")
    q = report.to_json()["w8a8"]
    rows = {r["path"]: r for r in q["linears"]}
    attn = "model.language_model.layers.2.self_attn"
    for name in ("q_proj", "k_proj", "v_proj"):
        assert rows[f"{attn}.{name}"]["became"] == "bfloat16"
        assert "float_linears keeps" in rows[f"{attn}.{name}"]["input"]
    assert rows[f"{attn}.o_proj"]["became"] == rows["model.visual.merger.mlp.0"]["became"] == "w8a8"
    assert rows["model.visual.merger.mlp.2"]["input"] == "float_linears keeps it in the model dtype"
    assert q["summary"]["int8"] == 51 - 12 - 1 - 1  # and lm_head, float unless int8_lm_head
    assert {"path": "model.language_model.layers.2.input_layernorm",
            "reason": f"float_linears keeps {attn}.q_proj in the model dtype"} in q["skipped_producers"]
    logits = _logits(model, sample_inputs)
    assert torch.isfinite(logits).all() and rows[f"{attn}.o_proj"]["became"] == "w8a8"
    assert report.to_json()["w8a8"]["summary"]["fallbacks"] == 0
    with pytest.raises(ValueError, match=r"float_linears: 'text.o_prj' matched none of the model's 51 linears; "
                                         r"expected a glob over their kinds \(text.down_proj"):
        patch_model(copy.deepcopy(tiny_loaded[0]), backend="cpu", quant="w8a8", float_linears="text.o_prj")
    with pytest.raises(ValueError, match="float_linears: given without quant='w8a8'"):
        patch_model(copy.deepcopy(tiny_loaded[0]), backend="cpu", float_linears="text.q_proj")


def test_release_float_weights_returns_the_memory_and_refuses_unpatch(tiny_loaded, sample_inputs):
    """A deployment: the int8 linears drop their float weights (nothing holds them any more), logits are the
    W8A8 model's, the tied lm_head keeps the embedding's table, unpatch and the switch are refused."""
    import gc
    import weakref

    kept = copy.deepcopy(tiny_loaded[0])
    patch_model(kept, backend="cpu", quant="w8a8")
    want = _logits(kept, sample_inputs)
    model = copy.deepcopy(tiny_loaded[0])
    o_proj = model.model.language_model.layers[0].self_attn.o_proj
    gone = weakref.ref(o_proj.weight)
    report = patch_model(model, backend="cpu", quant="w8a8", release_float_weights=True)
    gc.collect()
    assert gone() is None and o_proj.weight.is_meta and o_proj.weight.shape == (128, 128)
    s = report.to_json()["w8a8"]["summary"]
    assert s["released_float_bytes"] == s["releasable_float_bytes"] > 0
    head = model.get_output_embeddings()
    tied = head.weight is model.get_input_embeddings().weight
    assert tied and not head.weight.is_meta  # the embedding keeps its float table; lm_head (float) reads it
    assert s["float_weight_bytes"] == s["released_float_bytes"]
    assert torch.equal(_logits(model, sample_inputs), want)
    assert "float weights released" in str(report) and "unpatch_model refused" in str(report)
    with pytest.raises(PatchError, match=r"unpatch_model: the float weights of 50 int8 linears .* were released"):
        unpatch_model(model)
    pypto_gym.set_enabled(False)
    try:
        with pytest.raises(RuntimeError, match="float weight was released"):
            _logits(model, sample_inputs)
    finally:
        pypto_gym.set_enabled(True)
    with pytest.raises(ValueError, match="release_float_weights: given without quant='w8a8'"):
        patch_model(copy.deepcopy(tiny_loaded[0]), backend="cpu", release_float_weights=True)


def test_a_cpu_without_int8_dot_products_runs_the_int16_kernel_with_the_same_logits(tiny_loaded, sample_inputs,
                                                                                      monkeypatch):
    """No VNNI: the int8 linears and the merged gate/up GEMM run the cpu kernels' int16 multiply-add GEMM
    (oneDNN has no fast int8 path there), exact, so the logits are those of the torch._int_mm path bit for bit."""
    import warnings

    from pypto_gym import hardware

    model = copy.deepcopy(tiny_loaded[0])
    patch_model(model, backend="cpu", quant="w8a8")
    want = _logits(model, sample_inputs)
    monkeypatch.setattr(hardware, "native_int8", lambda: False)
    monkeypatch.setattr(quant_matmul, "int_mm_is_exact", lambda: False)
    ext = registry.get("cpu").ext
    calls = []
    real = ext.int8_gemm

    class Spy:  # the compiled module's attributes are read-only: wrap it
        def __getattr__(self, name):
            return getattr(ext, name)

        def int8_gemm(self, x, w):
            calls.append(tuple(w.shape))
            return real(x, w)

    monkeypatch.setattr(registry.get("cpu"), "_ext", Spy())
    model = copy.deepcopy(tiny_loaded[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fast path exists: nothing to warn about
        report = patch_model(model, backend="cpu", quant="w8a8")
    assert "int16 multiply-add" in report.to_json()["w8a8"]["int8_gemm"]
    assert torch.equal(_logits(model, sample_inputs), want)
    gate = model.get_submodule("model.language_model.layers.0.mlp.gate_proj").weight
    assert (2 * gate.shape[0], gate.shape[1]) in calls  # the merged gate/up weight
    assert len(calls) == 50 - 8  # one GEMM per int8 linear (lm_head is float), one per MLP's gate + up


def test_the_int32_gemm_golden_is_the_exact_integer_product(monkeypatch):
    """Without the cpu kernels (or torch._int_mm) the merged gate/up GEMM is the golden's exact fp32-chunked
    product, as int32: equal to the int64 product, also past the fp32 range."""
    monkeypatch.setattr(torch, "_int_mm", None)  # taking it would raise
    gen = torch.Generator().manual_seed(3)
    x, w = int8((5, 2100), gen), int8((7, 2100), gen)
    x[0], w[0] = 127, 127
    got = ops.int32_gemm(x, w, backend="torch")
    assert got.dtype == torch.int32 and torch.equal(got.long(), x.long() @ w.long().T)


@pytest.mark.parametrize("exact", [True, False])
def test_the_cpu_int32_gemm_is_exact_whichever_gemm_the_self_test_picked(monkeypatch, exact):
    """cpu: torch._int_mm where its self-test passed, else the int16 multiply-add kernel; bit-equal either way."""
    if exact and not quant_matmul.int_mm_is_exact():
        pytest.skip("torch._int_mm is not exact here (no int8 dot products, or oneDNN capped)")
    monkeypatch.setattr(quant_matmul, "int_mm_is_exact", lambda: exact)
    gen = torch.Generator().manual_seed(4)
    x, w = quant_matmul._saturation_probe()
    for a, b in ((x, w), (int8((3, 37), gen), int8((9, 37), gen))):
        got = run_on("cpu", OPS["int32_gemm"], (a, b))
        assert torch.equal(got.long(), a.long() @ b.long().T)


def test_a_saturating_int_mm_fails_the_self_test(monkeypatch):
    """What oneDNN capped below VNNI does (DNNL_MAX_CPU_ISA=AVX2 on a VNNI CPU: int16 sums that saturate) fails the
    one-time self-test, so torch._int_mm is never taken for the int8 linears, whatever the flags say."""
    from pypto_gym import hardware

    def saturating(a, b):
        prods = (a.long().unsqueeze(1) * b.t().long().t().unsqueeze(0)).reshape(a.shape[0], b.shape[1], -1, 2)
        return prods.sum(-1).clamp(-2 ** 15, 2 ** 15 - 1).sum(-1).to(torch.int32)  # vpmaddubsw's int16 pairs

    monkeypatch.setattr(hardware, "native_int8", lambda: True)
    monkeypatch.setattr(torch, "_int_mm", saturating)
    quant_matmul.int_mm_is_exact.cache_clear()
    try:
        assert not quant_matmul.int_mm_is_exact()
        assert "self-test" in quant_matmul.which_int32_gemm()
    finally:
        monkeypatch.undo()
        quant_matmul.int_mm_is_exact.cache_clear()


@pytest.mark.parametrize("variable", ["ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"])
@pytest.mark.parametrize("cap,native", [("AVX2", False), ("avx512_core", False), ("SSE41", False),
                                       ("AVX512_CORE_VNNI", None), ("AVX512_CORE_AMX", None), ("ALL", None)])
def test_onednn_capped_below_vnni_counts_as_no_int8_dot_products(monkeypatch, cap, native, variable):
    """oneDNN at ONEDNN_MAX_CPU_ISA=AVX2 (or its older name DNNL_MAX_CPU_ISA) runs a saturating s8s8 GEMM (wrong
    sums), so torch._int_mm is not taken; a cap that keeps VNNI leaves the CPU's flags to decide."""
    from pypto_gym import hardware

    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2", "avx512_vnni"}))
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv(variable, cap)
    assert hardware.native_int8() is (True if native is None else native)


def test_a_cpu_without_int8_dot_products_or_avx2_is_told_once_at_patch_time(tiny_loaded, monkeypatch):
    from pypto_gym import hardware
    from pypto_gym.quant import install

    monkeypatch.setattr(hardware, "native_int8", lambda: False)
    monkeypatch.setattr(quant_matmul, "int_mm_is_exact", lambda: False)
    monkeypatch.setattr(hardware, "best_isa", lambda: "generic")
    monkeypatch.setattr(install, "_said", [])
    with pytest.warns(RuntimeWarning, match="neither int8 dot-product instructions"):
        report = patch_model(copy.deepcopy(tiny_loaded[0]), backend="cpu", quant="w8a8")
    assert "note: this CPU" in str(report) and report.to_json()["w8a8"]["speed_note"]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second patch in this process says it in its report only
        again = patch_model(copy.deepcopy(tiny_loaded[0]), backend="cpu", quant="w8a8")
    assert again.to_json()["w8a8"]["speed_note"]
    monkeypatch.setattr(quant_matmul, "int_mm_is_exact", lambda: True)
    assert patch_model(copy.deepcopy(tiny_loaded[0]), backend="cpu", quant="w8a8").to_json()["w8a8"]["speed_note"] \
        is None


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_text_families_run_every_linear_int8(name):
    """Qwen3 (its qk_norm_rope sites included) and Llama: every linear int8, the int8 rows handed over where a
    norm or MLP produced them, logits close to the float model's."""
    from pypto_gym import models

    family = models.FAMILIES[name]
    model, processor = family.load(family.tiny_dir, "float32", "cpu")
    batch = processor(list(family.calibration_prompts[:2]), None, model)
    want = _logits(model, batch)
    report = patch_model(model, backend="cpu", quant="w8a8", int8_lm_head=True)
    got = _logits(model, batch)
    q = report.to_json()["w8a8"]
    assert q["summary"]["int8"] == q["summary"]["linears"] == 29 and q["summary"]["fallbacks"] == 0
    for r in q["linears"]:
        fed = r["input"].startswith("int8 rows from")
        assert (r["handed_over"] if fed else r["quantized_here"]) == r["calls"] >= 1, r
    live = want.abs().amax(-1) > 0  # the tiny models' pad and BOS embeddings are zero rows: zero logits in both
    assert torch.equal(got.abs().amax(-1) > 0, live) and int(live.sum()) >= 40
    cos = torch.nn.functional.cosine_similarity(got[live], want[live], dim=-1)
    assert float(cos.min()) > 0.99, float(cos.min())


def test_an_mlp_runs_one_int32_gemm_and_dequant_swiglu_quant(tiny_loaded, sample_inputs, calib_file):
    """gate and up read one norm's int8 rows: one exact int32 GEMM over their merged weights (views: no second
    copy), dequant_swiglu_quant to down_proj's int8 rows. On the torch backend the MLP's output equals the
    formula composed by hand from the integer product."""
    model = copy.deepcopy(tiny_loaded[0])
    report = patch_model(model, backend="torch", quant="w8a8", calibration=calib_file)
    for mlp in (model.model.language_model.layers[1].mlp, model.model.visual.blocks[0].mlp):  # no bias / biases
        site = mlp.__dict__["_pypto_gym_site"]
        w_q, w_scale, gate, up = site.quant.merged
        I = gate.w_q.shape[0]
        assert gate.w_q.data_ptr() == w_q.data_ptr() and up.w_q.data_ptr() == w_q[I:].data_ptr()
        gen = torch.Generator().manual_seed(7)
        q = torch.randint(-128, 128, (3, 5, w_q.shape[1]), generator=gen, dtype=torch.int8)
        scale = torch.rand(3, 5, generator=gen) * 1e-2
        x = activations.issue(q, scale, gate.source.smooth, mlp.gate_proj.weight.dtype, gate.source)
        with torch.no_grad():
            got = mlp(x)
        acc = (q.long() @ w_q.long().t()).to(torch.int32)  # the exact integer product
        bias = None if mlp.gate_proj.bias is None else torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias]).detach()
        y, y_scale = OPS["dequant_swiglu_quant"].golden(acc, w_scale, scale, bias, site.quant.inv_smooth, True, "int8")
        down = quant_linear.quant_linear_of(mlp.down_proj)
        want = OPS["quant_matmul"].golden(y, down.w_q, y_scale, down.w_scale, mlp.down_proj.bias, got.dtype)
        assert torch.equal(got, want)
        assert site.quant.row()["int32_calls"] == 1 and gate.handed_over == up.handed_over == 1
    _logits(model, sample_inputs)
    mlps = [r for r in report.to_json()["sites"] if r["op"] == "swiglu"]
    assert len(mlps) == 8 and all(r["quant"]["gate_up_int32_gemm"] and r["quant"]["int32_calls"] >= 1 for r in mlps)
    rows = {r["path"]: r for r in report.to_json()["w8a8"]["linears"]}
    assert all(r["handed_over"] == r["calls"] >= 1 for p, r in rows.items() if p.endswith(("gate_proj", "up_proj")))


# ---- defects found by the attack battery (issue 27) ------------------------------------------------------
@pytest.mark.parametrize("smooth_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dynamic_quant_on_cpu_equals_torch_for_every_dtype_pair(x_dtype, smooth_dtype):
    """The smooth scale may have any float dtype: the cpu kernel read it as x's (16-bit x with an fp32 scale read
    garbage, fp32 x with a 16-bit scale read past the buffer)."""
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(9, 300, generator=gen) * 3).to(x_dtype)
    smooth = (torch.rand(300, generator=gen) + 0.5).to(smooth_dtype)
    op = OPS["dynamic_quant"]
    got = run_on("cpu", op, (x, smooth, "int8"))
    want = op.golden(x, smooth, "int8")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_bf16_w8a8_model_whose_down_proj_quantises_its_own_rows_gives_its_logits(tiny_loaded, sample_inputs,
                                                                                   calib_file):
    """A hook on down_proj makes the MLP hand it float rows, which it quantises with the MLP's fp32 smooth scale
    (bf16 rows): the logits are those of the hand-over within W8A8's precision, not NaN."""
    model = copy.deepcopy(tiny_loaded[0])
    patch_model(model, backend="cpu", quant="w8a8", calibration=calib_file)
    want = _logits(model, sample_inputs)
    down = model.get_submodule("model.language_model.layers.0.mlp.down_proj")
    down.register_forward_hook(lambda m, a, out: None)
    got = _logits(model, sample_inputs)
    assert quant_linear.quant_linear_of(down).quantized_here >= 1
    live = want.abs().amax(-1) > 0
    assert torch.isfinite(got).all()
    assert float(torch.nn.functional.cosine_similarity(got[live], want[live], dim=-1).min()) > 0.99


def _perturbed(model, gen):
    """The same model with layer 0's MLP and attention weights moved (as a fine-tune or a LoRA merge would)."""
    deltas = {}
    for name, p in model.named_parameters():
        if ".layers.0." in name and name.endswith("proj.weight"):
            deltas[name] = (torch.randn(p.shape, generator=gen) * 0.05).to(p.dtype)
    return deltas


@pytest.mark.parametrize("change", ["load_state_dict", "lora merge through .data", "a new Parameter",
                                    "replace gate_proj"])
def test_int8_weights_follow_a_float_weight_changed_after_patching(tiny_loaded, sample_inputs, change):
    """The int8 weights were a snapshot: new weights loaded after patching left the model computing with the old
    ones (the merged gate/up GEMM too). Now a changed float weight is quantised again at its next call (a
    replaced module runs as it is), so the model computes what patching the new weights gives."""
    base = tiny_loaded[0]
    deltas = _perturbed(base, torch.Generator().manual_seed(5))
    target = copy.deepcopy(base)
    with torch.no_grad():
        for name, d in deltas.items():
            target.get_parameter(name).add_(d)
    model = copy.deepcopy(base)
    report = patch_model(model, backend="cpu", quant="w8a8")
    stale = _logits(model, sample_inputs)
    with torch.no_grad():
        if change == "load_state_dict":
            model.load_state_dict({k: v for k, v in target.state_dict().items() if k in deltas}, strict=False)
        elif change == "lora merge through .data":
            for name, d in deltas.items():
                model.get_parameter(name).data += d  # what peft's merge does: no version counter sees it
        elif change == "a new Parameter":
            for name, d in deltas.items():
                owner, _, attr = name.rpartition(".")
                setattr(model.get_submodule(owner), attr, torch.nn.Parameter(target.get_parameter(name).clone()))
        else:
            mlp = model.get_submodule("model.language_model.layers.0.mlp")
            mlp.gate_proj = copy.deepcopy(target.get_submodule("model.language_model.layers.0.mlp.gate_proj"))
    got = _logits(model, sample_inputs)
    assert not torch.equal(got, stale)
    if change == "replace gate_proj":  # a float gate_proj now: the MLP runs its modules, counted
        mlp_row = next(r for r in report.to_json()["sites"] if r["path"] == "model.language_model.layers.0.mlp")
        assert any("replaced after patching" in why for why in mlp_row["quant"]["bypassed"])
        return
    fresh = copy.deepcopy(target)
    patch_model(fresh, backend="cpu", quant="w8a8")
    assert torch.equal(got, _logits(fresh, sample_inputs))
    rows = {r["path"]: r for r in report.to_json()["w8a8"]["linears"]}
    assert all(rows[name.removesuffix(".weight")]["requantised"] == 1 for name in deltas)


@pytest.mark.parametrize("int8_lm_head", [False, True])
def test_what_leaves_a_w8a8_model_is_a_plain_tensor(tiny_loaded, sample_inputs, tmp_path, int8_lm_head):
    """The final norm's output is last_hidden_state / hidden_states[-1]: as a QuantRows it had no numpy(), tolist(),
    storage or pickle a user could use. The final norm hands nothing over (an int8 lm_head quantises its rows)."""
    from safetensors.torch import save_file

    model = copy.deepcopy(tiny_loaded[0])
    patch_model(model, backend="cpu", quant="w8a8", int8_lm_head=int8_lm_head)
    with torch.no_grad():
        out = model(**sample_inputs, output_hidden_states=True)
        base = model.model(**sample_inputs)
    for t in (out.hidden_states[-1], base.last_hidden_state, *out.hidden_states):
        assert type(t) is torch.Tensor and t.data_ptr() != 0
    last = out.hidden_states[-1]
    assert last.float().numpy().shape == tuple(last.shape) and len(last.tolist()) == last.shape[0]
    save_file({"h": last.contiguous()}, str(tmp_path / "h.safetensors"))
    torch.save(last, tmp_path / "h.pt")
    assert torch.equal(torch.load(tmp_path / "h.pt"), last)


def test_a_model_without_float_weights_still_takes_cpu_and_dtype_moves(tiny_loaded, sample_inputs):
    """A deployment's int8 linears hold a meta tensor for the float weight they dropped: model.cpu() and
    .to("cpu") raised "Cannot copy out of meta tensor" although the model is on the CPU."""
    model = copy.deepcopy(tiny_loaded[0])
    patch_model(model, backend="cpu", quant="w8a8", release_float_weights=True)
    want = _logits(model, sample_inputs)
    assert model.cpu() is model and model.to("cpu") is model
    assert torch.equal(_logits(model, sample_inputs), want)
    model.float()
    assert model.model.language_model.layers[0].self_attn.o_proj.weight.dtype == torch.float32
    assert torch.isfinite(_logits(model.float(), sample_inputs)).all()
    with pytest.raises(RuntimeError, match="has no float weight and its int8 one is on cpu; moving it to meta is not "
                                           "supported"):
        model.to("meta")


def test_a_w8a8_model_deep_copies_and_the_copy_runs_for_itself(tiny_loaded, sample_inputs):
    """copy.deepcopy of a W8A8-patched model raised torch's "only graph leaves" error (issue 45, item 7): the
    weight sample refresh compares was a view of the Parameter, an autograd node. The copy computes what the
    model does and counts its own calls."""
    model = copy.deepcopy(tiny_loaded[0])
    report = patch_model(model, backend="cpu", quant="w8a8")
    want = _logits(model, sample_inputs)
    twin = copy.deepcopy(model)
    calls = report.to_json()["summary"]["calls"]
    assert torch.equal(_logits(twin, sample_inputs), want)
    assert report.to_json()["summary"]["calls"] == calls  # the copy's sites count for the copy
    with torch.no_grad():
        twin.get_parameter("model.language_model.layers.0.mlp.down_proj.weight").mul_(2)
    assert not torch.equal(_logits(twin, sample_inputs), want)
    assert torch.equal(_logits(model, sample_inputs), want)
