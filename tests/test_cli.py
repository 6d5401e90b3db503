"""The command line on bad input and OS errors: one clear line on stderr, exit 2, never a traceback,
and never after the expensive part (a model load or a generate run) when it could have been before."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pypto_gym.cli import main
from pypto_gym.ops import OPS

ROOT = Path(__file__).resolve().parent.parent
CASES = ROOT / "tests" / "cases" / "tiny_qwen2_5_vl.json"


def run_cli(capsys, *argv):
    t0 = time.perf_counter()
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err, time.perf_counter() - t0


def one_line_error(rc, err, *needles):
    lines = [line for line in err.strip().splitlines() if line.strip() and "Loading weights" not in line]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_run_cases_on_a_directory(capsys, tmp_path):
    rc, _, err, _ = run_cli(capsys, "cases", "run", str(tmp_path))
    one_line_error(rc, err, "is a directory")


def test_run_cases_on_a_symlink_loop(capsys, tmp_path):
    loop = tmp_path / "loop.json"
    loop.symlink_to(loop)
    rc, _, err, _ = run_cli(capsys, "cases", "run", str(loop))
    one_line_error(rc, err, str(loop))


def test_run_cases_on_a_non_utf8_file(capsys, tmp_path):
    bad = tmp_path / "latin1.json"
    bad.write_bytes('{"test_cases": ["caf\xe9"]}'.encode("latin-1"))
    rc, _, err, _ = run_cli(capsys, "cases", "run", str(bad))
    one_line_error(rc, err, "not UTF-8")


@pytest.mark.parametrize("out,needle", [
    ("/proc/pypto_gym_capture.json", "--out: cannot write in /proc"),
    ("{file}/x.json", "is a file, so"),
    ("{dir}", "is a directory"),
])
def test_capture_refuses_an_unwritable_out_before_building_anything(capsys, tmp_path, out, needle):
    afile = tmp_path / "afile"
    afile.write_text("x")
    out = out.format(file=afile, dir=tmp_path)
    rc, stdout, err, seconds = run_cli(capsys, "capture", "--out", out)
    one_line_error(rc, err, needle)
    assert "generate" not in stdout and seconds < 10


@pytest.mark.parametrize("content,needle", [
    ([1, 2], "field 'test_cases': missing or not a list"),
    ({"test_cases": [{"id": "a", "op": "rms_norm", "seed": 1, "output": {}}]}, "case 'a': field 'input': missing"),
])
def test_capture_refuses_to_merge_into_something_that_is_not_a_case_file(capsys, tmp_path, content, needle):
    out = tmp_path / "cases.json"
    out.write_text(json.dumps(content))
    rc, stdout, err, _ = run_cli(capsys, "capture", "--out", str(out))
    one_line_error(rc, err, needle)
    assert "generate" not in stdout and json.loads(out.read_text()) == content  # untouched


@pytest.mark.parametrize("argv,needle", [
    (["--use_pto", "--backend", "gpu"], "--backend: got 'gpu'"),
    (["--device", "cuda"], "--device cuda: no CUDA device"),
    (["--device", "npu"], "--device npu: torch_npu is not installed"),
])
def test_infer_refuses_bad_flags_before_loading(capsys, argv, needle):
    rc, _, err, seconds = run_cli(capsys, "infer", *argv)
    one_line_error(rc, err, needle)
    assert seconds < 10


def test_infer_backend_flag_is_normalised(capsys, monkeypatch):
    from pypto_gym.cli import build_parser
    from pypto_gym.cli.common import patch_options

    options = patch_options(build_parser().parse_args(["infer", "--use_pto", "--backend", " CPU"]))
    assert options["backend"] == "cpu"


def test_a_sites_glob_that_matches_nothing_is_an_error(capsys):
    rc, stdout, err, _ = run_cli(capsys, "infer", "--use_pto", "--sites", "txet.*", "--max-new-tokens", "1")
    one_line_error(rc, err, "--sites: 'txet.*' matched none of the 43 sites", "text.input_layernorm", "text.mlp")
    assert "generated:" not in stdout


def test_a_sites_glob_naming_a_kind_that_needs_another_says_what_it_needs(capsys):
    """`--sites vision.attention` alone "matched none of the 43 sites" while the report lists that kind (issue 45,
    item 13): the vision attention runs inside its vision.rope site's rewrite; the line says so, and selecting both
    patches it."""
    rc, stdout, err, _ = run_cli(capsys, "infer", "--use_pto", "--sites", "vision.attention", "--max-new-tokens", "1")
    one_line_error(rc, err, "--sites: 'vision.attention' selects sites none of which can be patched as selected "
                            "(vision.attention: runs inside its vision.rope site, which sites= does not select "
                            "(add vision.rope))")
    rc, stdout, err, _ = run_cli(capsys, "infer", "--use_pto", "--sites", "vision.attention,vision.rope",
                                 "--max-new-tokens", "1")
    assert rc == 0 and "4/4 vision attention sites patched" in stdout


def test_random_weights_are_refused_for_a_family_that_has_no_builder_naming_those_that_do(capsys, tmp_path):
    rc, stdout, err, _ = run_cli(capsys, "capture", "--config", str(ROOT / "modeling" / "tiny_qwen3" / "config.json"),
                                 "--out", str(tmp_path / "x.json"))
    one_line_error(rc, err, "--config: random weights are built for the qwen2_5_vl, qwen3_vl families, not qwen3")


def test_environment_switches_are_parsed_by_one_rule(monkeypatch):
    from pypto_gym.cli import build_parser
    from pypto_gym.cli.common import patch_options

    parse = lambda *a: build_parser().parse_args(["infer", *a])  # noqa: E731
    assert patch_options(parse()) is None  # USE_PTO_RMS_NORM unset: the scripts do not patch
    for value in ("0", "off", "No", " FALSE "):
        monkeypatch.setenv("USE_PTO_RMS_NORM", value)
        assert patch_options(parse()) is None
    monkeypatch.setenv("USE_PTO_RMS_NORM", "ON")
    monkeypatch.setenv("PYPTO_GYM_BACKEND", " Torch ")
    monkeypatch.setenv("PYPTO_GYM_SITES", "text.*")
    monkeypatch.setenv("PYPTO_GYM_FUSE_RESIDUAL", "off")
    assert patch_options(parse()) == {"backend": "torch", "sites": ("text.*",), "fuse_residual": False,
                                      "quant": None, "calibration": None, "float_linears": None,
                                      "release_float_weights": False, "int8_lm_head": False,
                                      "sites_from": "PYPTO_GYM_SITES"}
    assert patch_options(parse("--backend", "cpu", "--sites", "vision.*")) == \
        {"backend": "cpu", "sites": ("vision.*",), "fuse_residual": False, "quant": None,
         "calibration": None, "float_linears": None, "release_float_weights": False, "int8_lm_head": False,
         "sites_from": "--sites"}  # a flag beats the environment
    monkeypatch.setenv("USE_PTO_RMS_NORM", "0")
    assert patch_options(parse("--use_pto"))["backend"] == "torch"
    monkeypatch.setenv("PYPTO_GYM_BACKEND", "gpu")
    with pytest.raises(ValueError, match="PYPTO_GYM_BACKEND: got 'gpu'"):  # blames the variable, not --backend
        patch_options(parse("--use_pto"))
    monkeypatch.setenv("PYPTO_GYM_FUSE_RESIDUAL", "maybe")
    monkeypatch.setenv("PYPTO_GYM_BACKEND", "cpu")
    with pytest.raises(ValueError, match="PYPTO_GYM_FUSE_RESIDUAL: got 'maybe'"):
        patch_options(parse("--use_pto"))


def test_runner_says_not_run_when_the_backend_did_not_run(capsys):
    rc, stdout, _, _ = run_cli(capsys, "cases", "run", str(CASES), "--backend", "npu", "--repeat", "0", "--quiet")
    assert rc == 1
    lines = stdout.strip().splitlines()
    # an op without an npu mapping says so; every other says why its npu call did not run here
    missing = [f"NOT RUN npu: {op.unsupported['npu']}" for op in OPS.values() if "npu" in op.unsupported]
    assert all("NOT RUN npu: device is cpu" in line or any(m[:60] in line for m in missing) for line in lines[2:-1])
    assert any("NOT RUN npu: device is cpu" in line for line in lines[2:-1])
    assert lines[-1] == f"0 passed, 0 failed, {len(lines) - 3} not run"


def test_a_huge_case_is_refused_before_anything_is_allocated(capsys, tmp_path):
    doc = json.loads(CASES.read_text())
    case = next(c for c in doc["test_cases"] if c["op"] == "rms_norm")
    case["input"]["hidden_states"]["shape"] = [400000, 2048]  # 8e8 elements, ~3 GB as bf16
    path = tmp_path / "huge.json"
    path.write_text(json.dumps(doc))
    rc, _, err, seconds = run_cli(capsys, "cases", "run", str(path), "--repeat", "0")
    one_line_error(rc, err, f"case '{case['id']}': field 'input.hidden_states.shape'", "above the cap of",
                   "--max-elements")
    assert seconds < 10


def test_scripts_are_the_same_commands():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "run_cases.py"), str(ROOT)], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYPTO_GYM_STRICT": "0"})
    assert out.returncode == 2 and "Traceback" not in out.stderr and "is a directory" in out.stderr


@pytest.mark.parametrize("argv,needle", [
    (["cases", "run", str(CASES), "--repeat", "-1"], "argument --repeat: got -1; expected an integer >= 0"),
    (["capture", "--out", "x.json", "--config", "c.json", "--num-layers", "-1"],
     "argument --num-layers: got -1; expected an integer >= 1"),
    (["calibrate", "--out", "x.safetensors", "--num-layers", "0"], "argument --num-layers: got 0; expected an integer"),
    (["bench", "ops", "--rounds", "0"], "argument --rounds: got 0; expected an integer >= 1"),
    (["bench", "gemm", "--rounds", "x"], "argument --rounds: got 'x'; expected an integer >= 1"),
    (["infer", "--max-new-tokens", "0"], "argument --max-new-tokens: got 0; expected an integer >= 1"),
    (["infer", "--max-new-tokens", "-1"], "argument --max-new-tokens: got -1"),
    (["infer", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_numeric_flags_are_checked_before_anything_runs(capsys, argv, needle):
    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and time.perf_counter() - t0 < 5
    one_line_error(2, err, needle)


@pytest.mark.parametrize("content,needle", [
    ('{"test_cases": []}', "the list is empty"),
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
    ('{"test_cases": [{"id": "a", "seed": ' + "9" * 100000 + "}]}", "not a case file"),
])
def test_unreadable_case_files_are_refused_naming_the_file(capsys, tmp_path, content, needle):
    path = tmp_path / "odd.json"
    path.write_text(content)
    for argv in (["cases", "run", str(path)], ["bench", "pypto", str(path), "--json", str(tmp_path / "p.json"),
                                                "--png", str(tmp_path / "p.png")]):
        rc, _, err, _ = run_cli(capsys, *argv)
        one_line_error(rc, err, str(path), needle)


def _sigint_default():
    """In the child: Ctrl-C's default disposition, as a terminal gives it, whatever this runner was started with (a
    suite started in the background, `nohup ... &`, ignores SIGINT and its children inherit that; issue 45, item
    14: the capture then finished with rc 0)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_in_the_first_seconds_of_export_says_nothing_was_written(tmp_path):
    """Ctrl-C while the command starts (parsing, importing torch and transformers, loading) printed a 20-52 line
    KeyboardInterrupt traceback or aborted in torch's C++ initialisers (issue 45, item 12): one line, exit 130, at
    every moment tried."""
    import signal

    tried = 0
    for i, seconds in enumerate((0.2, 0.4, 0.7, 1.0, 1.5, 2.5)):
        out = tmp_path / f"out{i}"
        proc = subprocess.Popen([sys.executable, "-m", "pypto_gym.cli", "export", str(out)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_default)
        time.sleep(seconds)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        lines = [line for line in err.splitlines() if line.strip() and "Loading weights" not in line
                 and "Writing model shards" not in line]
        if proc.returncode == 0:  # finished before the signal (a fast machine): nothing to say about Ctrl-C
            continue
        if "KeyboardInterrupt" in err and "in main" not in err:  # Python still starting, before pypto-gym's main
            continue  # ran (a loaded machine, at 0.2 s): the interpreter's own handler, which no program can replace
        tried += 1
        assert proc.returncode == 130 and lines == ["pypto-gym export: interrupted; nothing written"], (seconds, err)
        assert not out.exists()
    assert tried >= 3  # most moments reached the program


def test_the_parser_imports_neither_torch_nor_transformers():
    """`pypto-gym --help`, a bad flag, and Ctrl-C while parsing need no seconds of imports: building the parser and
    parsing every command's line imports neither."""
    code = ("import sys\nfrom pypto_gym.cli import build_parser\n"
            "for argv in (['export', 'x'], ['cases', 'run', 'f'], ['infer'], ['bench', 'ops'], ['capture', '--out', "
            "'x'], ['calibrate', '--out', 'x']):\n    build_parser().parse_args(argv)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out


def test_a_generation_beyond_the_models_context_is_refused_before_it_starts(capsys):
    """A huge --max-new-tokens was accepted and ran silently for minutes (issue 45, item 17)."""
    rc, stdout, err, seconds = run_cli(capsys, "infer", "--max-new-tokens", "100000000")
    one_line_error(rc, err, "--max-new-tokens: 100,000,000 new tokens after a prompt of", "exceed the model's context "
                   "of 4,096 positions (max_position_embeddings); expected at most")
    assert "generated:" not in stdout and seconds < 30


@pytest.mark.parametrize("command", ["calibrate", "tune"])
def test_a_calibration_out_that_is_not_safetensors_is_refused(capsys, tmp_path, command):
    """calibrate --out x.json wrote a safetensors file named .json without a word (issue 45, item 17)."""
    rc, stdout, err, seconds = run_cli(capsys, command, "--out", str(tmp_path / "x.json"))
    one_line_error(rc, err, "x.json names a .json file; a calibration file is safetensors: expected a name ending in "
                            ".safetensors")
    assert not (tmp_path / "x.json").exists() and seconds < 10


def test_pypto_gym_alone_lists_the_commands(capsys):
    rc = main([])
    err = capsys.readouterr().err
    assert rc == 2 and all(name in err for name in ("infer", "capture", "export", "bench", "make-tiny-model"))


@pytest.mark.parametrize("damage,needle", [
    ("truncated weights", "model.safetensors: not a readable safetensors file"),
    ("no tokenizer files", "has no tokenizer files; expected one of tokenizer.json"),
])
@pytest.mark.parametrize("family", ["qwen3", "qwen2_5_vl"])
@pytest.mark.parametrize("command", [["infer"], ["capture", "--out", "{tmp}/cases.json"], ["export", "{tmp}/out"]])
def test_a_damaged_checkpoint_is_refused_in_one_line_naming_the_file(capsys, tmp_path, damage, needle, family,
                                                                     command):
    """An ordinary checkpoint (not one of our exports) with a truncated weights file gave a 26-29-line
    SafetensorError traceback; one without tokenizer files failed in a reshape or a torch.cat (issue 45, item 11)."""
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(ROOT / "modeling" / f"tiny_{family}", ckpt)
    if damage == "truncated weights":
        with open(ckpt / "model.safetensors", "r+b") as f:
            f.truncate(5000)
    else:
        for f in ckpt.glob("tokenizer*.json"):
            f.unlink()
    argv = [a.format(tmp=tmp_path) for a in command]
    rc, stdout, err, _ = run_cli(capsys, *argv[:1], "--model", str(ckpt), *argv[1:])
    one_line_error(rc, err, needle, str(ckpt))
    assert "generated:" not in stdout


def test_ctrl_c_during_capture_says_nothing_was_written(tmp_path):
    import signal

    out = tmp_path / "cases.json"
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "capture_shapes.py"), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_default)
    for line in proc.stdout:  # interrupt once generate runs
        if "generate" in line:
            break
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert "pypto-gym capture: interrupted; nothing written" in err and not out.exists()


