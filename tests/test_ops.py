"""The op layer's contract (SPEC 2, 9), for every op the definitions register: parametrised over ops,
their examples and backends, never copied per op.

Numerics of each golden are checked against independent evidence in test_reference.py; the cpu
kernels at every instruction-set level in test_cpu_kernels.py; PyPTO in test_pypto.py; the npu
mapping in test_npu_contract.py. This file checks what every op and backend shares.
"""
import copy
import inspect
import pickle
import subprocess
import sys
import warnings

import pytest
import torch

import pypto_gym
from pypto_gym import ops
from pypto_gym.ops import OPS, dispatch, registry
from pypto_gym.ops.args import Tensor

from support import assert_close, op_examples, run_on

BACKENDS = ["torch", "cpu"]


def _needs_grad(op, args):
    return tuple(a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point()
                 and op.backward is not None else a for a in args)


def test_every_op_is_defined_once_and_derived_everywhere():
    assert {"rms_norm", "add_rms_norm", "rms_norm_dynamic_quant", "add_rms_norm_dynamic_quant",
            "quant_matmul"} <= set(OPS)
    for name, op in OPS.items():
        assert getattr(ops, name) is op.entry and getattr(torch.ops.pypto_gym, name) is not None
        schema = str(getattr(torch.ops.pypto_gym, name).default._schema)
        assert all(f" {a.name}" in schema for a in op.args) and "str backend" in schema
        params = list(inspect.signature(op.entry).parameters)
        assert params == [a.name for a in op.args] + ["backend", "stats"]
        assert op.examples and op.doc, name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op,example", op_examples())
def test_opcheck(op, example, backend):
    """torch.library.opcheck: schema, fake kernel (the golden), autograd registration, AOT dispatch."""
    if backend != "torch" and backend not in op.impls:
        pytest.skip(f"{op.name} has no {backend} implementation")
    args = _needs_grad(op, op.example_args({**example, "dtype": torch.float32}))
    torch.library.opcheck(op.custom_op, (*args, backend, 0))


@pytest.mark.parametrize("op,example", op_examples("cpu"))
def test_the_default_cpu_kernels_follow_the_golden(op, example):
    args = op.example_args(example)
    assert_close(run_on("cpu", op, args), op.golden(*args), op.outputs)


BAD_CALLS = [
    (lambda: ops.rms_norm(torch.ones(4, dtype=torch.int32)), TypeError, "x: dtype int32 not supported"),
    (lambda: ops.rms_norm(torch.ones(4, dtype=torch.float64)), TypeError, "x: dtype float64"),
    (lambda: ops.rms_norm([1.0, 2.0]), TypeError, "x: expected a torch.Tensor, got list"),
    (lambda: ops.rms_norm(torch.tensor(1.0)), ValueError, r"x: rank-0 tensor \(shape \(\)\)"),
    (lambda: ops.rms_norm(torch.ones(2, 0)), ValueError, r"x: D=0 \(shape \(2, 0\)\); expected D >= 1"),
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
     "x2: dtype float16 must match x1's dtype float32"),
    (lambda: ops.rms_norm_dynamic_quant(torch.ones(2, 4), torch.ones(4), eps=0.0), ValueError, "eps: got 0.0"),
    (lambda: ops.rms_norm_dynamic_quant(torch.ones(2, 4), torch.ones(4), dst_type="int2"), ValueError,
     "dst_type: got 'int2'"),
    (lambda: ops.rms_norm_dynamic_quant(torch.ones(2, 4), torch.ones(4, dtype=torch.float16)), TypeError,
     "gamma: dtype float16 must match x's dtype float32"),
    (lambda: ops.rms_norm_dynamic_quant(torch.ones(2, 4), torch.ones(4), torch.ones(5)), ValueError,
     r"smooth_scales: shape \(5,\)"),
    (lambda: ops.rms_norm_dynamic_quant(torch.ones(2, 4), None), TypeError, "gamma: got None"),
    (lambda: ops.add_rms_norm_dynamic_quant(torch.ones(2, 4), torch.ones(2, 4), torch.ones(4), None,
                                            torch.ones(4)), ValueError, "smooth_scale2: given without smooth_scale1"),
    (lambda: ops.add_rms_norm_dynamic_quant(torch.ones(2, 4), torch.ones(2, 4), torch.ones(4), beta=torch.ones(2)),
     ValueError, r"beta: shape \(2,\)"),
    (lambda: ops.rms_norm(torch.ones(2, 4, device="meta"), torch.ones(4)), ValueError,
     "gamma: on device cpu, expected x's device meta"),
    (lambda: ops.add_rms_norm(torch.ones(2, 4), torch.ones(2, 4), None, cast_mode="none", norm_input="fp32_sum"),
     ValueError, "norm_input: 'fp32_sum' with cast_mode 'none'; expected 'rounded'"),  # was a NameError
]


