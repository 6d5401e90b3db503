"""W8A8 static (SPEC 15): msModelSlim's W8A8 scheme, its ops, calibration ranges, patching and checkpoint format.

Goldens are independent of the code under test: hand-worked examples, integer products in int64, and the
format's own formulas (msModelSlim's: input_quant = input / input_scale + input_offset, output =
(input_quant @ weight + quant_bias) * deq_scale). Accuracy and speed figures live in the benchmarks.
"""
import copy
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pypto_gym import models, patch_model, unpatch_model
from pypto_gym.cli import main as cli_main
from pypto_gym.ops import OPS
from pypto_gym.ops.quantize import quantize_static
from pypto_gym.quant import calibration, export
from pypto_gym.quant.linear import static_epilogue
from support import run_on

BACKENDS = ["torch", "cpu"]


def run(backend, name, *args):
    """The op on exactly `backend` (a fallback fails the test), every argument given."""
    return run_on(backend, OPS[name], args)


# ---- the ops -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_static_quant_worked_example(backend):
    """codes = clamp(rint(x / scale + offset)): the division and the add in fp32, in that order, half to even."""
    x = torch.tensor([[0.5, -1.0, 2.0, 0.25, 0.75, 100.0, -100.0, float("nan"), 0.5 + 2 ** -23]])
    scale, offset = torch.tensor([0.5]), torch.tensor([3.0])
    want = [4, 1, 7, 4, 4, 127, -128, 0, 4]  # 3.5 -> 4 and 4.5 -> 4 (even); clamped; NaN -> 0
    assert run(backend, "static_quant", x, scale, offset, None).tolist() == [want]
    # the offset is added before the rounding: 1.0000002 + 100 is 101.0 in fp32 but 0.50000012 + 100 rounds to
    # 100.5 there, and rint(100.5) = 100, where rint(0.50000012) + 100 would be 101
    one = torch.tensor([[0.5 + 2 ** -23]])
    assert run(backend, "static_quant", one, torch.tensor([1.0]), torch.tensor([100.0]), None).tolist() == [[100]]
    # a smooth scale multiplies the fp32 input first; an int8 offset is the same offset
    smooth = torch.tensor([2.0] * 9)
    got = run(backend, "static_quant", x[:, :3], scale, torch.tensor([3], dtype=torch.int8), smooth[:3])
    assert got.tolist() == [[5, -1, 11]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_static_norm_quant_worked_example(backend, dtype):
    """x = [1, -1, 1, -1] has rms 1; n = x * gamma = [1, -2, 0.5, -1]; / 0.25 - 3 = [1, -11, -1, -7]; the add form
    normalises x1 + x2 and returns it in the input dtype."""
    x = torch.tensor([[1.0, -1.0, 1.0, -1.0]], dtype=dtype)
    gamma = torch.tensor([1.0, 2.0, 0.5, 1.0], dtype=dtype)
    scale, offset = torch.tensor([0.25]), torch.tensor([-3.0])
    got = run(backend, "rms_norm_quant", x, gamma, scale, offset, None, 1e-12)
    assert got.tolist() == [[1, -11, -1, -7]]
    half = x / 2
    y, x_out = run(backend, "add_rms_norm_quant", half, half, gamma, scale, offset, None, 1e-12)
    assert y.tolist() == [[1, -11, -1, -7]] and torch.equal(x_out, x)
    beta = torch.tensor([0.25, 0.0, 0.0, 0.0], dtype=dtype)  # + beta before the quantisation: 1.25 / 0.25 - 3
    assert run(backend, "rms_norm_quant", x, gamma, scale, offset, beta, 1e-12)[0, 0] == 2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_quant_matmul_static_is_the_exact_integer_product_then_one_multiply(backend, out_dtype):
    gen = torch.Generator().manual_seed(0)
    x_q = torch.randint(-128, 128, (2, 5, 1500), generator=gen, dtype=torch.int8)  # K past one exact fp32 chunk
    w_q = torch.randint(-128, 128, (24, 1500), generator=gen, dtype=torch.int8)
    deq = torch.rand(24, generator=gen) * 1e-5
    qb = torch.randint(-2 ** 24, 2 ** 24, (24,), generator=gen, dtype=torch.int32)
    exact = x_q.long().reshape(-1, 1500) @ w_q.long().T + qb.long()  # int64, exact
    want = (exact.double().float() * deq).to(out_dtype).reshape(2, 5, 24)
    assert torch.equal(run(backend, "quant_matmul_static", x_q, w_q, deq, qb, out_dtype), want)
    assert torch.equal(run(backend, "quant_matmul_static", x_q, w_q, deq, None, out_dtype),
                       ((exact - qb.long()).double().float() * deq).to(out_dtype).reshape(2, 5, 24))


def test_the_static_chain_is_msmodelslims_formula():
    """A float linear quantised the msModelSlim way: x_q = static codes of x, w per-channel int8; deq_scale and
    quant_bias from static_epilogue; (x_q @ w_q^T + quant_bias) * deq_scale equals msModelSlim's simulated forward
    ((x_q - offset) * input_scale) @ (w_q * w_scale)^T + bias to within the bias's rounding (half a deq_scale)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 64, generator=gen) + 0.5  # asymmetric: the offset matters
    w, b = torch.randn(16, 64, generator=gen) * 0.1, torch.randn(16, generator=gen)
    lo, hi = float(x.min()), float(x.max())
    scale = torch.tensor([(hi - lo) / 255])
    offset = torch.tensor([-128.0 - lo / float(scale)]).round()
    x_q = quantize_static(x, scale, offset)
    w_scale = w.abs().amax(1) / 127
    w_q = torch.round(w / w_scale[:, None]).to(torch.int8)
    deq, qb = static_epilogue(w_q, w_scale, scale, offset, b, "linear")
    assert torch.equal(deq, scale * w_scale)
    rowsum = w_q.double().sum(1)
    assert torch.equal(qb, (torch.round(b / deq).double() - float(offset) * rowsum).to(torch.int32))
    y = OPS["quant_matmul_static"].golden(x_q, w_q, deq, qb, torch.float32)
    simulated = ((x_q.double() - float(offset)) * float(scale)) @ (w_q.double() * w_scale.double()[:, None]).T \
        + b.double()
    assert float((y.double() - simulated).abs().max()) <= float(deq.max()) * 0.5 + 1e-4
    assert float((y.double() - (x.double() @ w.double().T + b.double())).abs().max()) < 0.1  # the int8 error


def test_a_quant_bias_beyond_int32_is_refused_naming_the_linear():
    w_q = torch.ones(2, 4, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"layers.0.q_proj: quant_bias channel 1 is .* outside int32"):
        static_epilogue(w_q, torch.tensor([1.0, 1e-9]), torch.tensor([1e-3]), torch.tensor([0.0]),
                        torch.tensor([0.0, 1e6]), "layers.0.q_proj")


# ---- calibration ranges -------------------------------------------------------------------------------------
def test_static_params_worked_example():
    """Rows in [-1, 3]: scale 4/255, offset rint(-128 + 1 / (4/255)) = rint(-64.25) = -64; a smooth scale 1/2
    halves the range; a range that excludes 0 is widened to hold it (0 is an exact code); in the model dtype."""
    lo, hi = torch.tensor([-1.0, 0.5]), torch.tensor([2.0, 3.0])
    scale, offset = calibration.static_params(lo, hi, None, torch.float32)
    assert float(scale) == pytest.approx(4 / 255, rel=1e-7) and float(offset) == -64.0
    scale, offset = calibration.static_params(lo, hi, torch.tensor([0.5, 0.5]), torch.float32)
    assert float(scale) == pytest.approx(2 / 255, rel=1e-7) and float(offset) == -64.0
    scale, offset = calibration.static_params(torch.tensor([1.0]), torch.tensor([2.0]), None, torch.bfloat16)
    assert scale.dtype == offset.dtype == torch.bfloat16 and float(offset) == -128.0
    assert float(scale) == float(torch.tensor(2 / 255).to(torch.bfloat16))


def test_a_percentile_range_leaves_a_rare_spike_out():
    """100 rows per channel, one spike of 50 in channel 0: min/max keeps it; the 99th percentile (one value of 100
    left out at each end) does not; the widest over calls; a percentile outside (50, 100] is refused."""
    model = torch.nn.Linear(2, 2)
    x = torch.cat([torch.linspace(-1, 1, 100)[:, None].expand(100, 2), torch.zeros(0, 2)])
    spiked = x.clone()
    spiked[7, 0] = 50.0
    plain, clipped = calibration.Calibrator(model), calibration.Calibrator(model, 99.0)
    for rec in (plain, clipped):
        rec._record("p", spiked)
    assert float(plain.amax["p"][0]) == 50.0 and float(clipped.amax["p"][0]) == 1.0
    assert float(clipped.amin["p"][0]) == pytest.approx(-1 + 2 / 99) and float(clipped.amax["p"][1]) == \
        pytest.approx(1 - 2 / 99)  # channel 1 loses its own extremes too
    clipped._record("p", 3 * x)
    assert float(clipped.amax["p"][1]) == pytest.approx(3 - 6 / 99)  # the widest over calls
    assert clipped.range_rule == "percentile 99" and plain.range_rule == "min/max"
    with pytest.raises(ValueError, match=r"percentile: got 40; expected a number in \(50, 100\]"):
        calibration.Calibrator(model, 40)


# ---- the scheme on a model -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3_calib(tmp_path_factory):
    family = models.FAMILIES["qwen3"]
    path = tmp_path_factory.mktemp("calib") / "qwen3.safetensors"
    assert cli_main(["calibrate", "--model", str(family.tiny_dir), "--dtype", "bfloat16", "--max-new-tokens", "2",
                     "--out", str(path)]) == 0
    return path


def _qwen3(dtype="bfloat16"):
    family = models.FAMILIES["qwen3"]
    model, processor = family.load(family.tiny_dir, dtype, "cpu")
    return model, processor(list(family.calibration_prompts[:2]), None, None), processor


def _logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits.float()


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_linear_runs_static_codes_and_the_formats_epilogue(qwen3_calib, backend):
    model, batch, _ = _qwen3()
    ref = _logits(model, batch)
    report = patch_model(model, backend=backend, quant="w8a8_static", calibration=qwen3_calib, strict=True)
    got = _logits(model, batch)
    q = report.to_json()["w8a8"]
    assert q["scheme"] == "static" and q["summary"]["int8"] == 28 and q["summary"]["fallbacks"] == 0
    assert q["summary"]["handed_over"] >= 24  # q/k/v, gate/up from the norms, down_proj from the MLPs
    for ql in report._state.quant.linears:
        scale, offset = ql.static
        assert scale.dtype == offset.dtype == torch.bfloat16 and -128 <= float(offset) <= 127
        deq, qb = static_epilogue(ql.w_q, ql.w_scale, scale, offset, ql.module.bias, ql.path)
        assert torch.equal(ql.deq_base, deq) and torch.equal(ql.quant_bias, qb)
        folded = ql.out_fold is not None  # up_proj and v_proj carry their consumer's smooth scale
        assert folded == ql.path.endswith(("up_proj", "v_proj"))
        assert torch.equal(ql.deq_scale, deq * ql.out_fold if folded else deq)
    cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0)
    assert float(cos) > 0.999
    unpatch_model(model)
    assert torch.equal(_logits(model, batch), ref)


@pytest.mark.parametrize("change", ["load_state_dict", "in-place edit"])
def test_a_static_model_follows_a_weight_changed_after_patching(qwen3_calib, change):
    """Patched-then-edited equals edited-then-patched for every linear (issue 45, item 4): `refresh` quantised the
    new weight but kept the old deq_scale wherever no output fold rebuilt it, so new codes ran under old scales
    (down_proj x 2 gave logits identical to the unedited model's)."""
    model, batch, _ = _qwen3()
    gen = torch.Generator().manual_seed(3)
    edits = {name: (p.float() * 2 if "down_proj" in name else p.float() + 0.02 * torch.randn(p.shape, generator=gen))
             .to(p.dtype) for name, p in model.named_parameters() if name.endswith("proj.weight")}
    edited = copy.deepcopy(model)
    edited.load_state_dict(edits, strict=False)
    patch_model(model, backend="cpu", quant="w8a8_static", calibration=qwen3_calib)
    stale = _logits(model, batch)
    with torch.no_grad():
        if change == "load_state_dict":
            model.load_state_dict(edits, strict=False)
        else:
            for name, value in edits.items():
                model.get_parameter(name).copy_(value)
    got = _logits(model, batch)
    assert not torch.equal(got, stale)
    report = patch_model(edited, backend="cpu", quant="w8a8_static", calibration=qwen3_calib)
    assert report.to_json()["w8a8"]["summary"]["int8"] == 28
    assert torch.equal(got, _logits(edited, batch))


def test_the_static_scheme_needs_a_calibration_with_ranges(qwen3_calib, tmp_path):
    model, _, _ = _qwen3()
    with pytest.raises(ValueError, match=r"quant='w8a8_static': no calibration given; expected calibration= a file from `pypto-gym calibrate`"):
        patch_model(model, backend="cpu", quant="w8a8_static")
    old = tmp_path / "format3.safetensors"  # the previous format: smooth scales only, still fine for dynamic
    tensors = {k: v for k, v in load_file(str(qwen3_calib)).items() if k.endswith(".smooth_scale")}
    with safe_open(str(qwen3_calib), framework="pt") as f:
        meta = json.loads(f.metadata()["pypto_gym"])
    meta["format"] = "pypto_gym-smoothquant-3"
    save_file(tensors, str(old), metadata={"pypto_gym": json.dumps(meta, sort_keys=True)})
    with pytest.raises(ValueError, match=r"holds no activation ranges \(smooth scales only\), which "
                                         r"quant='w8a8_static' needs; calibrate again"):
        patch_model(model, backend="cpu", quant="w8a8_static", calibration=old)
    assert patch_model(model, backend="cpu", quant="w8a8", calibration=old).to_json()["w8a8"]["smoothing"]
    unpatch_model(model)
    damaged = tmp_path / "damaged.safetensors"
    tensors = load_file(str(qwen3_calib))
    del tensors["model.layers.0.input_layernorm.act_max"]
    save_file(tensors, str(damaged), metadata={"pypto_gym": json.dumps({**meta, "format": calibration.FORMAT},
                                                                       sort_keys=True)})
    with pytest.raises(ValueError, match=r"no tensor 'model.layers.0.input_layernorm.act_max'"):
        patch_model(model, backend="cpu", quant="w8a8_static", calibration=damaged)


@pytest.mark.parametrize("damage", ["min above max", "a zero range", "a linear's min above max"])
def test_impossible_calibration_ranges_are_refused_naming_file_tensor_and_channel(qwen3_calib, tmp_path, damage):
    """A channel with act_min > act_max, or a source whose whole range is 0, loaded without a word and ran the static
    model at logits cosine 0.18-0.33 against float (issue 45, item 5)."""
    tensors = load_file(str(qwen3_calib))
    with safe_open(str(qwen3_calib), framework="pt") as f:
        metadata = f.metadata()
    source = "model.layers.1.post_attention_layernorm"
    if damage == "min above max":
        tensors[f"{source}.act_min"][5] = tensors[f"{source}.act_max"][5] + 1.0
        match = (rf"calibration .*damaged.safetensors: tensors '{source}.act_min' and '{source}.act_max' give channel "
                 rf"5 the range \[.*\] \(1 channels with min > max\)")
    elif damage == "a zero range":
        tensors[f"{source}.act_min"].zero_()
        tensors[f"{source}.act_max"].zero_()
        match = rf"damaged.safetensors: tensors '{source}.act_min' and '{source}.act_max' are 0 in every channel"
    else:
        source = next(n[:-len(".act_min")] for n in sorted(tensors) if n.endswith("o_proj.act_min"))
        tensors[f"{source}.act_max"][0] = tensors[f"{source}.act_min"][0] - 1.0
        match = rf"tensors '{source}.act_min' and '{source}.act_max' give channel 0"
    damaged = tmp_path / "damaged.safetensors"
    save_file(tensors, str(damaged), metadata=metadata)
    model, _, _ = _qwen3()
    with pytest.raises(ValueError, match=match):
        patch_model(model, backend="cpu", quant="w8a8_static", calibration=damaged)


# ---- msModelSlim W8A8 (static) checkpoints -------------------------------------------------------------------
@pytest.fixture(scope="module")
def static_export(qwen3_calib, tmp_path_factory):
    model, batch, processor = _qwen3()
    patch_model(model, backend="cpu", quant="w8a8_static", calibration=qwen3_calib)
    out = tmp_path_factory.mktemp("ms_static") / "qwen3_w8a8"
    export.save(model, out, processor, "msmodelslim")
    return model, batch, _logits(model, batch), out


Q = "model.layers.0.self_attn.q_proj"


def test_the_static_export_has_msmodelslims_w8a8_layout(static_export):
    """Per int8 linear: weight int8 [n, k], input_scale and input_offset [1] in the model dtype, deq_scale fp32 [n]
    (= input_scale * weight_scale), quant_bias int32 [n], all typed W8A8; model_quant_type W8A8; the rest FLOAT."""
    model, _, _, out = static_export
    tensors = load_file(str(out / export.MSMODELSLIM_WEIGHTS))
    desc = json.loads((out / export.MSMODELSLIM_JSON).read_text())
    assert desc["model_quant_type"] == "W8A8"
    n, k = model.get_submodule(Q).weight.shape
    assert tensors[f"{Q}.weight"].dtype == torch.int8 and tuple(tensors[f"{Q}.weight"].shape) == (n, k)
    for name in ("input_scale", "input_offset"):
        assert tensors[f"{Q}.{name}"].dtype == torch.bfloat16 and tuple(tensors[f"{Q}.{name}"].shape) == (1,)
    assert tensors[f"{Q}.deq_scale"].dtype == torch.float32 and tuple(tensors[f"{Q}.deq_scale"].shape) == (n,)
    assert tensors[f"{Q}.quant_bias"].dtype == torch.int32 and tuple(tensors[f"{Q}.quant_bias"].shape) == (n,)
    assert torch.equal(tensors[f"{Q}.deq_scale"],
                       tensors[f"{Q}.input_scale"].float() * tensors[f"{Q}.weight_scale"].reshape(-1))
    for name in ("weight", "input_scale", "input_offset", "deq_scale", "quant_bias"):
        assert desc[f"{Q}.{name}"] == "W8A8"
    assert desc["model.embed_tokens.weight"] == desc["model.layers.0.input_layernorm.weight"] == "FLOAT"
    k_proj = "model.layers.0.self_attn.k_proj"  # one norm's consumers read one set of codes: one scale and offset
    assert torch.equal(tensors[f"{k_proj}.input_scale"], tensors[f"{Q}.input_scale"])
    assert torch.equal(tensors[f"{k_proj}.input_offset"], tensors[f"{Q}.input_offset"])


def test_a_static_export_loads_back_with_equal_logits(static_export):
    _, batch, ours, out = static_export
    loaded, _, _, report = export.load(out, backend="cpu")
    assert report.to_json()["w8a8"]["scheme"] == "static"
    assert torch.equal(_logits(loaded, batch), ours)


def test_an_fp16_static_export_stores_deq_scale_as_int64_and_loads_back_equal(qwen3_calib, tmp_path):
    """msModelSlim's fp16 deq_scale: the fp32 bits as int64 (npu_quant_matmul's fp16 output takes it so)."""
    model, batch, processor = _qwen3("float16")
    patch_model(model, backend="cpu", quant="w8a8_static", calibration=qwen3_calib)
    ours = _logits(model, batch)
    export.save(model, tmp_path / "fp16", processor, "msmodelslim")
    tensors = load_file(str(tmp_path / "fp16" / export.MSMODELSLIM_WEIGHTS))
    assert tensors[f"{Q}.deq_scale"].dtype == torch.int64
    assert torch.equal(export.deq_scale_from_int64(tensors[f"{Q}.deq_scale"]),
                       model.get_submodule(Q).__dict__["_pypto_gym_quant_linear"].deq_scale)
    loaded, _, _, _ = export.load(tmp_path / "fp16", backend="cpu")
    assert torch.equal(_logits(loaded, batch), ours)


STATIC_DAMAGES = {
    "missing deq_scale": (lambda t, d: (t.pop(f"{Q}.deq_scale"), d.pop(f"{Q}.deq_scale")),
                          f"tensor '{Q}.deq_scale' is missing"),
    "float quant_bias": (lambda t, d: t.__setitem__(f"{Q}.quant_bias", t[f"{Q}.quant_bias"].float()),
                         f"tensor '{Q}.quant_bias' is float32 \\[128\\]; expected int32"),
    "offset out of int8": (lambda t, d: t.__setitem__(f"{Q}.input_offset", torch.tensor([200.0]).bfloat16()),
                           f"tensor '{Q}.input_offset' is 200.0; expected an integer in int8's range"),
    "offset NaN": (lambda t, d: t.__setitem__(f"{Q}.input_offset", torch.tensor([float("nan")]).bfloat16()),
                   f"tensor '{Q}.input_offset' is nan; expected an integer in int8's range"),
    "offset inf": (lambda t, d: t.__setitem__(f"{Q}.input_offset", torch.tensor([float("inf")]).bfloat16()),
                   f"tensor '{Q}.input_offset' is inf; expected an integer in int8's range"),
    "zero input_scale": (lambda t, d: t.__setitem__(f"{Q}.input_scale", torch.zeros(1).bfloat16()),
                         f"tensor '{Q}.input_scale' is 0.0; expected a finite value > 0"),
    "short deq_scale": (lambda t, d: t.__setitem__(f"{Q}.deq_scale", t[f"{Q}.deq_scale"][:5]),
                        f"tensor '{Q}.deq_scale' is \\[5\\]; expected \\[128\\]"),
    "other scheme's type": (lambda t, d: d.__setitem__(f"{Q}.deq_scale", "W8A8_DYNAMIC"),
                            f"gives '{Q}.deq_scale' type 'W8A8_DYNAMIC'; expected 'W8A8' or 'FLOAT'"),
}


@pytest.mark.parametrize("damage", list(STATIC_DAMAGES))
def test_a_malformed_static_checkpoint_is_refused_naming_the_tensor(static_export, tmp_path, damage):
    edit, match = STATIC_DAMAGES[damage]
    out = tmp_path / "damaged"
    shutil.copytree(static_export[3], out)
    tensors = load_file(str(out / export.MSMODELSLIM_WEIGHTS))
    desc = json.loads((out / export.MSMODELSLIM_JSON).read_text())
    edit(tensors, desc)
    save_file(tensors, str(out / export.MSMODELSLIM_WEIGHTS), metadata={"format": "pt"})
    (out / export.MSMODELSLIM_JSON).write_text(json.dumps(desc))
    with pytest.raises(ValueError, match=match):
        export.load(out, backend="cpu")


# ---- compressed-tensors' static int8 -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def ct_static_export(static_export, tmp_path_factory):
    model, batch, ours, _ = static_export
    out = tmp_path_factory.mktemp("ct_static") / "qwen3_w8a8"
    export.save(model, out, _qwen3()[2], "compressed-tensors")
    return batch, ours, out


def test_the_compressed_tensors_static_export_has_its_layout(ct_static_export):
    """input activations per tensor, static, asymmetric; per int8 linear weight int8, weight_scale fp32 [n, 1],
    input_scale [1] in the model dtype, input_zero_point int8 [1]: what vLLM's CompressedTensorsW8A8Int8 reads."""
    _, _, out = ct_static_export
    group = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    act = group["input_activations"]
    assert (act["strategy"], act["dynamic"], act["symmetric"], act["num_bits"]) == ("tensor", False, False, 8)
    assert group["weights"]["strategy"] == "channel"
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors[f"{Q}.input_scale"].dtype == torch.bfloat16 and tuple(tensors[f"{Q}.input_scale"].shape) == (1,)
    zero_point = tensors[f"{Q}.input_zero_point"]
    assert zero_point.dtype == torch.int8 and tuple(zero_point.shape) == (1,)
    assert export.quant_mode_of(out) == "w8a8_static"


def test_the_compressed_tensors_static_export_loads_back_and_transformers_agrees(ct_static_export):
    from transformers import AutoModelForCausalLM

    batch, ours, out = ct_static_export
    loaded, _, _, report = export.load(out, backend="cpu")
    assert report.to_json()["w8a8"]["scheme"] == "static"
    got = _logits(loaded, batch)
    assert float(torch.nn.functional.cosine_similarity(got.flatten(), ours.flatten(), dim=0)) > 0.99999
    theirs = _logits(AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16), batch)  # compressed-tensors
    assert float(torch.nn.functional.cosine_similarity(theirs.flatten(), got.flatten(), dim=0)) > 0.999
    assert torch.equal(theirs.argmax(-1), got.argmax(-1))


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.pop(f"{Q}.input_scale"), f"tensor '{Q}.input_scale' is missing"),
    (lambda t: t.__setitem__(f"{Q}.input_zero_point", torch.tensor([1.5])),
     f"tensor '{Q}.input_zero_point' is float32 \\[1\\]; expected one int8 value"),
    (lambda t: t.__setitem__(f"{Q}.input_scale", torch.tensor([-1.0])), f"tensor '{Q}.input_scale' is float32"),
])
def test_a_malformed_compressed_tensors_static_checkpoint_is_refused(ct_static_export, tmp_path, edit, match):
    out = tmp_path / "damaged"
    shutil.copytree(ct_static_export[2], out)
    tensors = load_file(str(out / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=match):
        export.load(out, backend="cpu")


@pytest.mark.parametrize("name", ["qwen2_5_vl", "llama"])
def test_every_family_round_trips_a_static_export_bit_equal_in_both_formats(name, tmp_path):
    """Qwen2.5-VL (an image: the vision tower's qkv/proj, the merger after ln_q and after GELU) and Llama: every
    linear but lm_head int8, and what loads back from either format computes the logits the patched model did.
    The merger's mlp.0 smooth scale folds into ln_q's weight in memory as in the checkpoint; mlp.2 (after GELU,
    unsmoothed) has its own range in the calibration file."""
    from pypto_gym.inference import open_image
    from pypto_gym.models.qwen2_5_vl import SAMPLE_IMAGE

    family = models.FAMILIES[name]
    calib = tmp_path / "calib.safetensors"
    assert cli_main(["calibrate", "--model", str(family.tiny_dir), "--dtype", "bfloat16", "--max-new-tokens", "2",
                     "--out", str(calib)]) == 0
    model, processor = family.load(family.tiny_dir, "bfloat16", "cpu")
    batch = processor(["Read the text in the image."], [open_image(SAMPLE_IMAGE)], None) if family.multimodal \
        else processor(list(family.calibration_prompts[:2]), None, None)
    report = patch_model(model, backend="cpu", quant="w8a8_static", calibration=calib, strict=True)
    floats = [r["path"] for r in report.to_json()["w8a8"]["linears"] if r["became"] != "w8a8"]
    assert floats == ["lm_head"]
    ours = _logits(model, batch)
    for fmt in ("msmodelslim", "compressed-tensors"):
        export.save(model, tmp_path / fmt, processor, fmt)
        loaded, _, _, back = export.load(tmp_path / fmt, backend="cpu")
        assert back.to_json()["w8a8"]["summary"]["int8"] == len(report._state.quant.linears)
        assert torch.equal(_logits(loaded, batch), ours), fmt


def test_cli_exports_and_infers_a_static_checkpoint(qwen3_calib, tmp_path, capsys):
    family = models.FAMILIES["qwen3"]
    out = tmp_path / "ms"
    assert cli_main(["export", "--model", str(family.tiny_dir), "--quant", "w8a8_static", "--format", "msmodelslim",
                     "--calibration", str(qwen3_calib), str(out)]) == 0
    assert "W8A8 static: weight int8, input_scale/input_offset, deq_scale, quant_bias" in capsys.readouterr().out
    assert cli_main(["export", "--model", str(family.tiny_dir), "--quant", "w8a8_static", "--format", "msmodelslim",
                     str(tmp_path / "x")]) == 2
    assert "--quant w8a8_static: needs --calibration" in capsys.readouterr().err
    assert cli_main(["infer", "--model", str(out), "--use_pto", "--quant", "w8a8", "--max-new-tokens", "2"]) == 2
    assert "run it with --use_pto --quant w8a8_static" in capsys.readouterr().err
    assert cli_main(["infer", "--model", str(out), "--use_pto", "--quant", "w8a8_static", "--max-new-tokens",
                     "2"]) == 0
    assert "static per-tensor activation scales (msModelSlim W8A8)" in capsys.readouterr().out


def test_the_static_scheme_compiles_as_eager_runs(qwen3_calib):
    """torch.compile(fullgraph=True) of a static W8A8 model: the static rows hand over inside the graph, equal
    logits to eager."""
    model, batch, _ = _qwen3()
    patch_model(model, backend="cpu", quant="w8a8_static", calibration=qwen3_calib)
    eager = _logits(model, batch)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    assert torch.equal(_logits(compiled, batch), eager)


# ---- a recipe found by measurement (quant/tune.py) -------------------------------------------------------------
def test_tune_finds_the_fewest_float_groups_for_the_target_and_patch_model_runs_its_recipe(tmp_path):
    """On the tiny Qwen3 with activation outliers and a target the all-int8 model misses: the groups go float most
    sensitive first until the target is met; the recipe file holds them and its alphas; patch_model with it as the
    calibration keeps them float and reproduces the measured cosine; an explicit float_linears wins."""
    from pypto_gym.bench.w8a8_bench import inject_outliers
    from pypto_gym.inference import generate
    from pypto_gym.quant import tune

    family = models.FAMILIES["qwen3"]
    model, processor = family.load(family.tiny_dir, "bfloat16", "cpu")
    inject_outliers(model)
    held_out = [processor([p], None, None) for p in tune.HELD_OUT_PROMPTS]

    def evaluate():
        with torch.inference_mode():
            return [model(**b, logits_to_keep=tune.KEEP_POSITIONS).logits[0].float() for b in held_out]

    def calibrate():
        generate(model, processor, list(family.calibration_prompts[:2]), [None, None], 2)

    out = tmp_path / "recipe.safetensors"
    report = tune.tune(model, evaluate, calibrate, 0.9995, "static", out=out, log=lambda line: None)
    trail = report["trail"]
    assert trail[0]["float"] == [] and trail[0]["cosine"] < 0.9995  # the target needs float groups here
    assert report["met"] and report["cosine"] >= 0.9995 and report["float_groups"] == trail[-1]["float"]
    worst = [min(report["alone"][k].values()) for k in report["float_groups"]]
    assert worst == sorted(worst)  # the most sensitive group first
    assert all(trail[i]["cosine"] < 0.9995 for i in range(len(trail) - 1))  # stopped at the first that met it
    assert 0.0 < report["decoder_int8_share"] < 1.0
    assert set(report["alpha"].values()) <= set(tune.ALPHAS)
    recipe = calibration.recipe_of(out)
    assert recipe["float_linears"] == report["float_linears"] and recipe["scheme"] == "static"
    ref = evaluate()
    patched_report = patch_model(model, backend="cpu", quant="w8a8_static", calibration=out)
    rows = {r["path"]: r for r in patched_report.to_json()["w8a8"]["linears"]}
    assert all(rows[p]["became"] == "bfloat16" for p in report["float_linears"])
    assert patched_report.to_json()["w8a8"]["recipe"]["float_linears"] == report["float_linears"]
    got = evaluate()
    unpatch_model(model)
    assert tune._cosine(ref, got) == report["cosine"]  # what it measured is what the recipe runs
    with_own = patch_model(model, backend="cpu", quant="w8a8_static", calibration=out,
                           float_linears="text.lm_head")  # an explicit float_linears wins over the recipe's
    assert all(r["became"] == "w8a8" for r in with_own.to_json()["w8a8"]["linears"]
               if r["path"] in report["float_linears"])
    unpatch_model(model)
    # export (and infer, through the same patch_model) take the recipe as their --calibration
    ms = tmp_path / "ms"
    assert cli_main(["export", "--model", str(family.tiny_dir), "--quant", "w8a8_static", "--format", "msmodelslim",
                     "--calibration", str(out), str(ms)]) == 0
    desc = json.loads((ms / export.MSMODELSLIM_JSON).read_text())
    assert all(desc[f"{p}.weight"] == "FLOAT" for p in report["float_linears"])
    assert sum(v == "W8A8" for k, v in desc.items() if k.endswith(".weight")) == 28 - len(report["float_linears"])


def test_cli_tune_refuses_a_target_outside_zero_to_one(capsys, tmp_path):
    assert cli_main(["tune", "--model", str(models.FAMILIES["qwen3"].tiny_dir), "--target-cosine", "1.5", "--out",
                     str(tmp_path / "r.safetensors")]) == 2
    assert "--target-cosine: got 1.5; expected a cosine in (0, 1]" in capsys.readouterr().err
