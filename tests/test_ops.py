"""The op family against its goldens, on every backend that runs here (SPEC 2, 5)."""
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pypto_gym import ops
from pypto_gym.ops import reference, registry
from pypto_gym.precision import compare, compare_outputs

# The backends that compute on CPU tensors at CPU speed; `pypto` (SIM, ~0.5 s a call) has its own file.
CPU_BACKENDS = ["torch", "cpu"]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
QUANT_NAMES = ("y1", "y2", "x_out", "scale1", "scale2")


def assert_close(actual, golden, names=("output",)):
    for c in compare_outputs(actual, golden, names):
        assert c.passed, f"{c.name}: {c.reason} (max abs {c.max_abs:g})"


def test_golden_matches_hand_computed_values():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    y = reference.rms_norm(x, torch.ones(4), eps=1e-6)
    torch.testing.assert_close(y[0], torch.tensor([0.3651, 0.7303, 1.0954, 1.4606]), atol=1e-4, rtol=0)
    torch.testing.assert_close(y[1], torch.tensor([0.7581, 0.9097, 1.0613, 1.2130]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                             (torch.float16, torch.float16), (torch.float32, torch.float32)])
def test_torch_backend_is_bit_identical_to_hf_module(x_dtype, w_dtype):
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


def _gamma(kind, D, dtype):
    if kind == "none":
        return None
    g = torch.randn(D, dtype=torch.float32).to(dtype)
    return g.reshape(1, D, 1, 1) if kind == "4d" else g


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [1, 7, 128, 1280, 2048, 8192, 16384])
@pytest.mark.parametrize("rank", [1, 2, 3, 4])
@pytest.mark.parametrize("gamma_kind", ["none", "vec", "4d"])
@pytest.mark.parametrize("cast_mode", ["hf", "fp32"])
def test_rms_norm_matches_golden(backend, dtype, D, rank, gamma_kind, cast_mode):
    torch.manual_seed(D + rank)
    shape = {1: (D,), 2: (3, D), 3: (2, 3, D), 4: (1, 2, 2, D)}[rank]
    x = torch.randn(shape).to(dtype)
    g = _gamma(gamma_kind, D, dtype)
    stats = ops.Stats()
    assert_close(ops.rms_norm(x, g, 1e-6, cast_mode=cast_mode, backend=backend, stats=stats),
                 reference.rms_norm(x, g, 1e-6, cast_mode))
    assert stats.backend == backend and not stats.fallbacks


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [1, 128, 2048, 16384])
@pytest.mark.parametrize("cast_mode", ["hf", "fp32"])
def test_add_rms_norm_matches_golden_and_rounds_residual_like_torch(backend, dtype, D, cast_mode):
    torch.manual_seed(D)
    x1, x2 = torch.randn(2, 3, D).to(dtype), torch.randn(2, 3, D).to(dtype)
    g = torch.randn(D).to(dtype)
    y, x_out = ops.add_rms_norm(x1, x2, g, 1e-6, cast_mode=cast_mode, backend=backend)
    gy, gx = reference.add_rms_norm(x1, x2, g, 1e-6, cast_mode)
    assert torch.equal(x_out, x1 + x2)  # the next residual is exactly torch's add
    assert_close(y, gy)


def test_add_rms_norm_norm_consumes_rounded_sum():
    x1 = torch.randn(4, 64, dtype=torch.bfloat16)
    x2 = torch.randn(4, 64, dtype=torch.bfloat16)
    g = torch.randn(64, dtype=torch.bfloat16)
    y, x_out = ops.add_rms_norm(x1, x2, g, backend="torch")
    assert torch.equal(y, reference.rms_norm(x1 + x2, g))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dst_type", ["int8", "int4"])