@pytest.mark.parametrize("call,exc,match", BAD_CALLS, ids=[m for _, _, m in BAD_CALLS])
def test_refused_inputs_name_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("op", list(OPS.values()), ids=list(OPS))
def test_every_op_names_each_argument_it_refuses(op):
    """For every tensor argument of every op: a non-tensor and a wrong dtype are refused naming it."""
    args = op.example_args(op.examples[0])
    for i in op.tensor_index:
        a = op.args[i]
        if args[i] is None:
            continue
        with pytest.raises(TypeError, match=f"^{a.name}: expected a torch.Tensor"):
            op.call(args[:i] + ([1.0],) + args[i + 1:], "torch", None)
        with pytest.raises(TypeError, match=f"^{a.name}: dtype"):
            op.call(args[:i] + (args[i].to(torch.complex64),) + args[i + 1:], "torch", None)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(OPS.values()), ids=list(OPS))
def test_torch_compile_fullgraph_runs_the_backend_and_counts(backend, op):
    torch._dynamo.reset()
    args = op.example_args(op.examples[0])
    eager = op.call(args, backend, None)
    before = dict(ops.GLOBAL_STATS.ran)
    compiled = torch.compile(lambda *a: op.call(a, backend, None), fullgraph=True)
    got = compiled(*args)
    eager = eager if isinstance(eager, tuple) else (eager,)
    got = got if isinstance(got, tuple) else (got,)
    for a, b in zip(got, eager):
        assert (a is None and b is None) or torch.equal(a, b)
    # the compiled graph's op resolves at run time, through the same dispatch, and counts
    assert ops.GLOBAL_STATS.ran.get(backend, 0) > before.get(backend, 0)


DIFFERENTIABLE = [op for op in OPS.values() if op.backward is not None]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op,example", [p for p in op_examples() if p.values[0].backward is not None])
def test_backward_matches_autograd_through_the_golden(op, example, backend, dtype):
    """The definition's backward formula against autograd differentiating the golden."""
    args = op.example_args({**example, "dtype": dtype}, seed=1)
    golden = op.golden(*args)
    outs = golden if isinstance(golden, tuple) else (golden,)
    gen = torch.Generator().manual_seed(2)
    grads_out = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs]

    def grads(fn):
        leaves = _needs_grad(op, args)
        out = fn(leaves)
        out = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(out, grads_out)
        return [a.grad for a in leaves if isinstance(a, torch.Tensor) and a.requires_grad]

    stats = ops.Stats()
    got = grads(lambda a: op.call(a, backend, stats))
    expected = grads(lambda a: op.golden(*a))
    tol = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (3e-2, 3e-2)}[dtype]
    for a, e in zip(got, expected):
        torch.testing.assert_close(a.float(), e.float(), rtol=tol[0], atol=tol[1] * float(e.abs().max()))
    assert stats.ran == {backend: 1}  # the autograd path went through the same dispatch, charged to `stats`


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", [op for op in OPS.values() if op.backward is None], ids=lambda op: op.name)
def test_outputs_without_a_backward_never_require_grad(backend, op):
    args = op.example_args({**op.examples[0], "dtype": torch.float32})
    args = tuple(a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args)
    out = op.call(args, backend, None)
    for t in (out if isinstance(out, tuple) else (out,)):
        assert t is None or not t.requires_grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", [op for op in OPS.values() if op.args[0].pattern[0].startswith("*")],
                         ids=lambda op: op.name)
def test_empty_inputs_give_empty_outputs(backend, op):
    """Every leading-dims group of the first example with its first dim 0 (rows 0; rope: batch 0)."""
    stars = {p[1:] for a in op.args if isinstance(a, Tensor) for p in a.pattern if p.startswith("*")}
    example = op.examples[0]
    args = op.example_args({**example, **{s: (0, *example[s][1:]) for s in stars if example.get(s)}})
    out = op.call(args, backend, None)
    golden = op.golden(*args)
    for a, g in zip(out if isinstance(out, tuple) else (out,), golden if isinstance(golden, tuple) else (golden,)):
        assert (a is None and g is None) or (a.shape == g.shape and a.dtype == g.dtype and a.numel() == 0)


# ---- the one dispatch path: capability fallbacks, kernel defects, strict mode, counters -----------
class _BrokenBackend(registry.Backend):
    """Declares it supports every CPU call of the norm ops, then raises: a defect, not a capability gap."""

    name = "broken"
    devices = ("cpu",)


