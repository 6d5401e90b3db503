"""The op layer's contract (SPEC 2): registration, refusals, autograd, and the one dispatch path.

Numerics of the torch backend are in test_reference.py, of the cpu kernels in test_cpu_kernels.py,
of PyPTO in test_pypto.py; this file checks what every backend shares.
"""
import subprocess
import sys
import warnings

import pytest
import torch

import pypto_gym
from pypto_gym import ops
from pypto_gym.ops import dispatch, library, reference, registry
from pypto_gym.precision import compare_outputs

QUANT_NAMES = ("y1", "y2", "x_out", "scale1", "scale2")


def assert_close(actual, golden, names=("output",)):
    for c in compare_outputs(actual, golden, names):
        assert c.passed, f"{c.name}: {c.reason} (max abs {c.max_abs:g})"


def _inputs(dtype=torch.bfloat16, D=64):
    torch.manual_seed(0)
    x1, x2 = torch.randn(2, 5, D).to(dtype), torch.randn(2, 5, D).to(dtype)
    g, s = torch.randn(D).to(dtype), (torch.rand(D) + 0.5).to(dtype)
    return x1, x2, g, s


OPCHECK_CASES = {
    "rms_norm": lambda x1, x2, g, s, b: (library.rms_norm_op, (x1, g, 1e-6, "hf", b, 0)),
    "rms_norm_fp32_no_gamma": lambda x1, x2, g, s, b: (library.rms_norm_op, (x1, None, 1e-6, "fp32", b, 0)),
    "add_rms_norm": lambda x1, x2, g, s, b: (library.add_rms_norm_op, (x1, x2, g, 1e-6, "hf", b, 0)),
    "rms_norm_dynamic_quant": lambda x1, x2, g, s, b: (library.rms_norm_dynamic_quant_op,
                                                       (x1, g, s, None, 1e-6, "int8", b, 0)),
    "add_rms_norm_dynamic_quant": lambda x1, x2, g, s, b: (library.add_rms_norm_dynamic_quant_op,
                                                           (x1, x2, g, s, s, g, 1e-6, "int8", b, 0)),
    "add_rms_norm_dynamic_quant_one_branch": lambda x1, x2, g, s, b: (library.add_rms_norm_dynamic_quant_op,
                                                                      (x1, x2, g, s, None, None, 1e-6, "int4", b, 0)),
    "quant_matmul": lambda x1, x2, g, s, b: (library.quant_matmul_op, (
        (x1 * 40).clamp(-128, 127).to(torch.int8), (x2[0] * 40).clamp(-128, 127).to(torch.int8), x1[..., 0].abs(),
        s[:5].abs().float(), g[:5], torch.bfloat16, b, 0)),  # w_q [N=5, K=64]
}


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_opcheck(case, backend):
    """torch.library.opcheck: schema, fake kernel, autograd registration, AOT dispatch."""
    x1, x2, g, s = _inputs(torch.float32)
    op, args = OPCHECK_CASES[case](x1, x2, g, s, backend)
    if case.startswith(("rms_norm", "add_rms_norm")) and "quant" not in case:
        args = tuple(a.requires_grad_() if isinstance(a, torch.Tensor) else a for a in args)
    torch.library.opcheck(op, args)