@pytest.mark.parametrize("smooth", ["none", "one", "two"])
@pytest.mark.parametrize("with_beta", [False, True])
@pytest.mark.parametrize("D", [16, 2048])
def test_quant_ops_match_golden(backend, dtype, dst_type, smooth, with_beta, D):
    torch.manual_seed(D)
    x1, x2 = torch.randn(3, 5, D).to(dtype), torch.randn(3, 5, D).to(dtype)
    x1[1, 2] = 0  # a row of zeros in the single-input op
    g = torch.randn(D).to(dtype)
    s1 = (torch.rand(D) + 0.5).to(dtype) if smooth != "none" else None
    s2 = (torch.rand(D) + 0.5).to(dtype) if smooth == "two" else None
    beta = torch.randn(D).to(dtype) * 0.1 if with_beta else None
    y, scale = ops.rms_norm_dynamic_quant(x1, g, s1, beta, 1e-6, dst_type=dst_type, backend=backend)
    gy, gs = reference.rms_norm_dynamic_quant(x1, g, s1, beta, 1e-6, dst_type)
    assert y.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == x1.shape[:-1]
    assert_close((y, scale), (gy, gs), ("y", "scale"))
    if beta is None:  # a zero row normalises to zeros: scale 0, codes 0, no NaN
        assert torch.all(y[1, 2] == 0) and scale[1, 2] == 0
    qmax, qmin = reference.QUANT_RANGES[dst_type]
    assert int(y.max()) <= qmax and int(y.min()) >= qmin
    out = ops.add_rms_norm_dynamic_quant(x1, x2, g, s1, s2, beta, 1e-6, dst_type=dst_type, backend=backend)
    golden = reference.add_rms_norm_dynamic_quant(x1, x2, g, s1, s2, beta, 1e-6, dst_type)
    assert (out[1] is None) == (s2 is None) and (out[4] is None) == (s2 is None)
    assert_close(out, golden, QUANT_NAMES)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_quant_rounds_half_to_even(backend):
    # x constant per row -> x / rms == 1, so n == gamma exactly; scale = 127 / 127 = 1
    x = torch.ones(1, 6)
    g = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5])
    y, scale = ops.rms_norm_dynamic_quant(x, g, eps=1e-12, backend=backend)
    assert float(scale[0]) == 1.0
    assert y.tolist() == [[127, 0, 2, 2, 0, -2]]


def test_pack_unpack_int4_roundtrip_and_layout():
    q = torch.tensor([[1, -2, 7, -8]], dtype=torch.int8)
    packed = ops.pack_int4(q)
    assert packed.tolist() == [[(1 | (0xE << 4)) - 256, (7 | (0x8 << 4)) - 256]]  # low nibble first
    q = torch.randint(-8, 8, (5, 64), dtype=torch.int8)
    assert torch.equal(ops.unpack_int4(ops.pack_int4(q)), q)
    with pytest.raises(ValueError, match="last dim must be even"):
        ops.pack_int4(torch.zeros(3, dtype=torch.int8))
    with pytest.raises(ValueError, match="\\[-8, 7\\]"):
        ops.pack_int4(torch.tensor([9, 0], dtype=torch.int8))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_empty_inputs_give_empty_outputs(backend):
    x = torch.randn(0, 5, 64, dtype=torch.bfloat16)
    g = torch.randn(64, dtype=torch.bfloat16)
    y = ops.rms_norm(x, g, backend=backend)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    y, x_out = ops.add_rms_norm(x, x, g, backend=backend)
    assert y.shape == x_out.shape == x.shape
    q, s = ops.rms_norm_dynamic_quant(x, g, backend=backend)
    assert q.shape == x.shape and q.dtype == torch.int8 and s.shape == (0, 5)
    y1, y2, xo, s1, s2 = ops.add_rms_norm_dynamic_quant(x, x, g, g, g, backend=backend)
    assert y1.shape == y2.shape == xo.shape == x.shape and s1.shape == s2.shape == (0, 5)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_non_contiguous_inputs(backend):
    base = torch.randn(8, 256, dtype=torch.float32)
    x = base.t().contiguous().t()[:, :128]  # strided view
    assert not x.is_contiguous()
    g = torch.randn(256)[::2]
    assert_close(ops.rms_norm(x, g, backend=backend), reference.rms_norm(x, g))
    x2 = torch.randn(128, 8).t()
    assert_close(ops.add_rms_norm(x, x2, g, backend=backend), reference.add_rms_norm(x, x2, g), ("y", "x_out"))
    gq = g.contiguous()
    assert_close(ops.rms_norm_dynamic_quant(x, gq, backend=backend), reference.rms_norm_dynamic_quant(x, gq),
                 ("y", "scale"))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_nan_and_inf_propagate_like_reference(backend):
    x = torch.randn(3, 32)
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    g = torch.randn(32)
    y, ref = ops.rms_norm(x, g, backend=backend), reference.rms_norm(x, g)
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    assert torch.allclose(y[2], ref[2], atol=1e-5)
    q, s = ops.rms_norm_dynamic_quant(x, g, backend=backend)
    gq, gs = reference.rms_norm_dynamic_quant(x, g)
    assert torch.equal(torch.isnan(s), torch.isnan(gs)) and torch.equal(q[:2], gq[:2])


