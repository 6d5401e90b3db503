"""The `npu` backend's mapping onto torch_npu, checked against the documented-signature stand-in.

Not run on hardware: these tests prove the adapter passes the right arguments, respects the
documented limits and maps outputs, layouts and casts onto SPEC 2; they cannot prove torch_npu's
numerics or speed.
"""
import sys
from pathlib import Path

import pytest
import torch

from pypto_gym.ops import OPS, registry
from pypto_gym.kernels.npu.backend import NpuBackend, chip_series
from pypto_gym.ops.quantize import pack_int4_to_int32, unpack_int4_from_int32

from support import assert_close, compare_outputs

sys.path.insert(0, str(Path(__file__).parent / "contract"))
import torch_npu_standin  # noqa: E402

QUANT = OPS["add_rms_norm_dynamic_quant"].outputs
NPU_OPS = [op for op in OPS.values() if "npu" in op.impls]


class Npu:
    """The npu implementations of every op, on a backend whose torch_npu is the stand-in: `npu.<op>(*args)`
    runs the op's npu implementation, `npu.supports(op, *args)` its documented-limits predicate."""

    def __init__(self, backend):
        self.backend = backend

    def __getattr__(self, name):
        return lambda *args: OPS[name].impls["npu"].fn(self.backend, *args)

    def supports(self, name, *args):
        impl = OPS[name].impls["npu"]
        return impl.supports(self.backend, *args) if impl.supports else None


@pytest.fixture
def npu(monkeypatch):
    monkeypatch.setattr(torch_npu_standin, "DEVICE_NAME", "Ascend910B2")
    torch_npu_standin.calls.clear()
    return Npu(NpuBackend(module_name="torch_npu_standin"))


@pytest.mark.parametrize("example", range(4))
@pytest.mark.parametrize("op", NPU_OPS, ids=lambda op: op.name)
def test_every_npu_mapping_follows_the_golden_where_its_limits_allow(npu, op, example):
    """Every op's torch_npu mapping, on each of its examples: within precision of the golden, or refused by
    a documented limit (and then the stand-in, torch_npu's documented signature, refuses it too)."""
    if example >= len(op.examples):
        pytest.skip("no such example")
    args = op.example_args(op.examples[example])
    reason = npu.supports(op.name, *args)
    if reason is None:
        assert_close(getattr(npu, op.name)(*args), op.golden(*args), op.outputs)
    else:
        assert reason and isinstance(reason, str)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("cast_mode", ["hf", "fp32"])
@pytest.mark.parametrize("shape", [(64,), (3, 64), (2, 3, 64), (1, 2, 4, 64)])
def test_norms_map_onto_torch_npu(npu, dtype, cast_mode, shape):
    torch.manual_seed(0)
    x1, x2 = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    gammas = [torch.randn(64).to(dtype), None]
    if cast_mode == "hf" or dtype != torch.float32:
        gammas.append(torch.randn(64))  # fp32 gamma: HF promotion (hf), or a documented npu_rms_norm pair (fp32)
    for g in gammas:
        y = npu.rms_norm(x1, g, 1e-6, cast_mode)
        assert_close(y, OPS["rms_norm"].golden(x1, g, 1e-6, cast_mode), ("y",))
        if g is None or g.dtype == dtype or cast_mode == "hf":
            for norm_input in ("rounded", "fp32_sum"):  # fp32_sum: npu_rms_norm of the fp32 sum
                out = npu.add_rms_norm(x1, x2, g, 1e-6, cast_mode, norm_input)
                assert_close(out, OPS["add_rms_norm"].golden(x1, x2, g, 1e-6, cast_mode, norm_input), ("y", "x_out"))
    assert torch_npu_standin.calls[:2] == ["npu_rms_norm", "npu_add_rms_norm"]


def test_hf_mode_on_torch_npu_is_bit_identical_to_hf(npu):
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    g = torch.randn(128, dtype=torch.bfloat16)
    assert torch.equal(npu.rms_norm(x, g, 1e-6, "hf"), OPS["rms_norm"].golden(x, g, 1e-6, "hf"))


@pytest.mark.parametrize("dst_type", ["int8", "int4"])
@pytest.mark.parametrize("smooth", ["none", "one", "two"])
@pytest.mark.parametrize("with_beta", [False, True])
def test_quant_ops_map_onto_the_fused_op(npu, dst_type, smooth, with_beta):
    D = 128
    x1, x2 = torch.randn(2, 5, D, dtype=torch.bfloat16), torch.randn(2, 5, D, dtype=torch.bfloat16)
    g = torch.randn(D, dtype=torch.bfloat16)
    s1 = (torch.rand(D) + 0.5).to(torch.bfloat16) if smooth != "none" else None
    s2 = (torch.rand(D) + 0.5).to(torch.bfloat16) if smooth == "two" else None
    beta = (0.1 * torch.randn(D)).to(torch.bfloat16) if with_beta else None
    out = npu.add_rms_norm_dynamic_quant(x1, x2, g, s1, s2, beta, 1e-6, dst_type)
    assert (out[1] is None) == (s2 is None) and out[0].dtype == torch.int8 and out[0].shape == x1.shape
    assert_close(out, OPS["add_rms_norm_dynamic_quant"].golden(x1, x2, g, s1, s2, beta, 1e-6, dst_type), QUANT)
    assert_close(npu.rms_norm_dynamic_quant(x1, g, s1, beta, 1e-6, dst_type),
                 OPS["rms_norm_dynamic_quant"].golden(x1, g, s1, beta, 1e-6, dst_type),
                 OPS["rms_norm_dynamic_quant"].outputs)


def test_int4_packing_round_trips_and_puts_code_j_in_bits_4j():
    q = torch.randint(-8, 8, (3, 16), dtype=torch.int8)
    packed = pack_int4_to_int32(q)
    assert packed.dtype == torch.int32 and packed.shape == (3, 2)
    assert torch.equal(unpack_int4_from_int32(packed), q)
    one = torch.zeros(1, 8, dtype=torch.int8)
    one[0, 1] = 3
    one[0, 7] = -1
    assert int(pack_int4_to_int32(one)) == (3 << 4) | (0xF << 28) - 2 ** 32