BAD_CALLS = [
    (lambda: ops.rms_norm(torch.ones(4, dtype=torch.int32)), TypeError, "x: dtype int32"),
    (lambda: ops.rms_norm(torch.ones(4, dtype=torch.float64)), TypeError, "x: dtype float64"),
    (lambda: ops.rms_norm([1.0, 2.0]), TypeError, "x: expected a torch.Tensor"),
    (lambda: ops.rms_norm(torch.tensor(1.0)), ValueError, "x: rank-0"),
    (lambda: ops.rms_norm(torch.ones(2, 0)), ValueError, r"x: last dim D is 0"),
    (lambda: ops.rms_norm(torch.ones(2, 4), torch.ones(3)), ValueError, r"gamma: shape \(3,\).*expected \(4,\)"),
    (lambda: ops.rms_norm(torch.ones(2, 4), torch.ones(2, 2)), ValueError, r"gamma: shape \(2, 2\)"),
    (lambda: ops.rms_norm(torch.ones(2, 4), torch.ones(4, dtype=torch.int64)), TypeError, "gamma: dtype int64"),
    (lambda: ops.rms_norm(torch.ones(2, 4), cast_mode="bf16"), ValueError, "cast_mode: got 'bf16'"),
    (lambda: ops.rms_norm(torch.ones(2, 4), eps=-1.0), ValueError, "eps: got -1.0"),
    (lambda: ops.rms_norm(torch.ones(2, 4), eps=float("nan")), ValueError, "eps: got nan"),
    (lambda: ops.rms_norm(torch.ones(2, 4), eps=10 ** 400), ValueError, "eps: got an integer with 401 digits"),
    (lambda: ops.rms_norm(torch.ones(2, 4), eps="1e-6"), TypeError, "eps: expected a float, got str"),
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


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("op", list(OP_CALLS))
def test_torch_compile_fullgraph_runs_the_backend_and_counts(backend, op):
    torch._dynamo.reset()
    fn = OP_CALLS[op]
    x, _, g, _ = _inputs()
    eager = fn(x, g, backend)
    before = dict(ops.GLOBAL_STATS.ran)
    compiled = torch.compile(lambda x, g: fn(x, g, backend), fullgraph=True)
    got = compiled(x, g)
    eager = eager if isinstance(eager, tuple) else (eager,)
    got = got if isinstance(got, tuple) else (got,)
    for a, b in zip(got, eager):
        assert (a is None and b is None) or torch.equal(a, b)
    # the compiled graph's op resolves at run time, through the same dispatch, and counts
    assert ops.GLOBAL_STATS.ran.get(backend, 0) > before.get(backend, 0)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cast_mode", ["hf", "fp32"])
def test_backward_matches_autograd_through_the_reference(backend, dtype, cast_mode):
    """The hand-written backward formulas against autograd differentiating the reference."""
    torch.manual_seed(1)
    x1, x2, g = torch.randn(3, 4, 96).to(dtype), torch.randn(3, 4, 96).to(dtype), torch.randn(96).to(dtype)
    gy, gres = torch.randn(3, 4, 96).to(dtype), torch.randn(3, 4, 96).to(dtype)

    def grads(add_fn, norm_fn):
        a, b, w = (t.clone().requires_grad_() for t in (x1, x2, g))
        y, x_out = add_fn(a, b, w)
        torch.autograd.backward((y, x_out), (gy.to(y.dtype), gres))
        single, w2 = x1.clone().requires_grad_(), g.clone().requires_grad_()
        y2 = norm_fn(single, w2)
        y2.backward(gy.to(y2.dtype))
        return a.grad, b.grad, w.grad, single.grad, w2.grad

    stats = ops.Stats()
    got = grads(lambda a, b, w: ops.add_rms_norm(a, b, w, cast_mode=cast_mode, backend=backend, stats=stats),
                lambda a, w: ops.rms_norm(a, w, cast_mode=cast_mode, backend=backend, stats=stats))
    expected = grads(lambda a, b, w: reference.add_rms_norm(a, b, w, 1e-6, cast_mode),
                     lambda a, w: reference.rms_norm(a, w, 1e-6, cast_mode))
    tol = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (3e-2, 3e-2)}[dtype]
    for a, e in zip(got, expected):
        torch.testing.assert_close(a.float(), e.float(), rtol=tol[0], atol=tol[1] * float(e.abs().max()))
    assert stats.ran == {backend: 2}  # the autograd path went through the same dispatch, charged to `stats`


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_quant_outputs_never_require_grad(backend):
    x1, x2, g, s = (t.float().requires_grad_() for t in _inputs())
    y, scale = ops.rms_norm_dynamic_quant(x1, g, s, backend=backend)
    outs = ops.add_rms_norm_dynamic_quant(x1, x2, g, s, s, backend=backend)
    assert not any(t.requires_grad for t in (y, scale, *outs))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
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


# ---- the one dispatch path: capability fallbacks, kernel defects, strict mode, counters -----------
class _BrokenBackend(registry.Backend):
    """Declares it supports every CPU call, then raises: a defect, not a capability gap."""

    name = "broken"
    devices = ("cpu",)

    def rms_norm(self, *args):
        raise RuntimeError("kernel exploded")

    add_rms_norm = rms_norm


