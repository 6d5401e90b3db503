"""Whole patched models through the `npu` mapping (issue 47, section 5): the npu backend run on CPU tensors with the
torch_npu stand-in as its torch_npu (test-only; the stand-in is as strict as Ascend's documentation), strict, so any
call the mapping declined or the stand-in refused fails the test.

The contract tests (test_npu_contract.py) call each mapping alone on examples; here every site of the embedded tiny
Qwen2.5-VL (text and an image over several windows), Qwen3 and Llama, and of a tiny Qwen2-VL, runs on the npu
mapping in bf16 and fp16, plain and in W8A8 (dynamic and static), against the `torch` backend's run of the same
patch. cast_mode is "fp32": the cast mode torch_npu's kernels compute in (in `hf` mode the rotary declines, by
design: torch_npu rounds once where HF rounds each product, so the call runs HF's math, counted).
"""
import copy
import json
import sys
from pathlib import Path

import pytest
import torch

import pypto_gym
from pypto_gym import models
from pypto_gym.cli import main as cli_main
from pypto_gym.ops import registry
from pypto_gym.kernels.npu.backend import NpuBackend
from pypto_gym.precision import compare

from models import tiny_qwen2_vl

sys.path.insert(0, str(Path(__file__).parent / "contract"))
import torch_npu_standin  # noqa: E402

FAMILIES = ["qwen2_5_vl", "qwen3", "llama", "qwen3_vl"]
QUANTS = [None, "w8a8", "w8a8_static"]
NEW_TOKENS = 8


class CpuNpu(NpuBackend):
    """The npu backend on CPU tensors, its torch_npu the stand-in: what an Ascend host would run, call for call."""

    devices = ("cpu",)


@pytest.fixture
def npu_on_cpu(monkeypatch):
    monkeypatch.setattr(torch_npu_standin, "DEVICE_NAME", "Ascend910B2")
    real = registry.BACKENDS["npu"]
    registry.register(CpuNpu(module_name="torch_npu_standin"))
    torch_npu_standin.calls.clear()
    yield torch_npu_standin.calls
    registry.register(real)


@pytest.fixture(scope="module")
def calibrations(tmp_path_factory):
    """A calibration file with activation ranges per family (the static scheme's scales come from it)."""
    folder = tmp_path_factory.mktemp("calibration")
    made = {}
    for name in FAMILIES:
        family = models.FAMILIES[name]
        made[name] = folder / f"{name}.safetensors"
        assert cli_main(["calibrate", "--model", str(family.tiny_dir), "--max-new-tokens", "1", "--out",
                         str(made[name])]) == 0
    return made


def _greedy(model, batch):
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    return out.sequences[0, batch["input_ids"].shape[1]:].tolist(), [s[0].float() for s in out.scores]


def assert_same_greedy_run(want, got):
    """The same tokens, up to a tie: at the first step where the two runs pick differently, each run's pick scores
    within one bf16 ulp of its own maximum in the other run's logits too (two candidates a rounding decides; greedy
    decoding then follows each into a different context, so the rest is not compared)."""
    (tokens_a, scores_a), (tokens_b, scores_b) = want, got
    step = next((i for i, (a, b) in enumerate(zip(tokens_a, tokens_b)) if a != b), None)
    if step is None:
        assert tokens_a == tokens_b
        return
    a, b, sa, sb = tokens_a[step], tokens_b[step], scores_a[step], scores_b[step]
    for scores in (sa, sb):
        top = float(scores.max())
        ulp = 2.0 ** (torch.frexp(torch.tensor(top)).exponent.item() - 8)
        assert top - float(scores[a]) <= ulp and top - float(scores[b]) <= ulp, (step, a, b, float(scores[a]),
                                                                                 float(scores[b]), top)


def _inputs(family, processor, model):
    if family.multimodal:
        # 308 x 196 pixels: 6 windows of unequal sizes in the window blocks, the whole image in the full ones
        from PIL import Image

        gen = torch.Generator().manual_seed(2)
        image = Image.fromarray((torch.rand(196, 308, 3, generator=gen) * 255).to(torch.uint8).numpy())
        return processor(["Read the text in the image."], [image], model=model)
    return processor([family.calibration_prompts[0]], None, None)