@pytest.mark.parametrize("op,shape,dtype,kwargs,reason", [
    ("quant", (2, 16384), torch.bfloat16, {"dst_type": "int8"}, None),  # no D limit is documented
    ("quant", (2, 64), torch.float32, {"dst_type": "int8"},
     "dtype float32 not supported by npu_add_rms_norm_dynamic_quant"),
    ("quant", (2, 60), torch.float16, {"dst_type": "int4"}, "int4 needs D divisible by 8, got D=60"),
    ("quant", (0, 64), torch.float16, {"dst_type": "int8"}, "empty tensors are not supported"),
    ("add_rms_norm", (0, 64), torch.float16, {}, "npu_add_rms_norm: empty tensors are not supported"),
    ("rms_norm", (0, 64), torch.float16, {}, None),  # npu_rms_norm documents empty tensors as supported
    ("rms_norm", (1,) * 8 + (64,), torch.float16, {}, "rank 9 > 8"),
    ("rms_norm", (2, 64), torch.bfloat16, {"gamma_dtype": torch.float32, "cast_mode": "fp32"}, None),
    ("rms_norm", (2, 64), torch.bfloat16, {"gamma_dtype": torch.float16, "cast_mode": "fp32"},
     "x bfloat16 with gamma float16 is not a documented pair"),
    ("add_rms_norm", (2, 64), torch.bfloat16, {"gamma_dtype": torch.float32, "cast_mode": "fp32"},
     "npu_add_rms_norm: gamma dtype float32 must equal x's bfloat16"),
    ("rms_norm", (2, 64), torch.float16, {"cast_mode": "none"}, "cast_mode none"),
    ("add_rms_norm", (2, 64), torch.bfloat16, {"series": "Ascend310P3"},
     "npu_add_rms_norm: bfloat16 not supported on Atlas inference series chips"),
    ("rms_norm", (2, 64), torch.bfloat16, {"series": "Ascend310P3"}, "not a documented pair on inference chips"),
    ("quant", (2, 64), torch.float16, {"series": "Ascend310P3", "dst_type": "int8"}, "Atlas A2/A3 chips only"),
])
def test_documented_limits(npu, monkeypatch, op, shape, dtype, kwargs, reason):
    if "series" in kwargs:
        monkeypatch.setattr(torch_npu_standin, "DEVICE_NAME", kwargs["series"])
        npu = Npu(NpuBackend(module_name="torch_npu_standin"))
    x = torch.zeros(shape, dtype=dtype)
    g = torch.zeros(shape[-1], dtype=kwargs.get("gamma_dtype", dtype))
    if op == "quant":
        args = ("add_rms_norm_dynamic_quant", x, x, g.to(dtype), None, None, None, 1e-6, kwargs["dst_type"])
    elif op == "add_rms_norm":
        args = (op, x, x, g, 1e-6, kwargs.get("cast_mode", "hf"), "rounded")
    else:
        args = (op, x, g, 1e-6, kwargs.get("cast_mode", "hf"))
    got = npu.supports(*args)
    assert (got is None) if reason is None else (reason in got), got


def test_layer_norm_is_declined_where_aclnnlayernorm_is_not_documented(npu, monkeypatch):
    """layer_norm maps onto F.layer_norm on the NPU (aclnnLayerNorm, registered by torch_npu): its page lists Atlas A2/A3
    and the training series, not the Atlas inference series (Ascend310P), which the mapping declines."""
    x, g = torch.zeros(2, 64, dtype=torch.float16), torch.ones(64, dtype=torch.float16)
    assert npu.supports("layer_norm", x, g, g, 1e-6) is None
    monkeypatch.setattr(torch_npu_standin, "DEVICE_NAME", "Ascend310P3")
    inference = Npu(NpuBackend(module_name="torch_npu_standin"))
    assert "not supported on Atlas inference series" in inference.supports("layer_norm", x, g, g, 1e-6)


@pytest.mark.parametrize("name,series", [("Ascend910B2", "a2_a3"), ("Ascend910_9391", "a2_a3"),
                                         ("Ascend310P3", "inference"), ("Ascend910A", "training")])
def test_chip_series(name, series):
    assert chip_series(name) == series


def test_a_chip_without_bf16_is_read_from_the_device(monkeypatch):
    monkeypatch.setattr(torch_npu_standin, "DEVICE_NAME", "Ascend310P3")
    fresh = NpuBackend(module_name="torch_npu_standin")
    assert fresh.series(0) == "inference"


def test_masked_second_branch_is_empty_not_zeros(npu):
    x = torch.randn(2, 16, dtype=torch.float16)
    out = torch_npu_standin.npu_add_rms_norm_dynamic_quant(x, x, torch.ones(16, dtype=torch.float16),
                                                           output_mask=[True, False])
    assert out[1].numel() == 0 and out[4].numel() == 0
    with pytest.raises(RuntimeError, match="output_mask"):
        torch_npu_standin.npu_add_rms_norm_dynamic_quant(x, x, torch.ones(16, dtype=torch.float16),
                                                         output_mask=[False, False])


def test_cpu_tensors_are_not_npu_calls():
    from pypto_gym.ops.dispatch import why_not

    assert why_not(OPS["rms_norm"], registry.get("npu"), (torch.randn(2, 8), None, 1e-6, "hf")) == "device is cpu"
    assert "torch_npu" not in sys.modules  # never imported on a machine without an NPU


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1, 64), (5, 64), (2, 3, 64)])
def test_quant_matmul_maps_onto_npu_quant_matmul(npu, out_dtype, shape):
    gen = torch.Generator().manual_seed(0)
    x_q = torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)
    w_q = torch.randint(-128, 128, (24, 64), generator=gen, dtype=torch.int8)
    x_scale, w_scale = torch.rand(shape[:-1], generator=gen), torch.rand(24, generator=gen) * 1e-3
    for bias in (None, torch.randn(24, generator=gen).to(out_dtype), torch.randn(24, generator=gen)):
        args = (x_q, w_q, x_scale, w_scale, bias, out_dtype)
        assert npu.supports("quant_matmul", *args) is None
        y = npu.quant_matmul(*args)
        assert y.shape == (*shape[:-1], 24) and y.dtype == out_dtype
        assert_close(y, OPS["quant_matmul"].golden(*args), ("y",))
    assert torch_npu_standin.calls[-1] == "npu_quant_matmul"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("offset", [None, torch.tensor([7.0]), torch.tensor([-3], dtype=torch.int8)], ids=str)
def test_static_quant_ops_map_onto_npu_add_rms_norm_quant_and_npu_quantize(npu, dtype, offset):
    """msModelSlim's static chain on torch_npu: bit-equal to the golden where the scale is exact in x's dtype (what a
    checkpoint stores), the offset's sign and the division (div_mode=True) as the golden has them."""
    gen = torch.Generator().manual_seed(0)
    x1, x2 = (torch.randn(3, 5, 64, generator=gen).to(dtype) for _ in range(2))
    gamma, beta = (1 + 0.1 * torch.randn(64, generator=gen)).to(dtype), (0.1 * torch.randn(64, generator=gen)).to(dtype)
    scale = torch.tensor([0.02734375], dtype=dtype)  # exact in fp16 and bf16
    for b in (None, beta):
        y, x_out = npu.add_rms_norm_quant(x1, x2, gamma, scale, offset, b, 1e-6)
        want_y, want_x = OPS["add_rms_norm_quant"].golden(x1, x2, gamma, scale, offset, b, 1e-6)
        assert torch.equal(y, want_y) and torch.equal(x_out, want_x) and y.dtype == torch.int8
        assert torch.equal(npu.rms_norm_quant(x1, gamma, scale, offset, b, 1e-6),
                           OPS["rms_norm_quant"].golden(x1, gamma, scale, offset, b, 1e-6))
    assert torch_npu_standin.calls[-1] == "npu_add_rms_norm_quant"
    assert torch.equal(npu.static_quant(x1 * 3, scale, offset, None),
                       OPS["static_quant"].golden(x1 * 3, scale, offset))
    assert torch_npu_standin.calls[-1] == "npu_quantize"


def test_static_quant_limits_are_the_documented_ones(npu, monkeypatch):
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    inexact = torch.tensor([0.1])  # fp32 0.1 is not a bf16 value: the bf16 norm op would round the scale
    assert "scale float32 is not exact in the bfloat16 it takes" in npu.supports(
        "rms_norm_quant", x, torch.ones(8, dtype=torch.bfloat16), inexact, None, None, 1e-6)
    # npu_quantize takes float32 scales and int32 zero points (div_mode=True): 0.1 is exact there, 0.3 is no zero point
    assert npu.supports("static_quant", x, inexact, None, None) is None
    assert "offset float32 is not exact in the int32 it takes" in npu.supports("static_quant", x, torch.tensor([0.5]),
                                                                               torch.tensor([0.3]), None)
    assert "float32 not supported" in npu.supports("rms_norm_quant", x.float(), torch.ones(8), torch.tensor([0.5]),
                                                   None, None, 1e-6)
    assert npu.supports("static_quant", x, torch.tensor([0.5]), torch.tensor([3], dtype=torch.int8), None) is None
    assert "no smooth scale" in npu.supports("static_quant", x, torch.tensor([0.5]), None, torch.ones(8))
    monkeypatch.setattr(torch_npu_standin, "DEVICE_NAME", "Ascend310P3")
    inference = Npu(NpuBackend(module_name="torch_npu_standin"))
    assert "A2/A3" in inference.supports("static_quant", x, torch.tensor([0.5]), None, None)
    assert inference.supports("static_quant", x.half(), torch.tensor([0.5]), None, None) is None