def test_a_bad_pypto_gym_sites_is_blamed_on_the_variable(capsys, monkeypatch):
    monkeypatch.setenv("PYPTO_GYM_SITES", "garbage")
    rc, stdout, err, _ = run_cli(capsys, "infer", "--use_pto", "--max-new-tokens", "1")
    one_line_error(rc, err, "PYPTO_GYM_SITES: 'garbage' matched none of the")
    assert "--sites" not in err and "generated:" not in stdout


@pytest.mark.parametrize("argv,needle", [
    (["--backend", "npu"], "--backend npu: cannot run on cpu (npu: does not run on cpu tensors)"),
])
def test_a_named_backend_that_cannot_run_is_refused_once_before_loading(capsys, argv, needle):
    rc, stdout, err, seconds = run_cli(capsys, "infer", "--use_pto", *argv)
    one_line_error(rc, err, needle, "--allow-fallback")
    assert "generated:" not in stdout and seconds < 10


def test_allow_fallback_runs_on_torch_counted(capsys, lenient):
    with pytest.warns(RuntimeWarning, match="cannot run on cpu") as caught:
        rc, stdout, err, _ = run_cli(capsys, "infer", "--use_pto", "--backend", "npu", "--allow-fallback",
                                     "--max-new-tokens", "2")
    assert rc == 0 and "ran on: torch" in stdout and "npu: device is cpu" in stdout
    assert len(caught) == 1 and "cannot run" not in err  # said once (the warning), not printed besides