BAD_CALLS = [
    (lambda: ops.rms_norm(torch.ones(4, dtype=torch.int32)), TypeError, "x: dtype int32"),
    (lambda: ops.rms_norm(torch.ones(4, dtype=torch.float64)), TypeError, "x: dtype float64"),
    (lambda: ops.rms_norm([1.0, 2.0]), TypeError, "x: expected a torch.Tensor"),
    (lambda: ops.rms_norm(torch.tensor(1.0)), ValueError, "x: rank-0"),
    (lambda: ops.rms_norm(torch.ones(2, 4), torch.ones(3)), ValueError, r"gamma: shape \(3,\).*expected \(4,\)"),
    (lambda: ops.rms_norm(torch.ones(2, 4), torch.ones(2, 2)), ValueError, r"gamma: shape \(2, 2\)"),
    (lambda: ops.rms_norm(torch.ones(2, 4), torch.ones(4, dtype=torch.int64)), TypeError, "gamma: dtype int64"),
    (lambda: ops.rms_norm(torch.ones(2, 4), cast_mode="bf16"), ValueError, "cast_mode: got 'bf16'"),
    (lambda: ops.rms_norm(torch.ones(2, 4), eps=-1.0), ValueError, "eps: got -1.0"),
    (lambda: ops.rms_norm(torch.ones(2, 4), backend="gpu"), ValueError, "backend: got 'gpu'"),
    (lambda: ops.add_rms_norm(torch.ones(2, 4), torch.ones(3, 4), None), ValueError,
     r"x2: shape \(3, 4\) does not match x1; expected \(2, 4\)"),
    (lambda: ops.add_rms_norm(torch.ones(2, 4), torch.ones(2, 4, dtype=torch.float16), None), TypeError,
     "x2: dtype float16 must match"),
    (lambda: ops.rms_norm_dynamic_quant(torch.ones(2, 4), torch.ones(4), eps=0.0), ValueError, "eps: got 0.0"),
    (lambda: ops.rms_norm_dynamic_quant(torch.ones(2, 4), torch.ones(4), dst_type="int2"), ValueError,
     "dst_type: got 'int2'"),
    (lambda: ops.rms_norm_dynamic_quant(torch.ones(2, 4), torch.ones(4, dtype=torch.float16)), TypeError,
     "gamma: dtype float16 must match x's dtype float32"),
    (lambda: ops.rms_norm_dynamic_quant(torch.ones(2, 4), torch.ones(4), torch.ones(5)), ValueError,
     r"smooth_scales: shape \(5,\)"),
    (lambda: ops.rms_norm_dynamic_quant(torch.ones(2, 4), None), ValueError, "gamma: got None"),
    (lambda: ops.add_rms_norm_dynamic_quant(torch.ones(2, 4), torch.ones(2, 4), torch.ones(4), None,
                                            torch.ones(4)), ValueError, "smooth_scale2: given without smooth_scale1"),
    (lambda: ops.add_rms_norm_dynamic_quant(torch.ones(2, 4), torch.ones(2, 4), torch.ones(4), beta=torch.ones(2)),
     ValueError, r"beta: shape \(2,\)"),
]


@pytest.mark.parametrize("call,exc,match", BAD_CALLS, ids=[m for _, _, m in BAD_CALLS])
def test_refused_inputs_name_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


OP_CALLS = {
    "rms_norm": lambda x, g, b: ops.rms_norm(x, g, backend=b),
    "add_rms_norm": lambda x, g, b: ops.add_rms_norm(x, x * 0.5, g, backend=b),
    "rms_norm_dynamic_quant": lambda x, g, b: ops.rms_norm_dynamic_quant(x, g, g, backend=b),
    "add_rms_norm_dynamic_quant": lambda x, g, b: ops.add_rms_norm_dynamic_quant(x, x * 0.5, g, g, g, backend=b),
}


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("op", list(OP_CALLS))
def test_torch_compile_fullgraph_matches_eager(backend, op):
    torch._dynamo.reset()
    fn = OP_CALLS[op]
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    g = torch.randn(64, dtype=torch.bfloat16)
    compiled = torch.compile(lambda x, g: fn(x, g, backend), fullgraph=True)
    eager = fn(x, g, backend)
    got = compiled(x, g)
    eager = eager if isinstance(eager, tuple) else (eager,)
    got = got if isinstance(got, tuple) else (got,)
    for a, b in zip(got, eager):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cast_mode", ["hf", "fp32"])
