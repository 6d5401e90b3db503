"""`Op`: one op, defined once, from its golden function and the roles of its arguments.

An op definition module (ops/defs/<op>.py) writes the golden in plain torch (the formula, the
`torch` backend, and the fake kernel's shape/dtype rule all at once, as vLLM's IR ops do) and lists
its arguments as roles (args.py) and its outputs; each backend's kernel module registers one
implementation with a pure `supports` predicate. Everything else is derived here and typed nowhere else:

- the Python entry point `pypto_gym.ops.<name>` (signature and defaults from the roles, plus
  `backend=` and `stats=`), validating every call with errors that name the argument;
- the `torch.library` custom op `torch.ops.pypto_gym.<name>` (schema from the roles, the golden
  as fake kernel, the backward if the definition gives one, else every output non-differentiable),
  so torch.compile(fullgraph=True) and autograd see one node;
- `bind()`: the op bound to one patch site's constants, for the hot path of a patched model;
- what the case files, the recorder, the runner, the tests and the benchmarks know of the op
  (capture/cases.py, capture/recorder.py, bench/ops_bench.py read `Op.registry`).

The implementations live apart, one module per op in each backend's folder (kernels/<backend>/<op>.py), and
register themselves with `Op.impl`; what `bench ops` times of an op lives in bench/specs/<op>.py.

Every call, eager or through the custom op, reaches `dispatch.call`, the one place a call is
resolved to a backend, run and counted.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from . import dispatch, registry
from .args import FLOAT_DTYPES, Arg, Context, Ints, Output, Tensor, _PLAIN

_is_compiling = torch.compiler.is_compiling
_is_grad_enabled = torch.is_grad_enabled


@dataclass
class Impl:
    """One backend's implementation of one op: `fn(*args)` and a pure `supports(*args) -> reason | None` that reads
    only the call's kind (tensor dtypes, shapes and devices, scalar values; never strides or data) and the backend:
    dispatch keeps its answer per kind of call.
    `into`: fn also takes `out=` tensors to write its outputs into (for the op's in-place form: `Op.call`'s
    `into`), and writes nothing before its own checks have passed."""

    backend: str
    fn: Callable
    supports: Callable | None = None
    into: bool = False


@dataclass
class Backward:
    """A backward formula: `fn(saved, grads) -> {argument name: gradient}`, where `saved` maps the names
    in `saves` (arguments and outputs) to their values and `grads` are the outputs' gradients."""

    saves: tuple
    fn: Callable


