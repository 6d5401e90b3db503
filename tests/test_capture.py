"""Shape capture and the test-case pipeline (SPEC 4)."""
import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import pypto_gym
from pypto_gym.capture import CaseError, ShapeRecorder, load_cases
from pypto_gym.capture.runner import format_table, run_case, run_file
from pypto_gym.ops import OPS, registry

ROOT = Path(__file__).resolve().parent.parent
CASE_FILES = sorted((ROOT / "tests" / "cases").glob("*.json"))


def capture(model, inputs, new_tokens=3):
    with ShapeRecorder(model) as rec:
        with torch.inference_mode():
            model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    return rec


def test_captured_shapes_match_the_model(tiny_loaded, sample_inputs):
    model, _ = tiny_loaded
    rec = capture(model, sample_inputs)
    cases = rec.cases()
    H = model.config.text_config.hidden_size
    Hv = model.config.vision_config.hidden_size
    S = sample_inputs["input_ids"].shape[1]
    T = int(sample_inputs["image_grid_thw"].prod())
    shapes = {(c["op"], c["phase"], tuple(next(iter(c["input"].values()))["shape"])) for c in cases}
    assert ("rms_norm", "prefill", (1, S, H)) in shapes
    assert ("rms_norm", "decode", (1, 1, H)) in shapes
    assert ("rms_norm", "prefill", (T, Hv)) in shapes
    assert ("add_rms_norm", "prefill", (1, S, H)) in shapes and ("add_rms_norm", "decode", (1, 1, H)) in shapes
    I, Iv = model.config.text_config.intermediate_size, model.config.vision_config.intermediate_size
    assert {("swiglu", "prefill", (1, S, I)), ("swiglu", "decode", (1, 1, I)), ("swiglu", "prefill", (T, Iv))} <= shapes
    # what runs is recorded: a plain norm before attention and at the end, the fused add + norm before the MLP
    layers = model.config.text_config.num_hidden_layers
    decode = next(c for c in cases if c["op"] == "rms_norm" and c["phase"] == "decode")
    assert decode["count"] == 2 * (layers + 1)  # 3 new tokens: 1 prefill + 2 decode steps
    assert set(decode["sites"]) == {"text.input_layernorm", "text.norm"}
    fused = next(c for c in cases if c["op"] == "add_rms_norm" and c["phase"] == "decode")
    assert fused["count"] == 2 * layers and fused["sites"] == ["text.post_attention_layernorm"]
    assert decode["input"]["weight"] == {"shape": [H], "dtype": "bfloat16"}
    assert decode["input"]["cast_mode"] == {"value": "hf"} and decode["input"]["eps"] == {"value": 1e-6}
    assert decode["rtol"] == decode["atol"] == 2 ** -7


def test_a_call_above_the_case_cap_is_counted_not_written(tiny_loaded, sample_inputs, monkeypatch, tmp_path):
    """A case no default `cases run` could load (GutenOCR's int8 lm_head weight) is not written, and said."""
    from pypto_gym.capture import recorder

    model, _ = tiny_loaded
    I = model.config.text_config.intermediate_size
    monkeypatch.setattr(recorder, "MAX_ELEMENTS", 11 * I - 1)  # the prefill MLP's gate (1, S, I) is above it
    rec = capture(model, sample_inputs)
    S = sample_inputs["input_ids"].shape[1]
    assert S * I > 11 * I - 1 and rec.too_large.get("text.mlp", 0) >= 1
    assert all(math.prod(t["shape"]) <= 11 * I - 1 for c in rec.cases() for t in c["input"].values() if "shape" in t)


def test_patched_model_captures_the_same_cases(tiny_loaded, sample_inputs):
    model, _ = tiny_loaded
    plain = capture(model, sample_inputs).cases()
    patched_model = copy.deepcopy(model)
    pypto_gym.patch_model(patched_model, backend="cpu")
    cases = capture(patched_model, sample_inputs).cases()
    # the same cases, plus the cpu backend's epilogue linears (`linear`: a site's bf16 linears with a bias), which
    # only a cpu patch runs through the op system
    assert [c for c in cases if c["op"] != "linear"] == plain
    linears = [c for c in cases if c["op"] == "linear"]
    assert {s for c in linears for s in c["sites"]} >= {"vision.mlp", "vision.attention", "text.attention"}


def test_recapture_is_byte_identical_and_merge_adds_only_new(tiny_loaded, sample_inputs, tmp_path):
    model, processor = tiny_loaded
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    capture(model, sample_inputs).save(a, model_name="tiny")
    capture(model, sample_inputs).save(b, model_name="tiny")
    assert a.read_bytes() == b.read_bytes()
    before = json.loads(a.read_text())["test_cases"]
    info = capture(model, sample_inputs).save(a)
    assert info["added"] == 0 and a.read_bytes() == b.read_bytes()
    text_only = processor(["Hello world, a longer prompt without an image at all."], None, model=model)
    info = capture(model, text_only).save(a)
    after = json.loads(a.read_text())["test_cases"]
    assert info["added"] > 0 and after[:len(before)] == before
    assert len({c["id"] for c in after}) == len(after)