def _every_site_ran_on_npu(report):
    """Every call of every patched site ran on npu (q_norm/k_norm rows of a Qwen3 count none: their layer's fused
    q/k norm + rotary makes them), and every kind of site was called."""
    rows = [r for r in report.to_json()["sites"] if r["status"] == "patched"]
    assert rows and all(set(r["ran_on"]) <= {"npu"} for r in rows), \
        [(r["path"], r["ran_on"]) for r in rows if set(r["ran_on"]) - {"npu"}]
    called = {r["kind"] for r in rows if r["calls"]}
    assert called >= {r["kind"] for r in rows} - {"text.q_norm", "text.k_norm"}, {r["kind"] for r in rows} - called


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q or "bf16/fp16")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", FAMILIES)
def test_a_patched_model_runs_on_the_npu_mapping_as_on_torch(npu_on_cpu, calibrations, name, dtype, quant):
    family = models.FAMILIES[name]
    model, processor = family.load(family.tiny_dir, dtype, "cpu")
    batch = _inputs(family, processor, model)
    options = {"cast_mode": "fp32", "strict": True}
    if quant:
        options.update(quant=quant, calibration=calibrations[name] if quant == "w8a8_static" else None)
    reference = copy.deepcopy(model)
    pypto_gym.patch_model(reference, backend="torch", **options)
    want = _greedy(reference, batch)
    report = pypto_gym.patch_model(model, backend="npu", **options)
    got = _greedy(model, batch)
    assert_same_greedy_run(want, got)
    _every_site_ran_on_npu(report)
    if quant:  # every int8 linear's matmul went to npu_quant_matmul
        linears = report.to_json()["w8a8"]["linears"]
        assert all(set(r["ran_on"]) == {"npu"} for r in linears if r["became"] == "w8a8" and r["calls"]), \
            [(r["path"], r["ran_on"]) for r in linears if r["became"] == "w8a8" and set(r["ran_on"]) - {"npu"}]
        assert "npu_quant_matmul" in npu_on_cpu
        assert ("npu_add_rms_norm_quant" if quant == "w8a8_static" else "npu_add_rms_norm_dynamic_quant") in npu_on_cpu
    if family.multimodal:
        assert "npu_fused_infer_attention_score" in npu_on_cpu  # the vision attention, TND
    if name == "qwen3_vl":  # the GELU MLPs' GELU in their module's form (torch's own gelu on an NPU computes tanh)
        assert "npu_gelu" in npu_on_cpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_tiny_qwen2_vl_runs_on_the_npu_mapping_as_on_torch(npu_on_cpu, dtype):
    """Qwen2-VL (no embedded checkpoint: a tiny one built from its config): the vision tower over an image of four
    windows and the text model, every site on the npu mapping, within the precision rule of the torch backend's."""
    model = tiny_qwen2_vl().to(dtype)
    reference = copy.deepcopy(model)
    grid = torch.tensor([[1, 8, 8]])
    cfg = model.config.vision_config
    channels = cfg.in_channels if hasattr(cfg, "in_channels") else cfg.in_chans
    pixels = torch.randn(64, channels * cfg.temporal_patch_size * cfg.patch_size ** 2,
                         generator=torch.Generator().manual_seed(0)).to(dtype)
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])
    outputs = []
    for m, backend in ((reference, "torch"), (model, "npu")):
        report = pypto_gym.patch_model(m, backend=backend, cast_mode="fp32", strict=True)
        with torch.no_grad():
            outputs.append((m.model.visual(pixels, grid_thw=grid), m(input_ids=ids).logits))
    for want, got in zip(*outputs):
        want = want if isinstance(want, torch.Tensor) else want[0]
        got = got if isinstance(got, torch.Tensor) else got[0]
        c = compare(got.float(), want.float())
        assert c.cosine > 0.999, c
    _every_site_ran_on_npu(report)


HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu")