class Op:
    """One op of the family (see the module docstring). Calling it is calling the entry point."""

    registry: dict = {}  # name -> Op, in definition order

    def __init__(self, golden: Callable, args: list, outputs: list, *, check: Callable | None = None,
                 min_dims: dict | None = None, backward: Backward | None = None, examples: tuple = ()):
        self.name = golden.__name__
        if self.name in Op.registry:
            raise ValueError(f"op {self.name!r} is defined twice")
        self.golden = golden
        self.args: list[Arg] = list(args)
        self.outputs: list[Output] = list(outputs)
        self.arg = {a.name: a for a in self.args}
        self._check, self.min_dims, self.backward = check, dict(min_dims or {}), backward
        self.examples = tuple(examples)
        self.impls: dict[str, Impl] = {}
        self.unsupported: dict[str, str] = {}
        self._last = (None, False)  # (signature, eager) of the last validated call
        self._kernel_last = None  # signature of the last call the custom op's kernel validated
        self._layouts: dict = {}  # kind of call -> the golden's output layouts (empty_outputs)
        self.tensor_index = [i for i, a in enumerate(self.args) if isinstance(a, Tensor)]
        self.device_index = self.tensor_index[0]
        self.doc = inspect.getdoc(golden) or ""
        self._optional_out = [(k, self.args.index(self.arg[o.present_if])) for k, o in enumerate(self.outputs)
                              if o.present_if]
        self.custom_op = self._register_custom_op()
        self.entry = self._make_entry()
        Op.registry[self.name] = self

    def __repr__(self):
        return f"<pypto_gym op {self.name}>"

    def __reduce__(self):  # one definition per process: a pickled or copied reference is the same op
        return _op_named, (self.name,)

    def __deepcopy__(self, memo):
        return self

    def __call__(self, *args, **kwargs):
        return self.entry(*args, **kwargs)

    def impl(self, backend: str, supports: Callable | None = None, into: bool = False):
        """Register `fn(backend, *args)` as this op's implementation on a backend family (decorator);
        `supports(backend, *args)` returns why a call is not taken, or None; `into`: fn takes `out=` (Impl)."""
        def register(fn):
            self.impls[backend] = Impl(backend, fn, supports, into)
            registry.availability_changed()
            return fn
        return register

    def not_on(self, backend: str, reason: str) -> None:
        """Declare that a backend family does not provide this op, and why (said in every fallback)."""
        self.unsupported[backend] = reason

    # -- validation ----------------------------------------------------------------------------------
    def validate(self, args: tuple) -> Context:
        """Check one call's positional arguments (SPEC 2.5); raises ArgTypeError/ArgValueError naming the argument."""
        ctx = Context(min_dims=self.min_dims)
        for a, v in zip(self.args, args):
            a.check(v, ctx)
            ctx.values[a.name] = v
        if self._check is not None:
            self._check(ctx, *args)
        return ctx

    # -- calling ---------------------------------------------------------------------------------------
    def call(self, args: tuple, backend, stats, into: tuple | None = None):
        """Validate, then run through dispatch (eagerly, or through the custom op when traced or with autograd).
        `into`: write the outputs into these tensors (of the outputs' shapes and dtypes; they may be the inputs the
        outputs replace, as vLLM's in-place rotary embedding wants) and return them.

        Validation depends only on the arguments' types, dtypes, shapes, devices and scalar values, so a call
        whose signature equals the last validated one (a model calls an op with the same kind of arguments
        hundreds of times) skips it, and the eager decision with it; list arguments are compared by their values
        and types at the time of the call (`_frozen`), never by reference. While torch.compile traces, the
        validation's Python would be traced into every graph: the custom op's kernel validates instead, when the
        compiled graph runs it (`validated`), as it does for a direct `torch.ops.pypto_gym.<op>` call."""
        if _is_compiling():
            eager = False
        else:
            key = (_is_grad_enabled(), *[(type(a), a.dtype, a.shape, a.device, a.requires_grad)
                                         if isinstance(a, torch.Tensor) else _frozen(a) for a in args])
            if key == self._last[0]:
                eager = self._last[1]
            else:
                self.validate(args)
                eager = self.eager(args)
                self._last = (key, eager)
        backend = registry.default_backend() if backend is None else registry.check_name(backend)
        stats = dispatch.GLOBAL if stats is None else stats
        if eager:
            return dispatch.call(self, backend, stats, args, into)
        return dispatch.written(self.from_custom(self.custom_op(*args, backend, stats.id), args), into)

    def validated(self, args: tuple) -> None:
        """The custom op's check of a call that reached its kernel (a compiled graph, autograd, or
        `torch.ops.pypto_gym.<op>` called directly): the eager path's validation, so no path reaches a kernel with
        what the entry point refuses; skipped for a call of the same kind as the last one validated here."""
        key = tuple((type(a), a.dtype, a.shape, a.device) if isinstance(a, torch.Tensor) else _frozen(a)
                    for a in args)
        if key != self._kernel_last:
            self.validate(args)
            self._kernel_last = key

    def eager(self, args) -> bool:
        """True when dispatch may run without the dispatcher: not traced, no autograd graph to record,
        plain tensors (a subclass such as a FakeTensor needs the dispatcher)."""
        if _is_compiling():
            return False
        grad = _is_grad_enabled()
        for i in self.tensor_index:
            t = args[i]
            if t is not None and (type(t) not in _PLAIN or t.is_meta or (grad and t.requires_grad)):
                return False
        return True

    def bind(self, backend: str, stats, **constants) -> "BoundCall":
        return BoundCall(self, backend, stats, constants)

    def example_args(self, example: dict, seed: int = 0) -> tuple:
        """Arguments for one of the definition's `examples` (or any such dict): dims by name (`R` a tuple
        of leading dims), `dtype` for the float activations (default bfloat16), `<name>_dtype` for one float
        argument's own, values for scalars, None to leave an optional tensor out; tensors generated as case
        inputs are, from `seed`."""
        gen = torch.Generator().manual_seed(seed)
        made: dict = {}
        for a in self.args:
            if not isinstance(a, Tensor):
                made[a.name] = example.get(a.name, a.default)
                continue
            if a.name in example and example[a.name] is None:
                made[a.name] = None
                continue
            shape = []
            for p in a.pattern:
                shape += list(example[p[1:]]) if p.startswith("*") else [int(p) if p.isdigit() else example[p]]
            if a.like is not None:
                dtype = made[a.like].dtype
            elif a.floats or a.dtypes == FLOAT_DTYPES:  # `<name>_dtype` sets one argument's own (fp32 cos)
                dtype = example.get(f"{a.name}_dtype", example.get("dtype", torch.bfloat16))
            else:
                dtype = a.dtypes[0]
            made[a.name] = a.generate(torch.empty(shape, dtype=dtype, device="meta"), gen)
        return tuple(made[a.name] for a in self.args)

    # -- outputs ---------------------------------------------------------------------------------------
    def from_custom(self, out, args):
        """Custom-op outputs back to the entry point's: placeholders of absent outputs become None."""
        if len(self.outputs) == 1:
            return out
        out = list(out)
        for k, i in self._optional_out:
            if args[i] is None:
                out[k] = None
        return tuple(out)

    def _to_custom(self, out, like: torch.Tensor):
        """A custom op returns tensors only: absent outputs travel as empty placeholders."""
        if len(self.outputs) == 1:
            return out
        return tuple(like.new_empty((0,)) if o is None else o for o in out)

    def empty_outputs(self, *args):
        """Uninitialised outputs of the shapes, dtypes and strides the golden gives (run once per kind of call
        on meta tensors of the arguments' strides), on the arguments' device: what a kernel that writes its
        outputs in place is handed, laid out as the custom op's fake kernel says."""
        key = tuple((a.shape, a.stride(), a.dtype) if isinstance(a, torch.Tensor)
                    else tuple(a) if isinstance(a, list) else a for a in args)
        layouts = self._layouts.get(key)
        if layouts is None:
            metas = [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
                     if isinstance(a, torch.Tensor) else a for a in args]
            out = self.golden(*metas)
            outs = out if isinstance(out, tuple) else (out,)
            layouts = (isinstance(out, tuple), [None if o is None else (o.shape, o.stride(), o.dtype) for o in outs])
            if len(self._layouts) > 256:
                self._layouts.clear()
            self._layouts[key] = layouts
        device = args[self.device_index].device
        made = tuple(None if m is None else torch.empty_strided(m[0], m[1], dtype=m[2], device=device)
                     for m in layouts[1])
        return made if layouts[0] else made[0]

    # -- derived registrations -------------------------------------------------------------------------
    def _register_custom_op(self):
        params = [inspect.Parameter(a.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=a.annotation)
                  for a in self.args]
        params += [inspect.Parameter("backend", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str),
                   inspect.Parameter("stats", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=int)]
        returns = torch.Tensor if len(self.outputs) == 1 else tuple[(torch.Tensor,) * len(self.outputs)]
        n = len(self.args)
        op = self

        def kernel(*values):
            args, backend, stats = values[:n], values[n], values[n + 1]
            op.validated(args)
            return op._to_custom(dispatch.call(op, backend, dispatch.Stats.lookup(stats), args),
                                 args[op.device_index])

        kernel.__name__ = self.name
        kernel.__signature__ = inspect.Signature(params, return_annotation=returns)
        kernel.__annotations__ = {p.name: p.annotation for p in params} | {"return": returns}
        custom = torch.library.custom_op(f"pypto_gym::{self.name}", mutates_args=())(kernel)

        def fake(*values):
            args = values[:n]
            return op._to_custom(op.golden(*args), args[op.device_index])

        custom.register_fake(fake)
        if self.backward is None:
            def setup_context(ctx, inputs, output):
                # a single output is a Tensor: unpacking it would mark its rows and leave it differentiable
                ctx.mark_non_differentiable(*((output,) if isinstance(output, torch.Tensor) else output))

            def backward(ctx, *grads):
                return (None,) * (n + 2)
        else:
            setup_context, backward = self._autograd(n)
        custom.register_autograd(backward, setup_context=setup_context)
        return custom

    def _autograd(self, n: int):
        names = [a.name for a in self.args]
        out_names = [o.name for o in self.outputs]
        saves = self.backward.saves
        fn = self.backward.fn

        def setup_context(ctx, inputs, output):
            outs = (output,) if isinstance(output, torch.Tensor) else output
            values = dict(zip(names, inputs)) | dict(zip(out_names, outs))
            tensors = [k for k in saves if isinstance(values[k], torch.Tensor) or values[k] is None]
            ctx.tensor_names = tensors
            ctx.save_for_backward(*(values[k] for k in tensors))
            ctx.other = {k: values[k] for k in saves if k not in tensors}

        def backward(ctx, *grads):
            saved = dict(zip(ctx.tensor_names, ctx.saved_tensors)) | ctx.other
            got = fn(saved, grads)
            return tuple(got.get(k) for k in names) + (None, None)

        return setup_context, backward

    def _make_entry(self):
        """The public function: a real Python signature (defaults, keyword-only arguments), so help() and
        IDEs show it, calling `Op.call` with the positional arguments in definition order."""
        parts, seen_kw = [], False
        for i, a in enumerate(self.args):
            if a.kw_only and not seen_kw:
                parts.append("*")
                seen_kw = True
            parts.append(a.name if a.required else f"{a.name}=_defaults[{i}]")
        if not seen_kw:
            parts.append("*")
        parts += ["backend=None", "stats=None"]
        names = ", ".join(a.name for a in self.args)
        source = (f"def {self.name}({', '.join(parts)}):\n"
                  f"    return _call(({names}{',' if len(self.args) == 1 else ''}), backend, stats)\n")
        namespace = {"_defaults": [a.default for a in self.args], "_call": self.call}
        exec(compile(source, f"<pypto_gym op {self.name}>", "exec"), namespace)  # noqa: S102 - our own text
        entry = namespace[self.name]
        entry.__doc__ = self.doc + ("\n\nbackend: auto (default: $PYPTO_GYM_BACKEND, else auto), torch, cpu, npu, "
                                    "pypto; stats: the Stats to charge (default: the global counters).")
        entry.__module__ = "pypto_gym.ops"
        entry.op = self
        return entry


