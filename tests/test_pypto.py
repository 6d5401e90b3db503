"""The `pypto` backend: real PyPTO kernels compiled by PyPTO 0.2.0, run by its CPU calculator (SIM)."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("pypto", reason="the pypto extra is not installed (pip install -e '.[pypto]')")

from pypto_gym import ops  # noqa: E402
from pypto_gym.capture import load_cases  # noqa: E402
from pypto_gym.capture.runner import run_case  # noqa: E402
from pypto_gym.ops import reference, registry  # noqa: E402
from pypto_gym.ops.backends import pypto_compat  # noqa: E402
from pypto_gym.precision import compare_outputs  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CASES = [(p, c) for p in sorted((ROOT / "tests" / "cases").glob("*.json")) for c in load_cases(p)]


def assert_close(actual, golden, names):
    for c in compare_outputs(actual, golden, names):
        assert c.passed, f"{c.name}: {c.reason}"


def test_adaptation_checks_the_installed_version(monkeypatch):
    assert pypto_compat.check_version() == "0.2.0"
    monkeypatch.setattr(pypto_compat, "installed_version", lambda: "0.3.0")
    with pytest.raises(pypto_compat.PyptoVersionError, match="pypto 0.3.0 installed; .* for 0.2.0"):
        pypto_compat.check_version()


def test_adapted_internals_still_exist():
    """Fails loudly if PyPTO moves what pypto_compat replaces."""
    from pypto import _utils, pypto_impl
    from pypto.frontend.parser import entry

    assert callable(entry.JitCallableWrapper._setup_verify_data)
    assert callable(_utils.BuildOnlineManager.build_and_load_calculator)
    assert callable(pypto_impl.SetVerifyData)
    assert (Path(_utils.BuildOnlineManager().pkg_lib_dir) / "calculator").is_dir()


@pytest.mark.parametrize("path,case", CASES, ids=[f"{p.stem}:{c['id']}" for p, c in CASES])
def test_captured_cases_on_pypto(path, case):
    row = run_case(case, "pypto", repeat=0)
    assert row["passed"], row["reason"]
    assert row["backend"] == "pypto" and not row["fallbacks"]
    assert row["est_npu_us"] > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_norm_ops_all_dtypes_and_modes(dtype):
    torch.manual_seed(0)
    x1 = torch.randn(2, 3, 4, 64).to(dtype)  # rank 4, like a q/k-norm input
    x2 = torch.randn(2, 3, 4, 64).to(dtype)
    g = torch.randn(64).to(dtype)
    g32 = torch.randn(64)
    for cast_mode in ("hf", "fp32"):
        assert_close(ops.rms_norm(x1, g, cast_mode=cast_mode, backend="pypto"),
                     reference.rms_norm(x1, g, cast_mode=cast_mode), ("y",))
        assert_close(ops.add_rms_norm(x1, x2, g, cast_mode=cast_mode, backend="pypto"),
                     reference.add_rms_norm(x1, x2, g, cast_mode=cast_mode), ("y", "x_out"))
    hf32 = ops.rms_norm(x1, g32, backend="pypto")  # fp32 weight promotes the output, as HF does
    assert hf32.dtype == torch.promote_types(dtype, torch.float32)
    assert_close(hf32, reference.rms_norm(x1, g32), ("y",))
    assert_close(ops.rms_norm(x1, None, backend="pypto"), reference.rms_norm(x1), ("y",))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("dst_type", ["int8", "int4"])
@pytest.mark.parametrize("variant", ["plain", "smooth_beta", "two_smooth"])
def test_quant_ops(dtype, dst_type, variant):
    torch.manual_seed(1)
    D = 128
    x1, x2 = torch.randn(5, D).to(dtype), torch.randn(5, D).to(dtype)
    x1[3] = 0
    g = torch.randn(D).to(dtype)
    s1 = (torch.rand(D) + 0.5).to(dtype) if variant != "plain" else None
    s2 = (torch.rand(D) + 0.5).to(dtype) if variant == "two_smooth" else None
    beta = (0.1 * torch.randn(D)).to(dtype) if variant == "smooth_beta" else None
    assert_close(ops.rms_norm_dynamic_quant(x1, g, s1, beta, dst_type=dst_type, backend="pypto"),
                 reference.rms_norm_dynamic_quant(x1, g, s1, beta, dst_type=dst_type), ("y", "scale"))
    assert_close(ops.add_rms_norm_dynamic_quant(x1, x2, g, s1, s2, beta, dst_type=dst_type, backend="pypto"),
                 reference.add_rms_norm_dynamic_quant(x1, x2, g, s1, s2, beta, dst_type=dst_type),
                 ("y1", "y2", "x_out", "scale1", "scale2"))


def test_too_wide_rows_fall_back_with_reason(lenient):
    stats = ops.Stats()
    x = torch.randn(2, 20000)
    y = ops.rms_norm(x, None, backend="pypto", stats=stats)
    assert torch.equal(y, reference.rms_norm(x))
    assert list(stats.fallbacks) == ["pypto: D=20000: one fp32 row does not fit the 192 KB unified buffer"]


def test_unaligned_rows_fall_back_with_reason(lenient):
    stats = ops.Stats()
    x = torch.randn(3, 7)
    assert torch.equal(ops.rms_norm(x, None, backend="pypto", stats=stats), reference.rms_norm(x))
    assert list(stats.fallbacks) == ["pypto: D=7 is not a multiple of 8 (PyPTO needs 32-byte aligned fp32 rows)"]


def test_empty_input_needs_no_kernel():
    y = ops.rms_norm(torch.randn(0, 64, dtype=torch.bfloat16), None, backend="pypto")
    assert y.shape == (0, 64)


def test_a_failed_compile_does_not_break_later_calls():
    """In a fresh process: force a compile error, then the next calls still give the right answer."""
    script = (
        "import torch, warnings\n"
        "from pypto_gym import ops\n"
        "from pypto_gym.ops import reference, registry\n"
        "b = registry.get('pypto')\n"
        "x = torch.randn(4, 64)\n"
        "try:\n"
        "    b._launch('rms_norm', x, [x, torch.randn(1, 68), torch.empty(4, 64)], [1e-6, 1 / 64, True])\n"
        "except Exception as e:\n"
        "    print('compile failed as intended:', type(e).__name__)\n"
        "stats = ops.Stats()\n"
        "y = ops.rms_norm(x, torch.randn(64), backend='pypto', stats=stats)\n"
        "assert y.shape == x.shape and torch.isfinite(y).all()\n"
        "print('fallbacks:', dict(stats.fallbacks))\n"
    )
    import os

    env = dict(os.environ, PYPTO_GYM_STRICT="0")  # this test is about the fallback
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "compile failed as intended" in proc.stdout
    assert "pypto: disabled after a kernel compile error in this process" in proc.stdout


def test_importing_pypto_leaves_the_root_logger_alone():
    import logging

    pypto_compat.apply()
    root = logging.getLogger()
    before = (root.level, list(root.handlers))
    pypto_compat.import_pypto()
    assert (root.level, list(root.handlers)) == before
    assert root.level != logging.DEBUG or before[0] == logging.DEBUG


def test_cast_modes_compile_to_different_kernels():
    """The mode is a compile-time constant of one kernel: each mode must match its own golden exactly."""
    torch.manual_seed(0)
    x, g = torch.randn(4, 64).bfloat16(), torch.randn(64).bfloat16()
    hf = ops.rms_norm(x, g, cast_mode="hf", backend="pypto")
    fp32 = ops.rms_norm(x, g, cast_mode="fp32", backend="pypto")
    assert torch.equal(hf, reference.rms_norm(x, g, cast_mode="hf"))
    assert torch.equal(fp32, reference.rms_norm(x, g, cast_mode="fp32"))
    assert not torch.equal(hf, fp32)


def test_unfused_baseline_add_for_benchmarks():
    backend = registry.get("pypto")
    x1, x2 = torch.randn(3, 64).bfloat16(), torch.randn(3, 64).bfloat16()
    assert torch.equal(backend.residual_add(x1, x2), x1 + x2)
    assert backend.last_estimated_us > 0
