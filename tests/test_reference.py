"""The goldens (each op definition's torch function: the `torch` backend and every other test's reference)
against independent evidence.

Independent means: the worked examples printed in the reference documents, an fp64 evaluation of
SPEC 2's formulas written here, transformers' own RMSNorm module, and hand-computed values.
Nothing here compares the reference with itself.
"""
import pytest
import torch

from pypto_gym import ops
from pypto_gym.ops import OPS

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def fp64_rms_norm(x, gamma, eps):
    """SPEC 2.1's formula in float64: the exact value every cast mode rounds."""
    xd = x.double()
    y = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    return y if gamma is None else y * gamma.double()


def max_rel_err(actual, exact):
    return float(((actual.double() - exact).abs() / exact.abs().clamp_min(1e-30)).max())


@pytest.mark.parametrize("cast_mode", ["hf", "fp32", "none"])
def test_seed_000_worked_example(cast_mode):
    """Reference 000: x = [[1,2,3,4],[5,6,7,8]], gamma = 1, eps = 1e-6 (values printed to 4 decimals, truncated)."""
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    printed = torch.tensor([[0.3651, 0.7302, 1.0954, 1.4605], [0.7580, 0.9097, 1.0613, 1.2129]], dtype=torch.float64)
    y = ops.rms_norm(x, torch.ones(4), 1e-6, cast_mode=cast_mode, backend="torch").double()
    assert torch.all((y - printed >= 0) & (y - printed < 1e-4)), y


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cast_mode,ulps", [("hf", 2), ("fp32", 1), ("none", 6)])
def test_rounding_error_against_fp64(dtype, cast_mode, ulps):
    """Each mode is the fp64 value rounded a known number of times in the output dtype: hf twice
    (before and after the weight), fp32 once, none at every step (in fp32 every step of the
    computation itself rounds: 4 ulps); a wrong formula is off by far more."""
    if dtype == torch.float32:
        ulps = max(ulps, 4)
    torch.manual_seed(0)
    x = torch.randn(16, 1000).to(dtype)
    g = (1 + 0.3 * torch.randn(1000)).to(dtype)
    y = ops.rms_norm(x, g, 1e-6, cast_mode=cast_mode, backend="torch")
    assert y.dtype == dtype
    err = max_rel_err(y, fp64_rms_norm(x, g, 1e-6))
    assert err <= ulps * torch.finfo(dtype).eps, err


def test_no_cast_really_computes_in_the_input_dtype():
    torch.manual_seed(1)
    x = torch.randn(64, 512).to(torch.bfloat16)
    exact = fp64_rms_norm(x, None, 1e-6)
    none = ops.rms_norm(x, None, cast_mode="none", backend="torch")
    hf = ops.rms_norm(x, None, cast_mode="hf", backend="torch")
    # a variance rounded to bf16 moves whole rows: the no-cast path is measurably less accurate
    assert max_rel_err(none, exact) > 1.5 * max_rel_err(hf, exact)


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                             (torch.float16, torch.float16), (torch.float32, torch.float32),
                                             (torch.float32, torch.bfloat16)])
def test_hf_mode_is_bit_identical_to_transformers(x_dtype, w_dtype):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRMSNorm

    torch.manual_seed(0)
    m = Qwen2_5_VLRMSNorm(256, eps=1e-6).to(w_dtype)
    with torch.no_grad():
        m.weight.normal_()
    x = torch.randn(2, 7, 256).to(x_dtype)
    expected = m(x)
    got = ops.rms_norm(x, m.weight, 1e-6, backend="torch")
    assert got.dtype == expected.dtype  # fp32 weight with bf16 x gives fp32, as HF does
    assert torch.equal(got, expected)


def test_fp32_mode_multiplies_the_weight_before_the_single_cast():
    x = torch.tensor([[1.0, 3.0]], dtype=torch.bfloat16)
    g = torch.tensor([1.01, 1.01], dtype=torch.float32)
    exact = fp64_rms_norm(x, g, 1e-6)
    fp32 = ops.rms_norm(x, g, 1e-6, cast_mode="fp32", backend="torch")
    assert fp32.dtype == torch.bfloat16
    assert torch.equal(fp32, exact.to(torch.bfloat16))  # one rounding of the exact value


def test_add_rms_norm_rounds_the_residual_like_torch_add_and_normalises_it():
    x1 = torch.tensor([[1.0, 2.0 ** -9]], dtype=torch.bfloat16)  # 1 + 2^-9 rounds to 1 in bf16
    x2 = torch.tensor([[0.0, 2.0 ** -9]], dtype=torch.bfloat16)
    y, x_out = ops.add_rms_norm(x1, x2, None, 1e-6, backend="torch")
    assert x_out.tolist() == [[1.0, 2.0 ** -8]]
    assert torch.equal(y, fp64_rms_norm(x_out, None, 1e-6).to(torch.bfloat16))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_add_rms_norm_fp32_sum_normalises_the_unrounded_sum_as_vllm_does(backend):
    """vLLM's fused_add_rms_norm: the residual is the sum rounded once (1.0078125 + 2^-8 = 1.01171875, a tie in
    bf16, rounds to even: 1.015625), the norm reads the fp32 sum: [1.01171875, 1] normalised is [1.00581,
    0.99416] exactly, [1.0078125, 0.99609375] in bf16; the rounded residual's norm gives 0.9921875 instead."""
    x1 = torch.tensor([[1.0078125, 1.0]], dtype=torch.bfloat16)
    x2 = torch.tensor([[2.0 ** -8, 0.0]], dtype=torch.bfloat16)
    y, x_out = ops.add_rms_norm(x1, x2, None, 1e-6, norm_input="fp32_sum", backend=backend)
    assert x_out.tolist() == [[1.015625, 1.0]]
    assert y.tolist() == [[1.0078125, 0.99609375]]
    assert torch.equal(y, fp64_rms_norm(torch.tensor([[1.01171875, 1.0]]), None, 1e-6).to(torch.bfloat16))
    assert ops.add_rms_norm(x1, x2, None, 1e-6, backend=backend)[0].tolist() == [[1.0078125, 0.9921875]]