@pytest.fixture
def broken_backend():
    registry.register(_BrokenBackend())
    norms = [OPS["rms_norm"], OPS["add_rms_norm"]]

    def explode(backend, *args):
        raise RuntimeError("kernel exploded")

    for op in norms:
        op.impl("broken")(explode)
    dispatch._warned.clear()
    yield "broken"
    for op in norms:
        del op.impls["broken"]
    del registry.BACKENDS["broken"]


def test_capability_fallback_is_counted_with_its_reason(lenient):
    stats = ops.Stats()
    x, g64 = torch.randn(2, 8), torch.randn(8, dtype=torch.float64)
    y = ops.rms_norm(x, g64, backend="cpu", stats=stats)
    assert torch.equal(y, OPS["rms_norm"].golden(x, g64))
    assert stats.ran == {"torch": 1} and stats.fallbacks == {"cpu: gamma dtype float64 not supported": 1}


def test_a_backend_without_the_op_says_why(lenient):
    stats = ops.Stats()
    x = torch.randint(-128, 128, (2, 8), dtype=torch.int8)
    ops.quant_matmul(x, x, torch.ones(2), torch.ones(2), backend="pypto", stats=stats)
    (reason,) = stats.fallbacks
    assert reason.startswith("pypto: ") and ("quant_matmul is not provided" in reason or "pypto" in reason)


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
    assert torch.equal(y, OPS["rms_norm"].golden(x))
    assert stats.fallbacks == {"broken raised RuntimeError: kernel exploded": 2}
    assert stats.ran == {"torch": 2} and stats.backend == "torch"  # what actually ran
    with pypto_gym.config.scoped(strict=True), pytest.raises(RuntimeError, match="kernel exploded"):
        ops.rms_norm(x, None, backend=broken_backend)


def test_a_sites_own_strict_setting_beats_the_process_switch(broken_backend, lenient):
    with pytest.raises(RuntimeError, match="kernel exploded"):
        ops.rms_norm(torch.randn(2, 8), None, backend=broken_backend, stats=ops.Stats(strict=True))


def test_custom_op_path_counts_the_same_way(broken_backend, lenient):
    """Through torch.ops (autograd needed) a defect is charged to the same Stats as in eager mode."""
    stats = ops.Stats()
    x = torch.randn(2, 8, requires_grad=True)
    with pytest.warns(RuntimeWarning):
        y = ops.rms_norm(x, None, backend=broken_backend, stats=stats)
    y.sum().backward()
    assert stats.ran == {"torch": 1} and list(stats.fallbacks) == ["broken raised RuntimeError: kernel exploded"]


class _FlakyBackend(registry.Backend):
    """Runs the golden as its kernel until `down` says why it no longer can."""

    name = "flaky"
    devices = ("cpu",)
    down = None

    def unavailable_reason(self):
        return self.down


def test_a_bound_call_resolves_again_when_a_backend_stops_being_available(lenient):
    """A BoundCall keeps the backend resolved for its kind of call; a backend that becomes unavailable (PyPTO after
    a compile error) says so to the registry, and the next call of that kind falls back with the reason."""
    flaky = registry.register(_FlakyBackend())
    op = OPS["rms_norm"]
    op.impl("flaky")(lambda backend, *args: op.golden(*args))
    try:
        stats = ops.Stats()
        bound = op.bind("flaky", stats, eps=1e-6, cast_mode="hf")
        x = torch.randn(2, 8)
        for _ in range(3):
            bound(x, None)
        assert stats.ran == {"flaky": 3}
        flaky.down = "disabled after a kernel compile error in this process"
        registry.availability_changed()
        bound(x, None)
        assert stats.ran == {"flaky": 3, "torch": 1}
        assert stats.fallbacks == {"flaky: disabled after a kernel compile error in this process": 1}
    finally:
        del op.impls["flaky"]
        del registry.BACKENDS["flaky"]


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
    s = ops.Stats(site="text.norm")
    s.ran["cpu"] = 3
    for twin in (copy.deepcopy(s), pickle.loads(pickle.dumps(s))):
        assert twin.ran == {"cpu": 3} and twin.site == "text.norm" and twin.id != s.id
        assert ops.Stats.lookup(twin.id) is twin