@pytest.fixture
def broken_backend():
    registry.register(_BrokenBackend())
    dispatch._warned.clear()
    yield "broken"
    del registry.BACKENDS["broken"]


def test_capability_fallback_is_counted_with_its_reason(lenient):
    stats = ops.Stats()
    x, g64 = torch.randn(2, 8), torch.randn(8, dtype=torch.float64)
    y = ops.rms_norm(x, g64, backend="cpu", stats=stats)
    assert torch.equal(y, reference.rms_norm(x, g64))
    assert stats.ran == {"torch": 1} and stats.fallbacks == {"cpu: gamma dtype float64 not supported": 1}


def test_capability_fallback_raises_when_strict():
    with pytest.raises(ops.BackendFallbackError, match="cpu: gamma dtype float64 not supported"):
        ops.rms_norm(torch.randn(2, 8), torch.randn(8, dtype=torch.float64), backend="cpu")


def test_kernel_defect_is_counted_warned_once_and_strict_raises(broken_backend, lenient):
    stats = ops.Stats()
    x = torch.randn(2, 8)
    with pytest.warns(RuntimeWarning, match="broken raised RuntimeError: kernel exploded"):
        y = ops.rms_norm(x, None, backend=broken_backend, stats=stats)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second failure is counted, not warned again
        ops.rms_norm(x, None, backend=broken_backend, stats=stats)
    assert torch.equal(y, reference.rms_norm(x))
    assert stats.fallbacks == {"broken raised RuntimeError: kernel exploded": 2}
    assert stats.ran == {"torch": 2} and stats.backend == "torch"  # what actually ran
    with pypto_gym.config.scoped(strict=True), pytest.raises(RuntimeError, match="kernel exploded"):
        ops.rms_norm(x, None, backend=broken_backend)


def test_custom_op_path_counts_the_same_way(broken_backend, lenient):
    """Through torch.ops (autograd needed) a defect is charged to the same Stats as in eager mode."""
    stats = ops.Stats()
    x = torch.randn(2, 8, requires_grad=True)
    with pytest.warns(RuntimeWarning):
        y = ops.rms_norm(x, None, backend=broken_backend, stats=stats)
    y.sum().backward()
    assert stats.ran == {"torch": 1} and list(stats.fallbacks) == ["broken raised RuntimeError: kernel exploded"]


def test_direct_calls_are_charged_to_the_global_counters():
    before = ops.GLOBAL_STATS.ran.get("cpu", 0)
    ops.rms_norm(torch.randn(3, 16), None, backend="cpu")
    assert ops.GLOBAL_STATS.ran["cpu"] == before + 1


def test_auto_prefers_the_fused_cpu_kernel_on_cpu_tensors():
    stats = ops.Stats()
    ops.rms_norm(torch.randn(3, 16), None, backend="auto", stats=stats)
    assert stats.ran == {"cpu": 1}


@pytest.mark.parametrize("value,expected", [(" CPU", "cpu"), ("torch", "torch")])
def test_ops_honour_pypto_gym_backend(value, expected):
    code = ("import torch; from pypto_gym import ops; ops.rms_norm(torch.randn(2, 8)); "
            "print(dict(ops.GLOBAL_STATS.ran))")
    env = {"PYPTO_GYM_BACKEND": value, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, **env})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str({expected: 1})


def test_a_bad_pypto_gym_backend_is_refused_naming_the_variable():
    code = "import torch; from pypto_gym import ops; ops.rms_norm(torch.randn(2, 8))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "PYPTO_GYM_BACKEND": "gpu"})
    assert out.returncode != 0 and "PYPTO_GYM_BACKEND: got 'gpu'; expected one of auto" in out.stderr


def test_stats_survive_copy_and_pickle_with_their_own_ids():
    import copy
    import pickle

    s = ops.Stats()
    s.ran["cpu"] = 3
    for twin in (copy.deepcopy(s), pickle.loads(pickle.dumps(s))):
        assert twin.ran == {"cpu": 3} and twin.id != s.id and ops.Stats.lookup(twin.id) is twin