def test_seed_004_add_rms_norm_dynamic_quant_example():
    """Reference 004's aclnn example: x1 = x2 = 0.5 (fp16 0x3800), gamma = smooth1 = smooth2 = 1.5, shape (2, 8)."""
    half = torch.full((2, 8), 0.5, dtype=torch.float16)
    g = torch.full((8,), 1.5, dtype=torch.float16)
    y1, y2, x_out, s1, s2 = ops.add_rms_norm_dynamic_quant(half, half, g, g, g, eps=1e-6, backend="torch")
    assert x_out.tolist() == [[1.0] * 8] * 2
    assert y1.tolist() == y2.tolist() == [[127] * 8] * 2
    # y = 1 / sqrt(1 + 1e-6) * 1.5, input = y * 1.5, scale = row_max(input) / 127
    expected = 1.5 * 1.5 / (1 + 1e-6) ** 0.5 / 127
    assert s1.tolist() == s2.tolist() == [pytest.approx(expected, rel=1e-6)] * 2
    assert round(float(s1[0]), 6) == 0.017717


def test_quant_scale_and_codes_against_fp64():
    torch.manual_seed(3)
    x = torch.randn(8, 300, dtype=torch.float32)
    g = 1 + 0.2 * torch.randn(300)
    s = 0.5 + torch.rand(300)
    y, scale = ops.rms_norm_dynamic_quant(x, g, s, eps=1e-6, backend="torch")
    n = fp64_rms_norm(x, g, 1e-6) * s.double()
    exact_scale = n.abs().amax(-1) / 127
    assert max_rel_err(scale, exact_scale) < 1e-6
    assert (y.double() - n / exact_scale.unsqueeze(-1)).abs().max() <= 0.5 + 1e-3  # rounded, never truncated


def test_quant_rounds_half_to_even_and_clamps():
    # x constant per row -> x / rms == 1, so n == gamma exactly; scale = 127 / 127 = 1
    g = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5])
    y, scale = ops.rms_norm_dynamic_quant(torch.ones(1, 6), g, eps=1e-12, backend="torch")
    assert float(scale[0]) == 1.0 and y.tolist() == [[127, 0, 2, 2, 0, -2]]
    y4, scale4 = ops.rms_norm_dynamic_quant(torch.ones(1, 6), g, eps=1e-12, dst_type="int4", backend="torch")
    assert float(scale4[0]) == pytest.approx(127 / 7) and int(y4.max()) == 7 and int(y4.min()) >= -8


def test_zero_row_gives_scale_zero_and_codes_zero():
    x = torch.zeros(2, 16)
    x[1] = 1.0
    y, scale = ops.rms_norm_dynamic_quant(x, torch.ones(16), eps=1e-6, backend="torch")
    assert scale[0] == 0 and torch.all(y[0] == 0) and not torch.isnan(scale).any()


def test_dynamic_quant_worked_example_and_fp64():
    """npu_dynamic_quant's documented formula by hand: x = [2, -4, 1, 0.5] * smooth [1, 0.5, 2, 1] = [2, -2, 2,
    0.5], scale = 2 / 127, codes = round([127, -127, 127, 31.75]) = [127, -127, 127, 32]; then against fp64."""
    x = torch.tensor([[2.0, -4.0, 1.0, 0.5]], dtype=torch.bfloat16)
    y, scale = ops.dynamic_quant(x, torch.tensor([1.0, 0.5, 2.0, 1.0], dtype=torch.bfloat16), backend="torch")
    assert y.tolist() == [[127, -127, 127, 32]] and float(scale[0]) == pytest.approx(2 / 127, rel=1e-7)
    torch.manual_seed(4)
    x, s = torch.randn(5, 7, 300).bfloat16(), (0.5 + torch.rand(300)).bfloat16()
    y, scale = ops.dynamic_quant(x, s, backend="torch")
    n = x.double() * s.double()
    exact = n.abs().amax(-1) / 127
    assert max_rel_err(scale, exact) < 1e-6
    assert (y.double() - n / exact.unsqueeze(-1)).abs().max() <= 0.5 + 1e-3


def test_pack_int4_layout_low_nibble_first():
    q = torch.tensor([[1, -2, 7, -8]], dtype=torch.int8)
    assert ops.pack_int4(q).tolist() == [[(1 | (0xE << 4)) - 256, (7 | (0x8 << 4)) - 256]]
    q = torch.randint(-8, 8, (5, 64), dtype=torch.int8)
    assert torch.equal(ops.unpack_int4(ops.pack_int4(q)), q)
    with pytest.raises(ValueError, match="last dim must be even"):
        ops.pack_int4(torch.zeros(3, dtype=torch.int8))
    with pytest.raises(ValueError, match="\\[-8, 7\\]"):
        ops.pack_int4(torch.tensor([9, 0], dtype=torch.int8))


@pytest.mark.parametrize("cast_mode", ["hf", "fp32", "none"])
def test_output_dtype_rule(cast_mode):
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    y = ops.rms_norm(x, torch.ones(8, dtype=torch.float32), cast_mode=cast_mode, backend="torch")
    assert y.dtype == (torch.float32 if cast_mode == "hf" else torch.bfloat16)
    assert OPS["rms_norm"].empty_outputs(x, torch.ones(8), 1e-6, cast_mode).dtype == y.dtype