def test_backward_matches_autograd_through_reference(backend, dtype, cast_mode):
    torch.manual_seed(1)
    x1 = torch.randn(3, 4, 96).to(dtype)
    x2 = torch.randn(3, 4, 96).to(dtype)
    g = torch.randn(96).to(dtype)
    gy = torch.randn(3, 4, 96).to(dtype)
    gres = torch.randn(3, 4, 96).to(dtype)

    def grads(fn):
        a, b, w = (t.clone().requires_grad_() for t in (x1, x2, g))
        y, x_out = fn(a, b, w)
        torch.autograd.backward((y, x_out), (gy.to(y.dtype), gres))
        single = x1.clone().requires_grad_()
        w2 = g.clone().requires_grad_()
        y2 = (ops.rms_norm if fn is not ref_fn else reference.rms_norm)(single, w2, 1e-6, **kw(fn))
        y2.backward(gy.to(y2.dtype))
        return a.grad, b.grad, w.grad, single.grad, w2.grad

    def kw(fn):
        return {"cast_mode": cast_mode, "backend": backend} if fn is not ref_fn else {"cast_mode": cast_mode}

    def ref_fn(a, b, w):
        return reference.add_rms_norm(a, b, w, 1e-6, cast_mode)

    def op_fn(a, b, w):
        return ops.add_rms_norm(a, b, w, 1e-6, cast_mode=cast_mode, backend=backend)

    tol = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (3e-2, 3e-2)}[dtype]
    for got, exp in zip(grads(op_fn), grads(ref_fn)):
        torch.testing.assert_close(got.float(), exp.float(), rtol=tol[0], atol=tol[1] * float(exp.abs().max()))


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 9), D=st.integers(1, 300), dtype=st.sampled_from(DTYPES),
       scale=st.sampled_from([1e-3, 1.0, 1e3]), seed=st.integers(0, 2 ** 16))
def test_cpu_backend_randomised(rows, D, dtype, scale, seed):
    torch.manual_seed(seed)
    x = (torch.randn(rows, D) * scale).to(dtype)
    g = torch.randn(D).to(dtype)
    assert_close(ops.rms_norm(x, g, backend="cpu"), reference.rms_norm(x, g))
    assert_close(ops.rms_norm_dynamic_quant(x, g, backend="cpu"), reference.rms_norm_dynamic_quant(x, g),
                 ("y", "scale"))


def test_unsupported_call_falls_back_with_counted_reason():
    stats = ops.Stats()
    x = torch.randn(2, 8)
    g64 = torch.randn(8, dtype=torch.float64)
    y = ops.rms_norm(x, g64, backend="cpu", stats=stats)
    assert torch.equal(y, reference.rms_norm(x, g64))
    assert stats.calls == 1 and stats.fallbacks == {"cpu: gamma dtype float64 not supported": 1}


class _BrokenBackend(registry.Backend):
    name = "broken"
    devices = ("cpu",)

    def rms_norm(self, *args):
        raise RuntimeError("kernel exploded")


@pytest.fixture
def broken_backend():
    registry.register(_BrokenBackend())
    registry._warned.clear()
    yield "broken"
    del registry.BACKENDS["broken"]


def test_kernel_error_falls_back_once_warned_and_strict_raises(broken_backend, monkeypatch):
    stats = ops.Stats()
    x = torch.randn(2, 8)
    with pytest.warns(RuntimeWarning, match="broken raised RuntimeError: kernel exploded"):
        y = ops.rms_norm(x, None, backend=broken_backend, stats=stats)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second failure is counted, not warned again
        ops.rms_norm(x, None, backend=broken_backend, stats=stats)
    assert torch.equal(y, reference.rms_norm(x))
    assert stats.fallbacks == {"broken raised RuntimeError: kernel exploded": 2}
    monkeypatch.setenv("PYPTO_GYM_STRICT", "1")
    with pytest.raises(RuntimeError, match="kernel exploded"):
        ops.rms_norm(x, None, backend=broken_backend)


def test_precision_rule_rejects_a_wrong_result():
    g = torch.randn(64, 128, dtype=torch.bfloat16)
    assert compare(g.clone(), g).passed
    wrong = g * 1.05
    c = compare(wrong, g)
    assert not c.passed and "MERE" in c.reason
    nan = g.clone()
    nan[0, 0] = float("nan")
    assert "NaN" in compare(nan, g).reason
    q = torch.randint(-128, 127, (100, 100), dtype=torch.int8)
    q2 = q.clone()
    q2[0, :20] = (q2[0, :20].int() + 1).clamp(-128, 127).to(torch.int8)
    assert not compare(q2, q).passed  # 0.2% of codes differ