@pytest.mark.parametrize("tps,steps,text", [(269.54, 15, "decode 269.5 tokens/s"), (0.04, 3, "decode 25.0 s/token"),
                                            (0.0, 0, "decode n/a (one new token)")])
def test_decode_speed_is_a_figure_that_means_something(tps, steps, text):
    from pypto_gym.cli.common import speed

    assert speed(tps, steps) == text


def test_as_avx2_runs_w8a8_on_the_int16_gemm_under_onednns_avx2_cap():
    """scripts/as_avx2.py: the CPU's AVX-512 / VNNI flags hidden and oneDNN capped at AVX2, where torch._int_mm
    saturates; W8A8 then runs the cpu kernels' own exact GEMM, built for avx2, with no fallback."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "as_avx2.py"), "infer", "--use_pto", "--quant", "w8a8",
                          "--max-new-tokens", "2"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "(kernel level avx2)" in out.stdout and "ONEDNN_MAX_CPU_ISA=AVX2" in out.stdout
    assert "int8 GEMM on this CPU: the cpu kernels' int16 multiply-add GEMM (avx2" in out.stdout
    assert "W8A8: 50/51 linears int8" in out.stdout and "fallbacks=0;" in out.stdout


def test_bench_e2e_refuses_an_int8_checkpoint_it_would_time_decompressed(tmp_path, capsys):
    out = tmp_path / "ct"
    assert main(["export", "--model", str(ROOT / "modeling" / "tiny_qwen3"), str(out)]) == 0
    assert main(["bench", "e2e", "--model", str(out)]) == 2
    assert "is an int8 checkpoint; bench e2e times a float model" in capsys.readouterr().err