def test_a_bound_call_validates_once_and_still_refuses_what_changed():
    """The hot path of a patched site: the same kind of call goes straight to dispatch; a changed dtype,
    shape or device, or autograd, takes the full entry (validation included)."""
    stats = ops.Stats()
    bound = OPS["rms_norm"].bind("cpu", stats, eps=1e-6, cast_mode="hf")
    x, g = torch.randn(2, 64), torch.randn(64)
    for _ in range(3):
        assert_close(bound(x, g), OPS["rms_norm"].golden(x, g), OPS["rms_norm"].outputs)
    assert stats.ran == {"cpu": 3}
    with pytest.raises(ValueError, match=r"gamma: shape \(32,\)"):
        bound(x, g[:32])
    y = bound(x.requires_grad_(), g)
    assert y.requires_grad  # autograd took the custom op, not the eager shortcut
    with pytest.raises(ValueError, match="cast_mode: got 'bf16'"):
        OPS["rms_norm"].bind("cpu", stats, eps=1e-6, cast_mode="bf16")


def _x2_like_refused(dtype_or_shape):
    x1, g = torch.randn(4, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    x2 = torch.randn(1, 64, dtype=torch.bfloat16) if dtype_or_shape == "shape" else torch.randn(4, 64)
    return x1, x2, g


# calls every path must refuse (issue 45, item 1): (op, positional args, exception, message)
UNSAFE_CALLS = [
    ("varlen_attention", lambda: (*[torch.randn(8, 2, 16)] * 3, [0, 4, 4096], 0.25, "hf"), ValueError,
     r"cu_seqlens: \[0, 4, 4096\]; expected window bounds rising from 0 to T = 8"),
    ("varlen_attention", lambda: (*[torch.randn(8, 2, 16)] * 3, [0, 6, 3, 8], 0.25, "hf"), ValueError,
     "cu_seqlens: .*rising from 0 to T = 8"),
    ("add_rms_norm_dynamic_quant",
     lambda: (*_x2_like_refused("shape"), None, None, None, 1e-6, "int8"), ValueError, r"x2: shape \(1, 64\)"),
    ("add_rms_norm_dynamic_quant",
     lambda: (*_x2_like_refused("dtype"), None, None, None, 1e-6, "int8"), TypeError, "x2: dtype float32 must match"),
    ("add_rms_norm_quant", lambda: (*_x2_like_refused("shape"), torch.tensor([0.05]), None, None, 1e-6), ValueError,
     r"x2: shape \(1, 64\)"),
    ("add_rms_norm_quant", lambda: (*_x2_like_refused("dtype"), torch.tensor([0.05]), None, None, 1e-6), TypeError,
     "x2: dtype float32 must match"),
]
UNSAFE_IDS = [f"{name}-{i}" for i, (name, *_rest) in enumerate(UNSAFE_CALLS)]


@pytest.mark.parametrize("path", ["eager", "torch.ops", "compiled"])
@pytest.mark.parametrize("name,make,exc,match", UNSAFE_CALLS, ids=UNSAFE_IDS)
def test_every_path_refuses_what_the_entry_point_refuses(name, make, exc, match, path):
    """The custom op's kernel validates as the entry point does: `torch.ops.pypto_gym.<op>` called directly and a
    compiled graph reached the cpu kernel unchecked (a cu_seqlens bound past T read and wrote rows past the
    buffers; an x2 of another shape or dtype read past its buffer or its bytes as bf16)."""
    op, args = OPS[name], make()
    stats = ops.Stats()
    with pytest.raises(exc, match=match):
        if path == "eager":
            op.call(args, "cpu", stats)
        elif path == "torch.ops":
            getattr(torch.ops.pypto_gym, name)(*args, "cpu", stats.id)
        else:
            torch._dynamo.reset()
            torch.compile(lambda *a: op.call(a, "cpu", stats), fullgraph=True)(*args)
    assert not stats.ran


def test_the_validation_cache_compares_list_arguments_by_value_and_type():
    """A list mutated in place after a validated call is a new kind of call (the cache held the list itself, so the
    mutated list skipped validation and reached the kernel); [0.0, 4.0, 8.0] after [0, 4, 8] is refused naming the
    argument, not a raw TypeError from the kernel's binding. Both for the entry point and a site's bound call."""
    op = OPS["varlen_attention"]
    q = torch.randn(8, 2, 16)
    bound = op.bind("cpu", ops.Stats(), scale=0.25, cast_mode="hf")
    for call in (lambda cu: op(q, q, q, cu, 0.25, backend="cpu"), lambda cu: bound(q, q, q, cu)):
        cu = [0, 4, 8]
        call(cu)
        call(cu)
        cu[2] = 4096
        with pytest.raises(ValueError, match=r"cu_seqlens: \[0, 4, 4096\]"):
            call(cu)
        call([0, 4, 8])
        with pytest.raises(ValueError, match="cu_seqlens: got .*expected a list of non-negative ints"):
            call([0.0, 4.0, 8.0])