def test_the_static_quant_calls_take_the_documented_dtypes(npu, monkeypatch):
    """torch_npu-npu_add_rms_norm_quant.md's table gives fp16 x float32 scales1 and int32 zero_points1 (bf16 x all
    bfloat16); torch_npu-npu_quantize.md gives div_mode=True float32 (bfloat16 on A2/A3) scales and int8/uint8/int32
    zero points: an fp16 scale or zero point the hardware refuses was passed for both (issue 47). The stand-in refuses
    the old calls, the mapping makes the documented ones, and on Atlas inference series chips a last dim below 32 is
    declined by the op's predicate before the stand-in refuses it."""
    x = torch.randn(4, 64, dtype=torch.float16)
    g = torch.ones(64, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="scales1 torch.float16 .* the documented table has torch.float32"):
        torch_npu_standin.npu_add_rms_norm_quant(x, x, g, torch.full((64,), 0.5, dtype=torch.float16),
                                                 torch.zeros(64, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="npu_quantize: scales torch.float16 with div_mode=True"):
        torch_npu_standin.npu_quantize(x, torch.full((64,), 0.5, dtype=torch.float16), None, torch.qint8, -1, True)
    with pytest.raises(RuntimeError, match="npu_quantize: zero_points torch.float16 with div_mode=True"):
        torch_npu_standin.npu_quantize(x, torch.full((64,), 0.5), torch.zeros(64, dtype=torch.float16), torch.qint8,
                                       -1, True)
    scale, offset = torch.tensor([0.1]), torch.tensor([-3.0])  # 0.1: fp32, not an fp16 value; exact as float32
    for dtype in (torch.float16, torch.bfloat16):
        xd = x.to(dtype)
        want = OPS["static_quant"].golden(xd, scale, offset)
        assert torch.equal(npu.static_quant(xd, scale, offset, None), want)
    y, _ = npu.add_rms_norm_quant(x, x, g, scale, offset, None, 1e-6)
    assert torch.equal(y, OPS["add_rms_norm_quant"].golden(x, x, g, scale, offset, None, 1e-6)[0])
    monkeypatch.setattr(torch_npu_standin, "DEVICE_NAME", "Ascend310P3")
    inference = Npu(NpuBackend(module_name="torch_npu_standin"))
    short = torch.randn(4, 16, dtype=torch.float16)
    assert "last dim 16 < 32 on inference chips" in inference.supports(
        "rms_norm_quant", short, torch.ones(16, dtype=torch.float16), scale, offset, None, 1e-6)
    with pytest.raises(RuntimeError, match="last dim 16 < 32 on Atlas inference series"):
        torch_npu_standin.npu_add_rms_norm_quant(short, short, torch.ones(16, dtype=torch.float16),
                                                 torch.full((16,), 0.5), torch.zeros(16, dtype=torch.int32))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_quant_matmul_static_maps_onto_npu_quant_matmul_with_an_int32_bias(npu, out_dtype):
    """The static linear: deq_scale fp32 for bf16 output, through npu_trans_quant_param (int64) for fp16; the int32
    quant_bias added before dequantisation; bit-equal to the golden."""
    gen = torch.Generator().manual_seed(1)
    x_q = torch.randint(-128, 128, (2, 3, 64), generator=gen, dtype=torch.int8)
    w_q = torch.randint(-128, 128, (24, 64), generator=gen, dtype=torch.int8)
    deq = torch.rand(24, generator=gen) * 1e-4
    op = OPS["quant_matmul_static"]
    for bias in (None, torch.randint(-2 ** 20, 2 ** 20, (24,), generator=gen, dtype=torch.int32)):
        args = (x_q, w_q, deq, bias, out_dtype)
        assert npu.supports("quant_matmul_static", *args) is None
        got = npu.quant_matmul_static(*args)
        if out_dtype == torch.bfloat16:
            assert torch.equal(got, op.golden(*args))
        else:  # the hardware's scale is deq_scale rounded to 19 bits (npu_trans_quant_param, round_mode=1)
            assert torch.equal(got, op.golden(x_q, w_q, torch_npu_standin.trans_quant_scale(deq, 1), bias, out_dtype))
            assert_close(got, op.golden(*args), op.outputs)
    assert torch_npu_standin.calls[-2:] == (["npu_trans_quant_param", "npu_quant_matmul"]
                                           if out_dtype == torch.float16 else ["npu_quant_matmul"] * 2)
    assert "float32" in npu.supports("quant_matmul_static", x_q, w_q, deq, None, torch.float32)


@pytest.mark.parametrize("chip", ["Ascend910B2", "Ascend310P3"])
def test_int8_weights_go_in_the_nz_format_made_once_per_weight_version(npu, monkeypatch, chip):
    """torch_npu-npu_quant_matmul.md (约束说明): x2 in the NZ format through npu_format_cast (29), on A2/A3 the [k, n]
    weight untransposed (recommended), on the inference series the [n, k] weight cast and passed transposed
    (required). It was a transposed ND view per call (issue 47); now one cast per weight, again after an in-place
    update, and the results stay the golden's."""
    monkeypatch.setattr(torch_npu_standin, "DEVICE_NAME", chip)
    backend = Npu(NpuBackend(module_name="torch_npu_standin"))
    gen = torch.Generator().manual_seed(2)
    x_q = torch.randint(-128, 128, (3, 64), generator=gen, dtype=torch.int8)
    w_q = torch.randint(-128, 128, (24, 64), generator=gen, dtype=torch.int8)
    deq = torch.rand(24, generator=gen) * 1e-4
    sent, real = [], torch_npu_standin.npu_quant_matmul
    monkeypatch.setattr(torch_npu_standin, "npu_quant_matmul", lambda x1, x2, *a, **k: sent.append(x2) or
                        real(x1, x2, *a, **k))
    op = OPS["quant_matmul_static"]
    for _ in range(3):
        got = backend.quant_matmul_static(x_q, w_q, deq, None, torch.float16)
        assert_close(got, op.golden(x_q, w_q, deq, None, torch.float16), op.outputs)
    assert torch_npu_standin.calls.count("npu_format_cast") == 1
    assert all(torch_npu_standin.format_of(x2) == "FRACTAL_NZ" for x2 in sent)
    assert all(x2.is_contiguous() == (chip == "Ascend910B2") for x2 in sent)
    w_q[0, 0] = -w_q[0, 0] - 1  # an in-place update: cast again
    got = backend.quant_matmul_static(x_q, w_q, deq, None, torch.float16)
    assert torch_npu_standin.calls.count("npu_format_cast") == 2
    assert_close(got, op.golden(x_q, w_q, deq, None, torch.float16), op.outputs)
    nd_view = torch_npu_standin.npu_format_cast(w_q.contiguous(), 29)
    if chip == "Ascend310P3":  # the stand-in refuses an NZ x2 cast untransposed on the inference series
        with pytest.raises(RuntimeError, match="passed transposed on Atlas inference series"):
            real(x_q, torch_npu_standin.npu_format_cast(w_q.t().contiguous(), 29),
                 torch_npu_standin.npu_trans_quant_param(deq), output_dtype=torch.float16)
    assert torch_npu_standin.format_of(nd_view.t()) == "FRACTAL_NZ" and torch_npu_standin.format_of(w_q) == "ND"


def test_npu_trans_quant_param_keeps_the_scales_upper_19_bits_as_documented():
    """torch_npu-npu_trans_quant_param.md: out = (scale & 0xFFFFE000) | (1 << 46), the scale first rounded to those
    19 bits with round_mode=1. The stand-in kept all 32 bits, so the contract test's fp16 bit-equality was its own
    artefact (issue 47): worked examples of both modes, and the mapping asks for the rounding."""
    one_plus = torch.tensor([1.0 + 2 ** -11 + 2 ** -13], dtype=torch.float32)  # above the halfway point of 2^-10
    assert float(torch_npu_standin.trans_quant_scale(one_plus, 0)) == 1.0  # truncated
    assert float(torch_npu_standin.trans_quant_scale(one_plus, 1)) == 1.0 + 2 ** -10  # rounded up
    exact = torch.tensor([0.75])
    out = torch_npu_standin.npu_trans_quant_param(exact, round_mode=1)
    assert int(out) == (0x3F400000 | (1 << 46))
    from pypto_gym.kernels.npu.quant_matmul import TRANS_QUANT_ROUND

    assert TRANS_QUANT_ROUND == 1


def test_quant_matmul_limits_are_the_documented_ones(npu, monkeypatch):
    x_q, w_q = torch.zeros(2, 8, dtype=torch.int8), torch.zeros(4, 8, dtype=torch.int8)
    ones = (torch.ones(2), torch.ones(4))
    assert npu.supports("quant_matmul", x_q, w_q, *ones, None, torch.bfloat16) is None
    assert "output_dtype float32" in npu.supports("quant_matmul", x_q, w_q, *ones, None, torch.float32)
    assert "empty" in npu.supports("quant_matmul", x_q[:0], w_q, torch.ones(0), ones[1], None, torch.bfloat16)
    # a float bias of any dtype goes in as float32, which both documented output rows take
    assert npu.supports("quant_matmul", x_q, w_q, *ones, torch.zeros(4).half(), torch.bfloat16) is None
    with pytest.raises(RuntimeError, match="bias torch.float16 \\[n\\] with output torch.float16 is not a documented"):
        torch_npu_standin.npu_quant_matmul(x_q, w_q.t(), torch.ones(4), pertoken_scale=torch.ones(2),
                                           bias=torch.zeros(4).half(), output_dtype=torch.float16)
    wide = torch.zeros(2, 65536, dtype=torch.int8)
    assert "K = 65536 above the documented last-dim limit of 65535" in npu.supports(
        "quant_matmul", wide, torch.zeros(4, 65536, dtype=torch.int8), *ones, None, torch.bfloat16)
    # what the adapter refuses, the stand-in (torch_npu's documented rows) refuses too
    with pytest.raises(RuntimeError, match="documented pertoken rows"):
        torch_npu_standin.npu_quant_matmul(x_q, w_q.t(), torch.ones(4), pertoken_scale=torch.ones(2),
                                           output_dtype=torch.float32)
    monkeypatch.setattr(torch_npu_standin, "DEVICE_NAME", "Ascend310P3")
    inference = Npu(NpuBackend(module_name="torch_npu_standin"))
    assert "pertoken_scale is not supported on inference" in inference.supports("quant_matmul", x_q, w_q, *ones,
                                                                                None, torch.float16)
    with pytest.raises(RuntimeError, match="pertoken_scale is not supported"):
        torch_npu_standin.npu_quant_matmul(x_q, w_q.t(), torch.ones(4), pertoken_scale=torch.ones(2),
                                           output_dtype=torch.float16)


@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
def test_an_n_above_the_last_dim_limit_runs_as_column_blocks(npu, static):
    """npu_quant_matmul's last dims may not exceed 65535 (its page's 约束说明), which an int8 lm_head of Qwen's
    151,936-row vocabulary does: N runs as column blocks of at most 65535 (as vllm-ascend splits it), the stand-in
    refusing any wider one, and the result is the golden's."""
    gen = torch.Generator().manual_seed(2)
    N = 65535 + 1000
    x_q = torch.randint(-128, 128, (3, 16), generator=gen, dtype=torch.int8)
    w_q = torch.randint(-128, 128, (N, 16), generator=gen, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="must not exceed 65535"):
        torch_npu_standin.npu_quant_matmul(x_q, w_q.t(), torch.ones(N), pertoken_scale=torch.ones(3),
                                           output_dtype=torch.bfloat16)
    if static:
        args = (x_q, w_q, torch.rand(N, generator=gen) * 1e-4, torch.randint(-999, 999, (N,), generator=gen,
                                                                              dtype=torch.int32), torch.bfloat16)
    else:
        args = (x_q, w_q, torch.rand(3, generator=gen), torch.rand(N, generator=gen) * 1e-3,
                torch.randn(N, generator=gen), torch.bfloat16)
    name = "quant_matmul_static" if static else "quant_matmul"
    torch_npu_standin.calls.clear()
    assert npu.supports(name, *args) is None
    assert torch.equal(getattr(npu, name)(*args), OPS[name].golden(*args))
    assert torch_npu_standin.calls == ["npu_format_cast", "npu_quant_matmul"] * 2  # each block's weight in NZ


def _text_rope(S, D=128, E=None, dtype=torch.bfloat16, mrope=False, heads=(16, 2)):
    gen = torch.Generator().manual_seed(S)
    q = torch.randn(1, S, heads[0], D, generator=gen).to(dtype).transpose(1, 2)  # HF's [B, H, S, D] view
    k = torch.randn(1, S, heads[1], D, generator=gen).to(dtype).transpose(1, 2)
    shape = (3, 1, S, E or D) if mrope else (1, S, E or D)
    angles = 3 * torch.randn(shape, generator=gen)  # cos and sin of angles: npu_rotary_mul's [-1, 1] data range
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    return q, k, cos, sin, [16, 24, 24] if mrope else [], 1


@pytest.mark.parametrize("case,op_used", [
    ("text", "npu_apply_rotary_pos_emb"), ("decode", "npu_apply_rotary_pos_emb"),
    ("mrope", "npu_apply_rotary_pos_emb"), ("partial", "npu_rotary_mul"), ("vision", "npu_rotary_mul"),
    ("text_fp32_dtype_hf", "npu_apply_rotary_pos_emb")])
def test_rope_maps_onto_the_documented_rotary_ops(npu, case, op_used):
    """fp32 mode (and hf on fp32 tensors, the same math) on both torch_npu rotary ops; each layout lands in
    the documented BSND form, the result within precision of the golden and in its shape and dtype."""
    if case == "vision":
        gen = torch.Generator().manual_seed(0)
        qkv = torch.randn(37, 3 * 16 * 80, generator=gen).bfloat16().reshape(37, 3, 16, 80).permute(1, 0, 2, 3)
        angles = torch.randn(37, 80, generator=gen)
        args = (qkv[0], qkv[1], angles.cos(), angles.sin(), [], -2, "fp32")
    elif case == "text_fp32_dtype_hf":
        args = (*_text_rope(9, dtype=torch.float32), "hf")
    else:
        S = {"decode": 1}.get(case, 9)
        args = (*_text_rope(S, E=64 if case == "partial" else None, mrope=case == "mrope"), "fp32")
    assert npu.supports("rope", *args) is None
    before = [t.clone() for t in args[:2]]
    got = npu.rope(*args)
    golden = OPS["rope"].golden(*args)
    assert torch_npu_standin.calls[-1] == op_used
    assert [(g.shape, g.dtype) for g in got] == [(g.shape, g.dtype) for g in golden]
    assert_close(got, golden, OPS["rope"].outputs)
    assert all(torch.equal(a, b) for a, b in zip(args[:2], before))  # npu_apply_rotary_pos_emb ran on copies


def test_qk_norm_rope_maps_onto_npu_rms_norm_and_the_rotary_op(npu):
    q, k, cos, sin, sec, u = _text_rope(5)
    w = (1 + 0.1 * torch.randn(2, 128)).bfloat16()
    args = (q, k, w[0], w[1], cos, sin, sec, 1e-6, 1e-6, u, "fp32")
    assert npu.supports("qk_norm_rope", *args) is None
    assert_close(npu.qk_norm_rope(*args), OPS["qk_norm_rope"].golden(*args), OPS["qk_norm_rope"].outputs)
    assert torch_npu_standin.calls == ["npu_rms_norm", "npu_rms_norm", "npu_apply_rotary_pos_emb"]


@pytest.mark.parametrize("args,reason", [
    (_text_rope(4) + ("hf",), "hf mode on bfloat16: torch_npu's rope kernels round once"),
    (_text_rope(2, D=1024) + ("fp32",), "rotary dim 1024 not below 896"),
    (_text_rope(1, D=80, heads=(1000, 2)) + ("fp32",), "N=1000 not below 1000"),
    ((*_text_rope(3)[:4], [], 1, "fp32"), None),
])
def test_rope_limits_are_the_documented_ones(npu, monkeypatch, args, reason):
    got = npu.supports("rope", *args)
    assert (got is None) if reason is None else (reason in got), got
    if reason and "hf mode" not in reason:  # the stand-in (torch_npu's documented limit) refuses it too
        with pytest.raises(RuntimeError, match="npu_rotary_mul|npu_apply_rotary_pos_emb"):
            npu.rope(*args)
    monkeypatch.setattr(torch_npu_standin, "DEVICE_NAME", "Ascend310P3")
    older = Npu(NpuBackend(module_name="torch_npu_standin"))
    assert "must be 128 outside Atlas A2/A3" in older.supports("rope", *_text_rope(2, D=64), "fp32")


@pytest.fixture
def fia_call(monkeypatch):
    """The keyword arguments (and q's, k's shapes) of the last npu_fused_infer_attention_score call to the stand-in."""
    seen = {}
    real = torch_npu_standin.npu_fused_infer_attention_score

    def spy(q, k, v, **kw):
        seen.update(kw, shape=tuple(q.shape), k_shape=tuple(k.shape))
        return real(q, k, v, **kw)

    monkeypatch.setattr(torch_npu_standin, "npu_fused_infer_attention_score", spy)
    return seen


def test_varlen_attention_is_one_tnd_fused_attention_call_with_the_head_size_padded(npu, fia_call):
    """Every window in one npu_fused_infer_attention_score call (TND, cumulative ends, the empty window dropped),
    head size 80 padded to 128 as vllm-ascend pads it and sliced back; within precision of the golden."""
    seen = fia_call
    gen = torch.Generator().manual_seed(0)
    cu = [0, 64, 64, 128, 160]
    q, k, v = (torch.randn(160, 4, 80, generator=gen).to(torch.bfloat16) for _ in range(3))
    for mode in ("hf", "fp32"):
        out = npu.varlen_attention(q, k, v, cu, 80 ** -0.5, mode)
        assert out.shape == q.shape and out.is_contiguous()
        op = OPS["varlen_attention"]
        assert_close(out, op.golden(q, k, v, cu, 80 ** -0.5, mode), op.outputs)
    assert seen["shape"] == (160, 4, 128) and seen["input_layout"] == "TND" and seen["num_heads"] == 4
    assert seen["actual_seq_lengths"] == seen["actual_seq_lengths_kv"] == [64, 128, 160]


@pytest.mark.parametrize("D,padded", [(16, 128), (64, 128), (80, 128), (128, 128), (160, 192), (192, 192)])
def test_the_tnd_call_runs_at_a_documented_head_dim(npu, fia_call, D, padded):
    """The TND layout takes D = 128, or 192 for q and k (the page's TND constraints): only 64 < D < 128 was padded,
    so Qwen3-VL's vision head dim of 64 went to the hardware unpadded (issue 47). Every D up to 192 is padded to
    the next documented one and sliced back; the stand-in refuses any other."""
    gen = torch.Generator().manual_seed(D)
    q, k, v = (torch.randn(40, 2, D, generator=gen).to(torch.bfloat16) for _ in range(3))
    op = OPS["varlen_attention"]
    args = (q, k, v, [0, 16, 40], D ** -0.5, "hf")
    assert npu.supports("varlen_attention", *args) is None
    assert_close(npu.varlen_attention(*args), op.golden(*args), op.outputs)
    assert fia_call["shape"] == (40, 2, padded)
    if padded != D:
        with pytest.raises(RuntimeError, match=r"TND head dims \(%d, %d, %d\)" % (D, D, D)):
            torch_npu_standin.npu_fused_infer_attention_score(q, k, v, actual_seq_lengths=[16, 40],
                                                              actual_seq_lengths_kv=[16, 40], num_heads=2,
                                                              input_layout="TND")


def test_varlen_attention_limits_are_the_documented_ones(npu, monkeypatch):
    q = torch.randn(10, 2, 16)
    assert "float32" in npu.supports("varlen_attention", q, q, q, [0, 10], 0.25, "hf")
    qb = q.bfloat16()
    assert npu.supports("varlen_attention", qb, qb, qb, [0, 10], 0.25, "hf") is None
    wide = torch.zeros(10, 2, 256, dtype=torch.bfloat16)
    assert "head dim 256 in the TND layout" in npu.supports("varlen_attention", wide, wide, wide, [0, 10], 0.1, "hf")
    many = torch.zeros(4097, 2, 16, dtype=torch.bfloat16)
    bounds = list(range(4098))
    assert "4097 sequences in the TND layout (at most 4096)" in npu.supports("varlen_attention", many, many, many,
                                                                             bounds, 0.25, "hf")
    padded = torch.zeros(4097, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="4097 sequences in TND"):
        torch_npu_standin.npu_fused_infer_attention_score(padded, padded, padded, actual_seq_lengths=bounds[1:],
                                                          actual_seq_lengths_kv=bounds[1:], num_heads=2,
                                                          input_layout="TND")
    heads = torch.zeros(10, 257, 16, dtype=torch.bfloat16)
    assert "257 query heads > 256" in npu.supports("varlen_attention", heads, heads, heads, [0, 10], 0.25, "hf")
    monkeypatch.setattr(torch_npu_standin, "DEVICE_NAME", "Ascend310P3")
    npu.backend.device_name.cache_clear()
    assert "A2/A3" in npu.supports("varlen_attention", qb, qb, qb, [0, 10], 0.25, "hf")
    with pytest.raises(RuntimeError, match="A2/A3"):
        torch_npu_standin.npu_fused_infer_attention_score(qb, qb, qb, actual_seq_lengths=[10],
                                                          actual_seq_lengths_kv=[10], num_heads=2, input_layout="TND")


@pytest.mark.parametrize("case", ["causal prefill", "masked decode", "decode", "masked prefill"])
def test_decoder_attention_is_one_bnsd_fused_attention_call(npu, fia_call, case):
    """GQA through num_key_value_heads (no repeated KV heads), a causal prefill as sparse_mode 3 with the documented
    2048 x 2048 mask, a padding mask inverted (FIA masks where True); within precision of HF's sdpa (the golden)."""
    seen = fia_call
    op = OPS["decoder_attention"]
    S, Skv = {"causal prefill": (12, 12), "masked decode": (1, 50), "decode": (1, 50), "masked prefill": (6, 20)}[case]
    ex = {"B": 2, "Hq": 16, "Hkv": 2, "S": S, "Skv": Skv, "D": 128, "scale": 128 ** -0.5, "is_causal": True}
    if case in ("causal prefill", "decode"):
        ex["attn_mask"] = None
    args = op.example_args(ex)
    out = npu.decoder_attention(*args)
    assert_close(out, op.golden(*args), op.outputs)
    assert seen["input_layout"] == "BNSD" and seen["num_heads"] == 16 and seen["num_key_value_heads"] == 2
    assert seen["k_shape"] == (2, 2, Skv, 128)
    assert seen.get("sparse_mode", 0) == (3 if case == "causal prefill" else 0)
    if case.startswith("masked"):
        assert torch.equal(seen["atten_mask"], ~args[5])


@pytest.mark.parametrize("case,sizes,reason", [
    ("heads", dict(Hq=260, Hkv=260, S=4, Skv=4, D=128), "260 query heads > 256"),
    ("group", dict(Hq=130, Hkv=2, S=4, Skv=4, D=128), "65 query heads per KV head (at most 64)"),
    ("head dim", dict(Hq=4, Hkv=2, S=4, Skv=4, D=520), "head dim 520 > 512"),
    ("unaligned prefill", dict(Hq=4, Hkv=2, S=4, Skv=4, D=12), "head dim 12 is not 16-byte aligned in bfloat16"),
    ("decode KV", dict(Hq=4, Hkv=2, S=1, Skv=262145, D=8), "KV length 262145 > 262144 at a decode step"),
])
def test_decoder_attention_is_declined_where_fia_refuses_the_sizes(npu, case, sizes, reason):
    """The page's prefill and decode limits on N, D, its alignment and the decode KV length: declined by the
    predicate with the reason, and refused by the stand-in (issue 47)."""
    op = OPS["decoder_attention"]
    q = torch.zeros(1, sizes["Hq"], sizes["S"], sizes["D"], dtype=torch.bfloat16)
    k = torch.zeros(1, sizes["Hkv"], sizes["Skv"], sizes["D"], dtype=torch.bfloat16)
    args = (q, k, k, 0.1, True, None, "pack")
    assert reason in npu.supports("decoder_attention", *args)
    with pytest.raises(RuntimeError, match="npu_fused_infer_attention_score: "):
        torch_npu_standin.npu_fused_infer_attention_score(q, k, k, num_heads=sizes["Hq"],
                                                          num_key_value_heads=sizes["Hkv"], input_layout="BNSD",
                                                          scale=0.1)
    assert op.golden(*args).shape == (1, sizes["S"], sizes["Hq"], sizes["D"])


def test_a_padding_row_that_sees_no_key_asks_for_the_documented_row_correction(npu, fia_call):
    """A left-padded batch's prefill: the padding rows of the shorter prompt attend to no key. The page's inner_precise
    table asks for its row-invalid correction (2 or 3) there; the mapping passed none (issue 47). The stand-in
    refuses such a call without it and gives zero rows with it, as torch's sdpa does: equal to the golden."""
    op = OPS["decoder_attention"]
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 6, 64, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(2, 2, 6, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    mask = torch.ones(6, 6, dtype=torch.bool).tril()[None, None].repeat(2, 1, 1, 1)
    mask[1, :, :, :2] = False  # the second prompt is 2 tokens shorter: its first two rows see no key
    mask[1, :, :2, :] = False
    args = (q, k, v, 64 ** -0.5, True, mask, "pack")
    with pytest.raises(RuntimeError, match="a mask row with no key needs inner_precise 2 or 3"):
        torch_npu_standin.npu_fused_infer_attention_score(q, k, v, atten_mask=~mask, num_heads=4,
                                                          num_key_value_heads=2, input_layout="BNSD", scale=0.125)
    out = npu.decoder_attention(*args)
    assert fia_call["inner_precise"] == 2
    golden = op.golden(*args)
    assert torch.equal(golden[1, :2], torch.zeros_like(golden[1, :2])) and torch.equal(out[1, :2], golden[1, :2])
    assert_close(out, golden, op.outputs)
    decode = op.example_args({"B": 2, "Hq": 4, "Hkv": 2, "S": 1, "Skv": 9, "D": 64, "scale": 0.125, "is_causal": True})
    fia_call.clear()
    npu.decoder_attention(*decode)
    assert fia_call.get("inner_precise", 0) in (0, 1) and fia_call["shape"][2] == 1  # 0 and 1 only at Q_S 1


def test_npu_swiglu_quant_takes_its_smooth_scales_as_one_group(npu):
    """torch_npu-npu_swiglu_quant.md documents smooth_scales as [G, N] or [G]: without group_index one group, [1, N];
    the mapping passed [N] (issue 47). The stand-in refuses [N]; the mapping's call meets the golden."""
    gen = torch.Generator().manual_seed(4)
    gate, up = (torch.randn(5, 96, generator=gen) for _ in range(2))
    smooth = 0.5 + torch.rand(96, generator=gen)
    with pytest.raises(RuntimeError, match=r"smooth_scales \(96,\): documented float32 \[G, N\] or \[G\], G = 1"):
        torch_npu_standin.npu_swiglu_quant(torch.cat([gate, up], -1), smooth_scales=smooth, activate_left=True,
                                           quant_mode=1, dst_type=torch.int8)
    op = OPS["swiglu_dynamic_quant"]
    args = (gate, up, smooth, "fp32", "int8")
    assert npu.supports("swiglu_dynamic_quant", *args) is None
    assert_close(npu.swiglu_dynamic_quant(*args), op.golden(*args), op.outputs)


def test_keywords_newer_releases_added_are_passed_only_where_needed(npu, monkeypatch):
    """y_dtype, beta and rotary_mode are keywords older torch_npu releases lack: a call that does not need one does
    not pass it (issue 47), so it runs on those releases too; every op's examples are run with a spy on each call."""
    from pypto_gym.kernels.npu.backend import NEWER_KEYWORDS

    passed = []
    for name, keywords in NEWER_KEYWORDS.items():
        real = getattr(torch_npu_standin, name)

        def spy(*args, _real=real, _name=name, _keywords=keywords, **kwargs):
            passed.extend((_name, k, kwargs[k]) for k in _keywords if k in kwargs)
            return _real(*args, **kwargs)
        monkeypatch.setattr(torch_npu_standin, name, spy)
    for op in NPU_OPS:
        for example in op.examples:
            args = op.example_args(example)
            if npu.supports(op.name, *args) is None:
                getattr(npu, op.name)(*args)
    int4 = OPS["add_rms_norm_dynamic_quant"].example_args({"R": (3,), "D": 64, "dst_type": "int4"})
    npu.add_rms_norm_dynamic_quant(*int4)  # the one call that needs y_dtype
    beta = [p for p in passed if p[1] == "beta"]
    assert all(p[1] in ("beta", "y_dtype") for p in passed), passed  # never rotary_mode
    assert all(v is not None for _, _, v in beta) and all(v == torch.quint4x2 for _, k, v in passed if k == "y_dtype")
    assert beta and any(p[1] == "y_dtype" for p in passed)  # the examples with a beta and an int4 output pass them


def test_npu_mrope_takes_the_documented_sections_and_head_sizes(npu):
    """torch_npu-npu_mrope.md: mrope_section one of [16, 24, 24], [24, 20, 20], [8, 12, 12], [16, 16, 16, 16] (or
    none), head_size and rotary_dim multiples of 16 in fp32 (32 in fp16/bf16); nothing was checked (issue 47). The
    predicate declines the rest with the reason, the stand-in refuses it, and Qwen2.5-VL's split is taken."""
    op = OPS["rotary_embedding"]
    base = {"P": (3,), "T": 6, "Q": (2 * 128,), "K": (2 * 128,), "M": 24, "E": 128, "head_size": 128,
            "cast_mode": "fp32", "dtype": torch.bfloat16, "cos_sin_cache_dtype": torch.float32}
    args = op.example_args({**base, "mrope_section": [16, 24, 24]})
    assert npu.supports("rotary_embedding", *args) is None
    assert_close(npu.rotary_embedding(*args), op.golden(*args), op.outputs)
    odd = op.example_args({**base, "mrope_section": [20, 22, 22]})
    assert "mrope_section [20, 22, 22] is not one of the documented" in npu.supports("rotary_embedding", *odd)
    with pytest.raises(RuntimeError, match=r"mrope_section \[20, 22, 22\] is not documented"):
        torch_npu_standin.npu_mrope(odd[0], odd[1].float(), odd[2].float(), odd[3].float(), 128,
                                    mrope_section=[20, 22, 22])
    narrow = op.example_args({**base, "Q": (2 * 24,), "K": (2 * 24,), "E": 24, "head_size": 24, "P": (),
                              "mrope_section": []})
    assert "head_size 24 and rotary_dim 24 must be multiples of 16" in npu.supports("rotary_embedding", *narrow)
    with pytest.raises(RuntimeError, match="must be multiples of 16"):
        torch_npu_standin.npu_mrope(narrow[0], narrow[1].float(), narrow[2].float(), narrow[3].float(), 24)


def test_npu_mrope_converts_a_16_bit_cos_sin_cache_once_per_version(npu, monkeypatch):
    """npu_mrope is called in fp32 (its page's multiples of 16 are fp32's): the model's whole cos/sin cache was cast
    per call (issue 47: max_positions x rotary_dim elements a decode step). One fp32 copy per cache, made again
    after an in-place update; the results stay the golden's."""
    op = OPS["rotary_embedding"]
    args = list(op.example_args({"P": (3,), "T": 6, "Q": (2 * 128,), "K": (2 * 128,), "M": 24, "E": 128,
                                 "head_size": 128, "cast_mode": "fp32", "dtype": torch.bfloat16,
                                 "cos_sin_cache_dtype": torch.bfloat16, "mrope_section": [24, 20, 20]}))
    cache = args[3]
    assert cache.dtype == torch.bfloat16 and npu.supports("rotary_embedding", *args) is None
    sent, real = [], torch_npu_standin.npu_mrope
    monkeypatch.setattr(torch_npu_standin, "npu_mrope", lambda *a, **k: sent.append(a[3]) or real(*a, **k))
    for _ in range(3):
        assert_close(npu.rotary_embedding(*args), op.golden(*args), op.outputs)
    assert len(sent) == 3 and sent[0] is sent[1] is sent[2] and sent[0].dtype == torch.float32
    with torch.no_grad():
        cache.mul_(0.5)
    assert_close(npu.rotary_embedding(*args), op.golden(*args), op.outputs)
    assert sent[3] is not sent[0] and torch.equal(sent[3], cache.float())


def test_hf_norms_on_the_npu_make_their_unit_gamma_once(npu, monkeypatch):
    """hf mode normalises with a unit gamma and multiplies the real one in torch: it was built by torch.ones per call
    (an allocation and a fill launch per norm, issue 47). Made once per width, dtype and device."""
    x, g = torch.randn(2, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    npu.rms_norm(x, g, 1e-6, "hf")
    made = []
    real = torch.ones
    monkeypatch.setattr(torch, "ones", lambda *a, **k: made.append(a) or real(*a, **k))
    for _ in range(3):
        assert_close(npu.rms_norm(x, g, 1e-6, "hf"), OPS["rms_norm"].golden(x, g, 1e-6, "hf"), ("y",))
        npu.add_rms_norm(x, x, g, 1e-6, "hf", "rounded")
    assert made == []


def test_decoder_attention_limits_are_the_documented_ones(npu, monkeypatch):
    op = OPS["decoder_attention"]
    args = op.example_args(op.examples[4])  # fp32
    assert "float32" in npu.supports("decoder_attention", *args)
    monkeypatch.setattr(torch_npu_standin, "DEVICE_NAME", "Ascend310P3")
    args = op.example_args(op.examples[1])
    assert "A2/A3" in npu.supports("decoder_attention", *args)


def test_the_rotary_and_dequant_pages_rules_re_read_are_refused(npu, monkeypatch):
    """Rules from a second reading of torch_npu-apply_rotary_pos_emb.md, -npu_rotary_mul.md and
    -npu_dequant_swiglu_quant.md that the stand-in lacked: D 128 or 64 and no empty tensors for
    npu_apply_rotary_pos_emb (no bfloat16 on the inference series), r1/r2 within [-1, 1] for npu_rotary_mul,
    quant_scale float32/float16/bfloat16; the rope mapping declines an empty call first."""
    x = torch.randn(1, 4, 2, 96)
    c = torch.randn(1, 4, 1, 96).clamp(-1, 1)
    with pytest.raises(RuntimeError, match="D 96 must be 128 or 64"):
        torch_npu_standin.npu_apply_rotary_pos_emb(x.clone(), x.clone(), c, c)
    x, c = torch.randn(1, 0, 2, 64), torch.randn(1, 0, 1, 64)
    with pytest.raises(RuntimeError, match="empty tensors"):
        torch_npu_standin.npu_apply_rotary_pos_emb(x.clone(), x.clone(), c, c)
    x, c = torch.randn(1, 4, 2, 64).bfloat16(), torch.rand(1, 4, 1, 64).bfloat16()
    torch_npu_standin.npu_apply_rotary_pos_emb(x.clone(), x.clone(), c, c)
    monkeypatch.setattr(torch_npu_standin, "DEVICE_NAME", "Ascend310P3")
    with pytest.raises(RuntimeError, match="no bfloat16 on Atlas inference series"):
        torch_npu_standin.npu_apply_rotary_pos_emb(x.clone(), x.clone(), c, c)
    monkeypatch.setattr(torch_npu_standin, "DEVICE_NAME", "Ascend910B2")
    with pytest.raises(RuntimeError, match=r"r1/r2 outside \[-1, 1\]"):
        torch_npu_standin.npu_rotary_mul(torch.randn(1, 4, 2, 80), 1.5 * torch.ones(1, 4, 1, 80),
                                         torch.zeros(1, 4, 1, 80))
    xi = torch.randint(-9, 9, (3, 8), dtype=torch.int32)
    with pytest.raises(RuntimeError, match="quant_scale float32/float16/bfloat16"):
        torch_npu_standin.npu_dequant_swiglu_quant(xi, weight_scale=torch.ones(1, 8), activation_scale=torch.ones(3, 1),
                                                   quant_scale=torch.ones(1, 4, dtype=torch.int32), quant_mode=1)
    q, cos = torch.randn(1, 2, 0, 64), torch.randn(1, 0, 64)
    assert "empty tensors" in npu.supports("rope", q, q, cos, cos, [], 1, "fp32")


@pytest.mark.parametrize("function,op,example", [
    ("npu_mrope", "rotary_embedding", {"P": (3,), "T": 6, "Q": (2 * 128,), "K": (2 * 128,), "M": 24, "E": 128,
                                       "head_size": 128, "cast_mode": "fp32", "mrope_section": [24, 20, 20]}),
    ("npu_add_rms_norm_dynamic_quant", "add_rms_norm_dynamic_quant", {"R": (3,), "D": 64}),
    ("npu_add_rms_norm_quant", "rms_norm_quant", None),
    ("npu_swiglu_quant", "swiglu_dynamic_quant", {"cast_mode": "fp32"}),
])
def test_a_torch_npu_release_without_a_function_declines_the_ops_that_call_it(npu, monkeypatch, function, op,
                                                                             example):
    """op_plugin_functions.yaml per branch: npu_mrope and npu_dequant_swiglu_quant from 7.0.0,
    npu_add_rms_norm_quant from 7.1.0, npu_add_rms_norm_dynamic_quant and npu_swiglu_quant from 7.2.0. On a release
    without one the op is declined naming the branch (it raised AttributeError mid-call)."""
    from pypto_gym.kernels.npu.backend import SINCE

    o = OPS[op]
    args = o.example_args({**o.examples[0], **(example or {})})
    assert npu.supports(op, *args) is None
    monkeypatch.delattr(torch_npu_standin, function)
    assert npu.supports(op, *args) == f"this torch_npu has no {function} (op-plugin {SINCE[function]} and later)"


def test_interleaved_mrope_maps_onto_npu_mrope_cache_mode_interleave(npu, monkeypatch):
    """Qwen3-VL's interleaved MRoPE ([24, 20, 20], head 128) is npu_mrope's cache_mode="interleave" (op-plugin
    26.0.0's keyword, passed only then): within precision of the golden (vLLM's apply_interleaved_rope), where the
    chunked call would be far off."""
    op = OPS["rotary_embedding"]
    base = {"P": (3,), "T": 9, "Q": (2 * 128,), "K": (128,), "M": 40, "E": 128, "head_size": 128,
            "cast_mode": "fp32", "mrope_section": [24, 20, 20]}
    args = op.example_args({**base, "mrope_interleaved": True})
    assert npu.supports("rotary_embedding", *args) is None
    sent, real = [], torch_npu_standin.npu_mrope
    monkeypatch.setattr(torch_npu_standin, "npu_mrope", lambda *a, **k: sent.append(k) or real(*a, **k))
    got = npu.rotary_embedding(*args)
    assert_close(got, op.golden(*args), op.outputs)
    assert sent[-1]["cache_mode"] == "interleave"
    chunked = npu.rotary_embedding(*args[:-1], False)
    assert "cache_mode" not in sent[-1] and not compare_outputs(chunked, op.golden(*args), op.outputs)[0].passed


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gelu_quant_ops_map_onto_npu_gelu_in_the_form_asked_then_the_quant_call(npu, approximate, dtype):
    """gelu_dynamic_quant is npu_gelu (with `approximate` passed: torch's own gelu on an NPU computes the tanh form
    whatever it is asked) then npu_dynamic_quant; gelu_quant is npu_gelu then npu_quantize. The codes are the golden's;
    the other form's would not be."""
    torch.manual_seed(0)
    x = (2 * torch.randn(6, 96)).to(dtype)
    smooth = (torch.rand(96) + 0.5).to(dtype)
    got = npu.gelu_dynamic_quant(x, smooth, approximate, "int8")
    assert torch_npu_standin.calls == ["npu_gelu", "npu_dynamic_quant"]
    assert_close(got, OPS["gelu_dynamic_quant"].golden(x, smooth, approximate), OPS["gelu_dynamic_quant"].outputs)
    other = OPS["gelu_dynamic_quant"].golden(x, smooth, "tanh" if approximate == "none" else "none")
    assert not torch.equal(got[0], other[0])
    torch_npu_standin.calls.clear()
    scale, offset = torch.tensor([0.02]), torch.tensor([-3.0])
    y = npu.gelu_quant(x, scale, offset, None, approximate)
    assert torch_npu_standin.calls == ["npu_gelu", "npu_quantize"]
    assert torch.equal(y, OPS["gelu_quant"].golden(x, scale, offset, None, approximate))


@pytest.mark.parametrize("chip,dtype,args,reason", [
    ("Ascend910_9391", torch.bfloat16, {}, "npu_gelu: Ascend910_9391 is not among its page's products"),
    ("Ascend310P3", torch.bfloat16, {}, "npu_gelu: dtype bfloat16 not supported on inference chips"),
    ("Ascend310P3", torch.float16, {}, "npu_dynamic_quant: supported on Atlas A2/A3 chips only"),
    ("Ascend910B2", torch.float32, {}, "dtype float32 not supported by npu_dynamic_quant"),
    ("Ascend910B2", torch.bfloat16, {"smooth": torch.float32}, "smooth_scales float32 with x bfloat16"),
    ("Ascend910B2", torch.bfloat16, {"shape": (1,) * 8 + (8,)}, "npu_gelu: rank 9 > 8"),
])
def test_gelu_quant_limits_are_npu_gelus_and_the_quant_calls(npu, monkeypatch, chip, dtype, args, reason):
    """Declined where npu_gelu's page or the quant call's does not document the call, before it is made; the stand-in
    refuses the same call."""
    monkeypatch.setattr(torch_npu_standin, "DEVICE_NAME", chip)
    npu = Npu(NpuBackend(module_name="torch_npu_standin"))
    x = torch.randn(args.get("shape", (4, 8))).to(dtype)
    smooth = torch.ones(8, dtype=args["smooth"]) if "smooth" in args else None
    got = npu.supports("gelu_dynamic_quant", x, smooth, "tanh", "int8")
    assert got is not None and reason in got, got
    with pytest.raises(RuntimeError):
        npu.gelu_dynamic_quant(x, smooth, "tanh", "int8")


@pytest.mark.parametrize("activation,approximate", [("gelu", "none"), ("gelu_tanh", "tanh")])
def test_a_gelu_mlps_linear_is_f_linear_then_npu_gelu_in_the_form_asked(npu, activation, approximate):
    """The linear op with a GELU on the NPU: F.linear, then npu_gelu with `approximate` passed (torch's own gelu there
    computes the tanh form whatever it is asked: npu_gelu's page); the golden's values, not the other form's."""
    torch.manual_seed(1)
    x, w, b = torch.randn(6, 64, dtype=torch.bfloat16), torch.randn(96, 64, dtype=torch.bfloat16) / 4, \
        torch.randn(96, dtype=torch.bfloat16)
    got = npu.linear(x, w, b, activation)
    assert torch_npu_standin.calls == ["npu_gelu"]
    assert torch.equal(got, OPS["linear"].golden(x, w, b, activation))
    other = OPS["linear"].golden(x, w, b, "gelu_tanh" if activation == "gelu" else "gelu")
    assert not torch.equal(got, other)
    assert npu.supports("linear", x, w, b, "none") is None and torch.equal(npu.linear(x, w, b, "none"),
                                                                            torch.nn.functional.linear(x, w, b))