def test_a_file_written_before_an_argument_existed_merges_with_new_captures(tiny_loaded, sample_inputs, tmp_path):
    """Cases without the arguments added since (cast_mode) are the same cases as new ones with their defaults."""
    model, _ = tiny_loaded
    path = tmp_path / "old.json"
    capture(model, sample_inputs).save(path, model_name="tiny")
    doc = json.loads(path.read_text())
    for case in doc["test_cases"]:
        if case["input"].get("cast_mode") == {"value": "hf"}:  # as files written before cast_mode was an argument
            del case["input"]["cast_mode"]
    path.write_text(json.dumps(doc))
    assert load_cases(path)  # still valid: a missing argument is its default
    assert capture(model, sample_inputs).save(path)["added"] == 0


def _hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_hooks_are_removed_on_exit_and_on_exception(tiny_loaded, sample_inputs):
    model, _ = tiny_loaded
    before = _hook_count(model)
    with pytest.raises(RuntimeError, match="boom"):
        with ShapeRecorder(model):
            assert _hook_count(model) > before
            raise RuntimeError("boom")
    assert _hook_count(model) == before
    bad = dict(sample_inputs, pixel_values=sample_inputs["pixel_values"][:, :10])  # generate raises inside
    with pytest.raises(RuntimeError):
        with ShapeRecorder(model):
            model.generate(**bad, max_new_tokens=2)
    assert _hook_count(model) == before


def _write(tmp_path, mutate):
    """The committed file with its first rms_norm case moved to the front and mutated."""
    doc = json.loads(CASE_FILES[0].read_text())
    first = next(c for c in doc["test_cases"] if c["op"] == "rms_norm")
    doc["test_cases"].remove(first)
    doc["test_cases"].insert(0, first)
    mutate(doc["test_cases"][0])
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(doc))
    return p, doc["test_cases"][0].get("id")


def _quant(c):
    """Turn a rms_norm case into a rms_norm_dynamic_quant case (same shapes)."""
    c["op"] = "rms_norm_dynamic_quant"
    c["output"] = {}
    c["input"].pop("cast_mode", None)  # the quant norm has no cast mode


MALFORMED = [  # (mutation, field named, words of the message)
    (lambda c: c["input"]["hidden_states"].update(dtype="bfloat32"), "input.hidden_states.dtype", "unknown dtype"),
    (lambda c: c.pop("seed"), "seed", "missing"),
    (lambda c: c["input"].pop("hidden_states"), "input.hidden_states", "missing"),
    (lambda c: c["input"]["weight"].update(shape=[7]), "input.weight.shape", "gamma: shape (7,) does not match x's D; expected (2048,)"),
    (lambda c: c.update(op="group_norm"), "op", "unknown op"),
    (lambda c: c.update(op=["rms_norm"]), "op", "unknown op ['rms_norm']"),
    (lambda c: c.update(id=["x"]), "id", "expected a non-empty string"),
    (lambda c: c.update(seed=2 ** 70), "seed", "expected an int in [0, 2^64)"),
    (lambda c: c.update(seed=True), "seed", "got True"),
    (lambda c: c.update(description=123), "description", "got 123; expected a string"),
    (lambda c: c["input"]["hidden_states"].update(shape=[True, 64]), "input.hidden_states.shape",
     "expected a list of non-negative ints"),
    (lambda c: c["input"]["hidden_states"].update(shape=[1, 0]), "input.hidden_states.shape", "x: D=0 (shape (1, 0)); expected D >= 1"),
    (lambda c: c["input"].update(eps={"value": float("nan")}), "input.eps.value", "eps: got nan; expected a finite"),
    (lambda c: c["input"].update(eps=1e-6), "input.eps", 'expected {"value": ...}'),
    (lambda c: (_quant(c), c["input"].update(eps={"value": 0})), "input.eps.value", "eps: got 0; expected a finite eps > 0"),
    (lambda c: (_quant(c), c["input"].update(dst_type={"value": "int2"})), "input.dst_type.value", "got 'int2'"),
    (lambda c: (_quant(c), c["input"].update(dst_type="int8")), "input.dst_type", 'expected {"value": ...}'),
    (lambda c: (_quant(c), c["input"].update(dst_type=None)), "input.dst_type", "got None"),
    (lambda c: (_quant(c), c["input"]["weight"].update(dtype="float32")), "input.weight.dtype",
     "gamma: dtype float32 must match x's dtype bfloat16"),
    (lambda c: c["input"].update(eps={"value": 10 ** 400}), "input.eps.value", "eps: got an integer with 401 digits"),
    (lambda c: c.update(rtol="abc"), "rtol", "got 'abc'; expected a finite number >= 0"),
    (lambda c: c.update(atol=-1), "atol", "got -1; expected a finite number >= 0"),
    (lambda c: c.update(count="x"), "count", "got 'x'; expected an int >= 0"),
]