def _op_named(name: str) -> Op:
    from . import defs  # noqa: F401  (registers the ops; importing this package loaded their kernels)

    return Op.registry[name]


class BoundCall:
    """An op bound to one patch site: its backend, counters and constant arguments (eps, cast mode), validated
    once, as HF kernels decide at kernelize time. A patched module calls it hundreds of times a token with
    the remaining arguments: a call of the same kind as the last one runs on the backend resolved for that
    kind (still recorded and counted by dispatch.run); any other call takes the op's entry path, with its
    validation and error messages. The check of "same kind" is
    written out per op and set of bound arguments (`_fast_path`): it is most of what a decode call costs.
    """

    __slots__ = ("op", "backend", "stats", "constants", "_template", "_key", "_plan", "_fast")

    def __init__(self, op: Op, backend: str, stats, constants: dict):
        unknown = set(constants) - set(op.arg)
        if unknown:
            raise TypeError(f"{op.name}: unknown arguments {sorted(unknown)}")
        for name, value in constants.items():
            op.arg[name].check(value, Context())
        self.op, self.backend, self.stats, self.constants = op, registry.check_name(backend), stats, dict(constants)
        self._template = tuple(constants.get(a.name, a.default) for a in op.args)
        self._key = None
        self._plan = (None, -1)  # dispatch.plan for calls of kind `_key`: the resolution and its generation
        self._fast = _fast_path(op, tuple(a.name in constants for a in op.args))

    def __reduce__(self):
        return BoundCall, (self.op, self.backend, self.stats, self.constants)

    def __call__(self, *free):
        return self._fast(self, free, None)

    def into(self, outs: tuple, *free):
        """The call with its outputs written into `outs` (Op.call's `into`), which it returns."""
        return self._fast(self, free, outs)

    def traced(self, args, into=None):
        """The call as torch.compile traces it: the custom op, its arguments checked by the fake kernel. It reads
        no attribute that changes between calls (`_key`, the op's last validated call): dynamo guards on what a
        traced function reads, so a per-call cache read here would recompile the graph for every new prompt."""
        op = self.op
        return dispatch.written(op.from_custom(op.custom_op(*args, self.backend, self.stats.id), args), into)

    def slow(self, key, args, into=None):
        """A call of another kind than the last: the entry path (validation), remembered if it may go eager."""
        out = self.op.call(args, self.backend, self.stats, into)
        if self.op._last[0] is not None and self.op._last[1]:  # validated and eager: the same kind goes straight on
            self._key, self._plan = key, dispatch.plan(self.op, self.backend, args)
        return out


