"""The `npu` backend's mapping onto torch_npu, checked against the documented-signature stand-in.

Not run on hardware: these tests prove the adapter passes the right arguments and maps outputs
and casts onto SPEC 2; they cannot prove torch_npu's numerics or speed.
"""
import sys
from pathlib import Path

import pytest
import torch

from pypto_gym.ops import reference, registry
from pypto_gym.ops.backends.npu import NpuBackend, limits_reason
from pypto_gym.precision import compare_outputs

sys.path.insert(0, str(Path(__file__).parent / "contract"))
import torch_npu_standin  # noqa: E402


@pytest.fixture
def npu():
    backend = NpuBackend(module_name="torch_npu_standin")
    torch_npu_standin.calls.clear()
    return backend


def assert_close(actual, golden, names):
    for c in compare_outputs(actual, golden, names):
        assert c.passed, f"{c.name}: {c.reason}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("cast_mode", ["hf", "fp32"])
@pytest.mark.parametrize("shape", [(64,), (3, 64), (2, 3, 64), (1, 2, 4, 64)])
def test_norms_map_onto_torch_npu(npu, dtype, cast_mode, shape):
    torch.manual_seed(0)
    x1, x2 = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    gammas = (torch.randn(64).to(dtype), torch.randn(64), None) if cast_mode == "hf" else \
        (torch.randn(64).to(dtype), None)
    for g in gammas:
        y = npu.rms_norm(x1, g, 1e-6, cast_mode)
        assert_close(y, reference.rms_norm(x1, g, 1e-6, cast_mode), ("y",))
        out = npu.add_rms_norm(x1, x2, g, 1e-6, cast_mode)
        assert_close(out, reference.add_rms_norm(x1, x2, g, 1e-6, cast_mode), ("y", "x_out"))
    assert torch_npu_standin.calls[:2] == ["npu_rms_norm", "npu_add_rms_norm"]


def test_hf_mode_on_torch_npu_is_bit_identical_to_hf(npu):
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    g = torch.randn(128, dtype=torch.bfloat16)
    assert torch.equal(npu.rms_norm(x, g, 1e-6, "hf"), reference.rms_norm(x, g, 1e-6, "hf"))


@pytest.mark.parametrize("smooth", ["none", "one", "two"])
@pytest.mark.parametrize("with_beta", [False, True])
def test_quant_ops_map_onto_fused_op(npu, smooth, with_beta):
    D = 128
    x1, x2 = torch.randn(2, 5, D, dtype=torch.bfloat16), torch.randn(2, 5, D, dtype=torch.bfloat16)
    g = torch.randn(D, dtype=torch.bfloat16)
    s1 = (torch.rand(D) + 0.5).to(torch.bfloat16) if smooth != "none" else None
    s2 = (torch.rand(D) + 0.5).to(torch.bfloat16) if smooth == "two" else None
    beta = (0.1 * torch.randn(D)).to(torch.bfloat16) if with_beta else None
    out = npu.add_rms_norm_dynamic_quant(x1, x2, g, s1, s2, beta, 1e-6, "int8")
    assert (out[1] is None) == (s2 is None)
    assert_close(out, reference.add_rms_norm_dynamic_quant(x1, x2, g, s1, s2, beta, 1e-6, "int8"),
                 ("y1", "y2", "x_out", "scale1", "scale2"))
    assert_close(npu.rms_norm_dynamic_quant(x1, g, s1, beta, 1e-6, "int8"),
                 reference.rms_norm_dynamic_quant(x1, g, s1, beta, 1e-6, "int8"), ("y", "scale"))


@pytest.mark.parametrize("op,shape,dtype,dst,reason", [
    ("rms_norm", (2, 16384), torch.float32, None, None),
    ("rms_norm_dynamic_quant", (2, 16384), torch.bfloat16, "int8", "D=16384 > 8192"),
    ("add_rms_norm_dynamic_quant", (2, 64), torch.float32, "int8",
     "dtype float32 not supported by npu_add_rms_norm_dynamic_quant"),
    ("rms_norm_dynamic_quant", (2, 64), torch.float16, "int4",
     "dst_type int4 not supported by npu_add_rms_norm_dynamic_quant"),
    ("rms_norm", (1,) * 8 + (64,), torch.float16, None, "rank 9 > 8"),
])
def test_capability_limits(op, shape, dtype, dst, reason):
    assert limits_reason(op, shape, dtype, dst) == reason


def test_fp32_mode_with_a_wider_gamma_is_refused_not_rounded():
    assert limits_reason("rms_norm", (2, 64), torch.bfloat16, None, torch.float32, "fp32") == \
        "cast_mode fp32 with gamma dtype float32 != x dtype bfloat16"
    assert limits_reason("rms_norm", (2, 64), torch.bfloat16, None, torch.float32, "hf") is None


def test_cpu_tensors_are_not_npu_calls():
    stats_reason = registry.get("npu").supports("rms_norm", torch.randn(2, 8))
    assert stats_reason == "device is cpu"
    assert "torch_npu" not in sys.modules  # never imported on a machine without an NPU