@pytest.mark.parametrize("mutate,field,message", MALFORMED, ids=[f"{i}:{f}" for i, (_, f, _) in enumerate(MALFORMED)])
def test_malformed_case_file_is_refused_with_id_and_field(tmp_path, mutate, field, message):
    path, cid = _write(tmp_path, mutate)
    with pytest.raises(CaseError) as err:
        load_cases(path)
    text = str(err.value)
    assert f"case {cid!r}: field '{field}': " in text and message in text, text


def test_malformed_case_file_through_the_script(tmp_path):
    path, cid = _write(tmp_path, lambda c: c["input"]["weight"].update(shape=[7]))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "run_cases.py"), str(path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "field 'input.weight.shape'" in proc.stderr and cid in proc.stderr


def test_saving_is_atomic_an_interrupted_write_keeps_the_old_file(tiny_loaded, sample_inputs, tmp_path, monkeypatch):
    model, _ = tiny_loaded
    path = tmp_path / "cases.json"
    capture(model, sample_inputs).save(path, model_name="tiny")
    before = path.read_bytes()
    real_write = Path.write_text

    def disk_full(self, *args, **kwargs):
        real_write(self, "{\"test_cases\": [", encoding="utf-8")  # a partial write, then the disk is full
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", disk_full)
    with pytest.raises(OSError, match="No space left"):
        capture(model, sample_inputs).save(path, merge=False)
    monkeypatch.undo()
    assert path.read_bytes() == before and len(load_cases(path)) > 0
    assert [p.name for p in tmp_path.iterdir()] == ["cases.json"]  # no temporary file left behind


class _WrongBackend(registry.Backend):
    name = "wrong"
    devices = ("cpu",)


def _two_percent_off(op):
    def wrong(backend, *args):
        out = op.golden(*args)
        return tuple(t * 1.02 if t is not None and t.is_floating_point() else t for t in out) \
            if isinstance(out, tuple) else out * 1.02
    return wrong


def test_runner_fails_when_a_backend_is_wrong():
    registry.register(_WrongBackend())
    for op in OPS.values():
        op.impl("wrong")(_two_percent_off(op))
    try:
        rows = run_file(ROOT / "tests" / "cases" / "tiny_qwen2_5_vl.json", "wrong", repeat=1)
    finally:
        for op in OPS.values():
            del op.impls["wrong"]
        del registry.BACKENDS["wrong"]
    assert rows and not any(r["passed"] for r in rows)
    assert "MERE" in rows[0]["reason"]
    assert format_table(rows).splitlines()[-1] == f"0 passed, {len(rows)} failed, 0 not run"


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_case_file_written_before_the_op_definitions_still_runs(backend):
    """tests/fixtures/cases_before_op_definitions.json is the tiny model's file as the version before ops/defs
    wrote it (no cast_mode entries, HF argument names): it loads and every case passes."""
    rows = run_file(ROOT / "tests" / "fixtures" / "cases_before_op_definitions.json", backend, repeat=0)
    assert len(rows) == 10 and all(r["passed"] for r in rows), [r["reason"] for r in rows if not r["passed"]]


def test_committed_case_files_exist():
    """GutenOCR-3B's and Qwen3-VL-2B's real dimensions for every fused op, prefill and decode; each first-class
    family's file."""
    names = {p.name for p in CASE_FILES}
    from pypto_gym.models import tiny_families

    assert {f"{f.tiny_dir.name}.json" for f in tiny_families()} | {"gutenocr_3b.json", "gutenocr_3b_w8a8.json",
                                                                    "qwen3_vl_2b.json"} <= names
    guten = load_cases(ROOT / "tests" / "cases" / "gutenocr_3b.json")
    widths = {}
    for c in guten:
        widths.setdefault(c["op"], set()).add(c["args"][0].shape[-1])
    assert widths["rms_norm"] == widths["add_rms_norm"] == {2048, 1280}
    assert widths["swiglu"] == {11008, 3420} and widths["rope"] == {128, 80}  # text and vision head dims
    assert {c["phase"] for c in guten} == {"prefill", "decode"}
    qwen3 = load_cases(ROOT / "tests" / "cases" / "tiny_qwen3.json")
    assert "qk_norm_rope" in {c["op"] for c in qwen3}
    w8a8 = {}
    for c in load_cases(ROOT / "tests" / "cases" / "gutenocr_3b_w8a8.json"):
        w8a8.setdefault(c["op"], set()).add(c["args"][0].shape[-1])
    assert w8a8["dequant_swiglu_quant"] == {2 * 11008, 2 * 3420}  # every MLP: one int32 GEMM -> down_proj's rows
    assert w8a8["dynamic_quant"] == {2048, 1280, 5120}  # o_proj, vision attn.proj, the merger's linears
    qwen3_vl = {}
    for c in load_cases(ROOT / "tests" / "cases" / "qwen3_vl_2b.json"):  # Qwen3-VL-2B's real dimensions
        qwen3_vl.setdefault(c["op"], set()).add(c["args"][0].shape[-1])
    assert qwen3_vl["layer_norm"] == {1024, 4096}  # the blocks' and merger's norms; the DeepStack merger's, shuffled
    assert qwen3_vl["varlen_attention"] == qwen3_vl["rope"] == {64}  # the vision head dim FIA pads to 128
    assert qwen3_vl["qk_norm_rope"] == {128} and qwen3_vl["swiglu"] == {6144} and qwen3_vl["rms_norm"] == {2048}


CASES = [(p, c) for p in CASE_FILES for c in load_cases(p)]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("path,case", CASES, ids=[f"{p.stem}:{c['id']}" for p, c in CASES])
def test_captured_case(path, case, backend):
    row = run_case(case, backend, repeat=0)
    assert row["passed"], row["reason"]
    assert row["backend"] == backend and not row["fallbacks"]


def test_a_file_without_cases_is_refused(tmp_path, capsys):
    from pypto_gym.cli import main

    path = tmp_path / "empty.json"
    path.write_text('{"test_cases": []}')
    assert main(["cases", "run", str(path)]) == 2
    assert "field 'test_cases': the list is empty; expected at least one case" in capsys.readouterr().err


def test_case_ids_are_printed_escaped(tmp_path, capsys):
    from pypto_gym.cli import main

    doc = json.loads(CASE_FILES[0].read_text())
    doc["test_cases"] = doc["test_cases"][:1]
    doc["test_cases"][0]["id"] = "a\x1b[2K\rrms_norm_001 PASS"  # would erase the line and paint a PASS
    path = tmp_path / "ids.json"
    path.write_text(json.dumps(doc))
    main(["cases", "run", str(path), "--repeat", "0"])
    out = capsys.readouterr()
    assert "\x1b" not in out.out + out.err and "\r" not in out.out + out.err
    assert "a\\x1b[2K\\rrms_norm_001 PASS" in out.out


def test_merging_into_a_file_whose_ids_end_in_other_digits(tiny_loaded, sample_inputs, tmp_path):
    model, _ = tiny_loaded
    path = tmp_path / "cases.json"
    capture(model, sample_inputs).save(path, model_name="tiny")
    doc = json.loads(path.read_text())
    doc["test_cases"] = doc["test_cases"][:1]
    doc["test_cases"][0]["id"] = "rms_norm_\u00b2"  # a superscript two: a digit, not an ASCII one
    path.write_text(json.dumps(doc))
    info = capture(model, sample_inputs).save(path)
    ids = [c["id"] for c in json.loads(path.read_text())["test_cases"]]
    assert info["added"] > 0 and len(set(ids)) == len(ids) and ids[0] == "rms_norm_\u00b2"


def _capture_cases():
    import importlib.util

    spec = importlib.util.spec_from_file_location("capture_cases", ROOT / "scripts" / "capture_cases.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REAL_DIMS = ("gutenocr", "qwen3_vl_2b")  # case files captured at a real model's dimensions (random weights)


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.integration) if n.startswith(REAL_DIMS) else n
                                  for n in _capture_cases().RECIPES])
def test_a_committed_case_file_is_what_capture_writes_now(name, tmp_path):
    """tests/cases/*.json are captured, not edited: scripts/capture_cases.py's recipe for each, run now, writes the
    committed file byte for byte (a capture whose sites, counts or arguments changed makes the committed cases
    stale, and this fails until they are captured again). The tiny models' recipes run in command 2; those at real
    dimensions (a minute and more each, the same capture) in CI's second step (`integration`)."""
    from pypto_gym import hardware

    if name.startswith(REAL_DIMS) and not hardware.native_bf16():
        pytest.skip("bf16 captures at real dimensions need native bf16 to run in minutes (AVX512-BF16 or AMX)")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("the committed cases are captured with transformers 5.x (4.57 hands MRoPE over unmerged)")
    _capture_cases().capture(name, tmp_path / name)
    assert (tmp_path / name).read_text() == (ROOT / "tests" / "cases" / name).read_text(), \
        f"tests/cases/{name} is stale: run python scripts/capture_cases.py {name}"