@pytest.mark.parametrize("quant", [None, "w8a8"], ids=["bf16", "w8a8"])
@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_a_decode_step_on_the_npu_mapping_reads_nothing_back_to_the_host(npu_on_cpu, monkeypatch, name, quant):
    """torch_npu's graph capture (NPUGraph, torchair) takes a decode step only if it makes no host synchronisation:
    inside every npu mapping a decode step calls, a tensor's item/tolist/bool/int/float/index/numpy/cpu raises here
    (the stand-in's own arithmetic, which stands for the device, is exempt). The prefill is not checked: it takes
    the windows' bounds from the host (cu_seqlens, a list HF's own loop makes)."""
    from pypto_gym.ops import OPS

    family = models.FAMILIES[name]
    model, processor = family.load(family.tiny_dir, "bfloat16", "cpu")
    pypto_gym.patch_model(model, backend="npu", cast_mode="fp32", strict=True, quant=quant)
    batch = processor([family.calibration_prompts[0]], None, None)
    with torch.no_grad():
        prefill = model(**batch, use_cache=True)
    state = {"mapping": 0, "device": 0, "reads": []}

    def forbidding(method):
        real = getattr(torch.Tensor, method)

        def guarded(self, *args, **kwargs):
            if state["mapping"] and not state["device"]:
                state["reads"].append(method)
                raise AssertionError(f"host read {method}() inside the npu mapping of a decode step")
            return real(self, *args, **kwargs)
        return guarded

    def entering(key, fn):
        def wrapped(*args, **kwargs):
            state[key] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                state[key] -= 1
        return wrapped

    for op in OPS.values():
        impl = op.impls.get("npu")
        if impl is not None:
            monkeypatch.setattr(impl, "fn", entering("mapping", impl.fn))
    for attr in dir(torch_npu_standin):
        if attr.startswith("npu_"):
            monkeypatch.setattr(torch_npu_standin, attr, entering("device", getattr(torch_npu_standin, attr)))
    for method in HOST_READS:
        monkeypatch.setattr(torch.Tensor, method, forbidding(method))
    calls = len(npu_on_cpu)
    token = prefill.logits[:, -1:].argmax(-1)
    mask = torch.cat([batch["attention_mask"], torch.ones_like(token)], -1)
    with torch.no_grad():
        model(input_ids=token, attention_mask=mask, past_key_values=prefill.past_key_values, use_cache=True)
    monkeypatch.undo()
    assert not state["reads"]
    assert len(npu_on_cpu) > calls and "npu_fused_infer_attention_score" in npu_on_cpu[calls:]


STANDIN = str(Path(__file__).parent / "contract" / "torch_npu_standin.py")


def test_cases_check_is_the_deployment_readiness_report(tmp_path, capsys, monkeypatch):
    """`pypto-gym cases check FILE --backend npu --chip CHIP [--torch-npu MODULE]`: per captured call, whether the npu
    mapping takes it or declines it and why, the torch_npu module's verdict beside it; exit 1 when a call the
    mapping takes is refused by the module (the crash the report is there to find)."""
    cases = Path(__file__).parent / "cases" / "tiny_qwen2_5_vl.json"
    out = tmp_path / "check.json"
    assert cli_main(["cases", "check", str(cases), "--torch-npu", STANDIN, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "npu readiness on Ascend910B2 (a2_a3 series)" in text and "torch_npu refused 0 of the taken" in text
    rows = json.loads(out.read_text())["rows"]
    taken = [r for r in rows if r["mapping"] == "takes"]
    assert taken and all(r["torch_npu"] == "accepted" and r["golden"] == "meets the rule" for r in taken)
    assert all(r["reason"] for r in rows if r["mapping"] == "declined")
    # on an Atlas inference series chip the A2/A3-only calls are declined, each saying so
    assert cli_main(["cases", "check", str(cases), "--chip", "Ascend310P3", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert any("Atlas A2/A3" in r["reason"] for r in rows) and all(r["torch_npu"] is None for r in rows)
    # a mapping that makes a call the documentation refuses is caught: the stand-in made to refuse npu_swiglu
    broken = tmp_path / "broken_standin.py"
    broken.write_text(Path(STANDIN).read_text().replace(
        'def npu_swiglu(input, dim=-1):\n    calls.append("npu_swiglu")',
        'def npu_swiglu(input, dim=-1):\n    calls.append("npu_swiglu")\n    _check(False, "npu_swiglu: refused here")'))
    assert "refused here" in broken.read_text()
    assert cli_main(["cases", "check", str(cases), "--torch-npu", str(broken)]) == 1
    assert "REFUSED: npu_swiglu: refused here" in capsys.readouterr().out
