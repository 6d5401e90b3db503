"""swiglu's golden against independent evidence: a hand-worked example, the fp64 formula, HF's own act_fn.

Everything else about the op (opcheck, refusals, backward, compile, the cpu/pypto/npu backends against
the golden, the case format) comes from its definition through the parametrised suites.
"""
import math

import pytest
import torch
from transformers.activations import ACT2FN

from pypto_gym import ops

from support import ulps_apart


def fp64_swiglu(gate, up):
    g = gate.double()
    return g / (1 + torch.exp(-g)) * up.double()


def test_hand_worked_example():
    gate = torch.tensor([0.0, 1.0, -1.0, 2.0])
    up = torch.tensor([1.0, 2.0, 3.0, 0.5])
    silu = [0.0, 1 / (1 + math.exp(-1)), -1 / (1 + math.exp(1)), 2 / (1 + math.exp(-2))]
    expected = torch.tensor([s * u for s, u in zip(silu, up.tolist())], dtype=torch.float64)
    assert expected.tolist() == pytest.approx([0.0, 1.4621171573, -0.8068242642, 0.8807970780], abs=1e-9)
    for mode in ("hf", "fp32"):
        y = ops.swiglu(gate, up, cast_mode=mode, backend="torch")
        assert torch.allclose(y.double(), expected, rtol=2 ** -22, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("mode,roundings", [("hf", 2), ("fp32", 1)])
def test_rounding_error_against_fp64(dtype, mode, roundings):
    """hf is the fp64 value rounded twice in the dtype (silu, then the product), fp32 once; in fp32 the
    formula's own roundings (exp, add, divide, multiply) give a few ulps."""
    torch.manual_seed(0)
    gate, up = (torch.randn(64, 1000) * 3).to(dtype), torch.randn(64, 1000).to(dtype)
    y = ops.swiglu(gate, up, cast_mode=mode, backend="torch")
    exact = fp64_swiglu(gate, up)
    err = ((y.double() - exact).abs() / exact.abs().clamp_min(1e-30))
    err = err[exact.abs() > 1e-3]  # a product near zero has no relative error worth counting
    allowed = (roundings if dtype != torch.float32 else 8) * torch.finfo(dtype).eps
    assert float(err.max()) <= allowed, float(err.max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_hf_mode_is_bit_identical_to_transformers(dtype):
    torch.manual_seed(1)
    gate, up = torch.randn(2, 7, 256).to(dtype), torch.randn(2, 7, 256).to(dtype)
    assert torch.equal(ops.swiglu(gate, up, backend="torch"), ACT2FN["silu"](gate) * up)


def test_hf_and_fp32_modes_round_differently():
    torch.manual_seed(2)
    gate, up = torch.randn(4096).bfloat16(), torch.randn(4096).bfloat16()
    hf, fp32 = ops.swiglu(gate, up, backend="torch"), ops.swiglu(gate, up, cast_mode="fp32", backend="torch")
    assert not torch.equal(hf, fp32)
    exact = fp64_swiglu(gate, up)
    assert float((fp32.double() - exact).abs().mean()) < float((hf.double() - exact).abs().mean())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("mode", ["hf", "fp32"])
def test_cpu_kernel_is_within_an_ulp(dtype, mode):
    """The README's claim: 1 ulp of a 16-bit dtype (exp is a polynomial, not torch's), 4 ulps of fp32."""
    torch.manual_seed(3)
    gate, up = (torch.randn(33, 3420) * 4).to(dtype), torch.randn(33, 3420).to(dtype)
    gate[0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, 89.0, -89.0, float("inf"), float("-inf")])
    y = ops.swiglu(gate, up, cast_mode=mode, backend="cpu")
    golden = ops.swiglu(gate, up, cast_mode=mode, backend="torch")
    assert ulps_apart(y, golden) <= (4 if dtype == torch.float32 else 1)
    assert torch.equal(torch.isnan(y), torch.isnan(golden))


def test_the_two_halves_of_a_merged_tensor_are_taken_as_views():
    torch.manual_seed(4)
    merged = torch.randn(3, 5, 128).bfloat16()
    gate, up = merged[..., :64], merged[..., 64:]
    assert not gate.is_contiguous()
    assert torch.equal(ops.swiglu(gate, up, backend="cpu"), ops.swiglu(gate.contiguous(), up.contiguous(),
                                                                        backend="torch"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_silu_and_mul_is_vllms_formula_on_the_merged_tensor(dtype):
    """vLLM's SiluAndMul.forward_native, F.silu(x[..., :d]) * x[..., d:], bit for bit on torch; the cpu kernel
    makes the halves itself and agrees with swiglu's kernel on them, also for a strided x."""
    torch.manual_seed(5)
    x = (torch.randn(3, 7, 2 * 96) * 3).to(dtype)
    d = x.shape[-1] // 2
    assert torch.equal(ops.silu_and_mul(x, backend="torch"), torch.nn.functional.silu(x[..., :d]) * x[..., d:])
    for merged in (x, x.transpose(0, 1)):
        assert torch.equal(ops.silu_and_mul(merged, backend="cpu"),
                           ops.swiglu(merged[..., :d], merged[..., d:], backend="cpu"))


def test_silu_and_mul_refuses_an_odd_last_dim_naming_x():
    with pytest.raises(ValueError, match=r"^x: last dim 5 is odd"):
        ops.silu_and_mul(torch.ones(2, 5))


# ---- swiglu_dynamic_quant: the W8A8 MLP middle ---------------------------------------------------------
def test_swiglu_dynamic_quant_hand_worked_example():
    """One row, fp32: a = silu(gate) * up = [0, 1.4621, -0.8068, 0.8808]; times smooth [1, 1, 2, 1] the
    row max is |-1.6136| at channel 2, scale = 1.6136 / 127, codes = round(a * s / scale) = [0, 115, -127, 69]."""
    gate = torch.tensor([[0.0, 1.0, -1.0, 2.0]])
    up = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    smooth = torch.tensor([1.0, 1.0, 2.0, 1.0])
    y, scale = ops.swiglu_dynamic_quant(gate, up, smooth, backend="torch")
    amax = 2 * 3 / (1 + math.exp(1))
    assert float(scale[0]) == pytest.approx(amax / 127, rel=1e-6)
    assert y.tolist() == [[0, round(1.4621171573 / (amax / 127)), -127, round(0.8807970780 / (amax / 127))]]
    assert y.tolist() == [[0, 115, -127, 69]]


@pytest.mark.parametrize("mode", ["hf", "fp32"])
def test_swiglu_dynamic_quant_is_the_quantised_hf_activation(mode):
    """hf: the int8 rows of exactly the tensor HF's down_proj reads (act_fn(gate) * up in bf16), smoothed;
    fp32: of the unrounded product. Codes against an fp64 formula: at most one apart (the fp32 division)."""
    torch.manual_seed(4)
    gate, up = (torch.randn(3, 9, 512) * 3).bfloat16(), torch.randn(3, 9, 512).bfloat16()
    smooth = torch.rand(512) + 0.5
    y, scale = ops.swiglu_dynamic_quant(gate, up, smooth, cast_mode=mode, backend="torch")
    act = ACT2FN["silu"](gate) * up if mode == "hf" else fp64_swiglu(gate, up)
    n = act.double() * smooth.double()
    amax = n.abs().amax(-1)
    assert torch.allclose(scale.double(), amax / 127, rtol=1e-6, atol=0)
    codes = torch.round(n / (amax / 127).unsqueeze(-1))
    assert int((y.double() - codes).abs().max()) <= 1 and float((y.double() != codes).double().mean()) < 1e-3
    assert int(y.abs().amax(-1).min()) == 127  # every row's largest element maps to +-127


def test_swiglu_dynamic_quant_zero_row_and_int4():
    gate, up = torch.zeros(2, 16), torch.randn(2, 16)
    up[1] = 0
    gate[1] = torch.randn(16)
    y, scale = ops.swiglu_dynamic_quant(gate, up, backend="torch")
    assert scale.tolist() == [0.0, 0.0] and not y.any()
    torch.manual_seed(5)
    y4, s4 = ops.swiglu_dynamic_quant(torch.randn(4, 40), torch.randn(4, 40), dst_type="int4", backend="torch")
    assert int(y4.max()) <= 7 and int(y4.min()) >= -8 and int(y4.abs().amax(-1).min()) == 7


# ---- dequant_swiglu_quant: from one int32 GEMM over the merged gate/up weights ------------------------------
def test_dequant_swiglu_quant_hand_worked_example():
    """acc = [gate 10, -20 | up 30, 40] (int32), weight scales [0.1, 0.1, 0.05, 0.05], the row's activation scale 2:
    gate = [2, -4], up = [3, 4]; activate_left: silu(gate) * up = [2 / (1 + e^-2) * 3, -4 / (1 + e^4) * 4] =
    [5.2848, -0.2875]; scale = 5.2848 / 127, codes [127, round(-0.2875 / scale)] = [127, -7]. Without
    activate_left (torch_npu's default) the halves swap roles: silu(up) * gate."""
    acc = torch.tensor([[10, -20, 30, 40]], dtype=torch.int32)
    ws, xs = torch.tensor([0.1, 0.1, 0.05, 0.05]), torch.tensor([2.0])
    y, scale = ops.dequant_swiglu_quant(acc, ws, xs, activate_left=True, backend="torch")
    first = 2 / (1 + math.exp(-2)) * 3
    assert float(scale[0]) == pytest.approx(first / 127, rel=1e-6)
    assert y.tolist() == [[127, round(-4 / (1 + math.exp(4)) * 4 / (first / 127))]] == [[127, -7]]
    y_right, _ = ops.dequant_swiglu_quant(acc, ws, xs, backend="torch")
    silu_up = [3 / (1 + math.exp(-3)) * 2, 4 / (1 + math.exp(-4)) * -4]
    assert y_right.tolist() == [[round(v / (max(map(abs, silu_up)) / 127)) for v in silu_up]]


def test_dequant_swiglu_quant_is_the_exact_gemm_then_fp32_swiglu_quant():
    """From int8 rows and int8 weights: the int32 GEMM output through dequant_swiglu_quant equals, in fp64, the
    dequantised gate and up (per token x per channel, + bias) through silu(gate) * up * smooth, quantised."""
    gen = torch.Generator().manual_seed(6)
    x_q = torch.randint(-128, 128, (9, 256), generator=gen, dtype=torch.int8)
    w_q = torch.randint(-128, 128, (2 * 96, 256), generator=gen, dtype=torch.int8)
    xs, ws = torch.rand(9, generator=gen) * 1e-2, torch.rand(2 * 96, generator=gen) * 1e-3
    bias, smooth = torch.randn(2 * 96, generator=gen) * 0.1, torch.rand(96, generator=gen) + 0.5
    acc = ops.int32_gemm(x_q, w_q, backend="cpu")  # what the W8A8 MLP runs (torch._int_mm only where exact)
    assert torch.equal(acc.long(), x_q.long() @ w_q.long().t())  # the integer product is exact
    y, scale = ops.dequant_swiglu_quant(acc, ws, xs, bias, smooth, activate_left=True, backend="torch")
    f = acc.double() * ws.double() * xs.double().unsqueeze(-1) + bias.double()
    n = fp64_swiglu(f[:, :96], f[:, 96:]) * smooth.double()
    exact = n.abs().amax(-1) / 127
    assert torch.allclose(scale.double(), exact, rtol=1e-5, atol=0)
    assert int((y.double() - torch.round(n / exact.unsqueeze(-1))).abs().max()) <= 1


@pytest.mark.parametrize("args,kwargs,match", [
    ((torch.zeros(2, 7, dtype=torch.int32), torch.ones(7), torch.ones(2)), {},
     "x: last dim 7 is odd; expected the two halves of a merged gate/up output"),
    ((torch.zeros(2, 8, dtype=torch.int32), torch.ones(8), torch.ones(2), None, torch.ones(3)), {},
     r"quant_scale: has 3 channels; expected 4 \(half of x's last dim\)"),
    ((torch.zeros(2, 8, dtype=torch.int32), torch.ones(8), torch.ones(2)), {"activate_left": "yes"},
     "activate_left: expected True or False, got str"),
])
def test_dequant_swiglu_quant_refuses_naming_the_argument(args, kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        ops.dequant_swiglu_quant(*args, **kwargs, backend="torch")