_FAST_PATHS: dict = {}


def _fast_path(op: Op, bound: tuple):
    """`fast(bound_call, free) -> outputs` for calls of `op` with the arguments flagged in `bound` fixed: the
    kind of call (grad mode; each tensor's type, dtype, shape, device, requires_grad; other values) compared
    with the last one's, then straight to the backend dispatch resolved for that kind (while the registry's
    generation holds), or the slow path. Generated once per op and flags."""
    cache_key = (op.name, bound)
    if cache_key in _FAST_PATHS:
        return _FAST_PATHS[cache_key]
    free = [i for i, b in enumerate(bound) if not b]
    names = [f"a{i}" for i in free]
    kind = []
    for i in free:
        a = op.args[i]
        if isinstance(a, Tensor) and not a.optional:
            kind.append(f"type(a{i}), a{i}.dtype, a{i}.shape, a{i}.device, a{i}.requires_grad")
        elif isinstance(a, Tensor):
            kind.append(f"_sig(a{i})")
        elif isinstance(a, Ints):
            kind.append(f"_frozen(a{i})")
        else:
            kind.append(f"type(a{i}), a{i}")
    args = ", ".join(f"a{i}" if not b else f"t[{i}]" for i, b in enumerate(bound))
    unpack = ", ".join(names) + ("," if len(names) == 1 else "")
    source = (f"def fast(b, free, into):\n"
              f"    {unpack} = free\n"
              f"    t = b._template\n"
              f"    args = ({args}{',' if len(bound) == 1 else ''})\n"
              f"    if _compiling():\n"
              f"        return b.traced(args, into)\n"
              f"    try:\n"
              f"        key = (_grad(), {', '.join(kind)})\n"
              f"    except AttributeError:  # not a tensor where one belongs: the entry path says which\n"
              f"        return b.slow(None, args, into)\n"
              f"    if key == b._key and b._plan[1] == _generation[0]:\n"
              f"        return _run(b.op, b._plan[0], b.stats, args, into)\n"
              f"    return b.slow(key, args, into)\n")
    namespace = {"_grad": _is_grad_enabled, "_compiling": _is_compiling, "_run": dispatch.run, "_sig": _sig,
                 "_frozen": _frozen, "_generation": registry.GENERATION}
    exec(compile(source, f"<pypto_gym bound {op.name}>", "exec"), namespace)  # noqa: S102 - our own text
    _FAST_PATHS[cache_key] = namespace["fast"]
    return namespace["fast"]


def _sig(t):
    return None if t is None else (type(t), t.dtype, t.shape, t.device, t.requires_grad)


def _frozen(value):
    """A scalar or list argument as a validation cache compares it: with its type (1 and 1.0, True and 1 are
    validated apart), and a list as a tuple of its elements now (a list mutated in place after a call is a new
    kind of call, not the same object)."""
    if isinstance(value, (list, tuple)):
        return tuple((type(v), v) for v in value)
    return type(value), value
