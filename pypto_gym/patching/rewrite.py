"""Rewritten forwards: a module class's own `forward` source, with a few statements changed, as one
module's instance forward. The residual-add rule (residual.py) and the rotary rule (rope.py) use it.

transformers' layers differ between versions in arguments, decorators and return values, so rather
than keeping a hand-written copy per class and version, the class's `forward` source is parsed, a
rule's transform changes the statements it recognises, and everything else stays verbatim. The
helpers the changed statements call reach the code as closure variables: the function keeps the
class module's own globals (live, so a later monkeypatch of that module is still seen) and nothing
is added to them. A class whose forward has no pattern, or whose source cannot be read or
recompiled, is left alone and the reason reported.

A rewrite must not change a module's result unnoticed: the first eager call of each rewritten class (per
dtype and device of its parameters) runs the original and the rewritten forward on copies of the same inputs, both on the reference
backend with torch hooks set aside, and compares them. On a mismatch (or if the check cannot run)
every module of that class goes back to its original forward, with the reason in the report. The
installed forward is a `functools.partial` of a module-level function and the compiled function is
rebuilt from source after unpickling, so a patched model pickles and comes back rewritten.
"""
from __future__ import annotations

import ast
import contextlib
import copy
import inspect
import textwrap

import torch

from ..ops import dispatch
from .site import site_of, torch_hooks_set_aside

# Decorators that only write docstrings (and re-read the source file, which an exec'd function
# has not got); every other decorator, e.g. deprecate_kwarg, is kept.
_DOC_ONLY_DECORATORS = {"auto_docstring", "add_start_docstrings", "add_start_docstrings_to_model_forward",
                        "replace_return_docstrings", "add_code_sample_docstrings"}
CHECK_REL_TOL = 2e-2  # of the output's magnitude: above nondeterminism, far below a wrong rewrite
_cache: dict = {}  # (class, key) -> (function, what changed, reason)
_verified: dict = {}  # (class, key, (dtype, device)) -> True, or the reason the rewrite was rejected


def name_is(node, ident=None) -> bool:
    return isinstance(node, ast.Name) and (ident is None or node.id == ident)


def self_attr_call(node, attrs) -> bool:
    """`self.X(...)` with X in attrs."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and name_is(node.func.value, "self")
            and node.func.attr in attrs)


class ReplaceNode(ast.NodeTransformer):
    """Replace one node (by identity) with another expression."""

    def __init__(self, old, new):
        self.old, self.new = old, new

    def generic_visit(self, node):
        return self.new if node is self.old else super().generic_visit(node)


def _decorator_name(node) -> str:
    node = node.func if isinstance(node, ast.Call) else node
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def rewritten(cls, key, transform, helpers: dict):
    """(function, what changed, reason): `cls.forward` with `transform(function_def, globals)` applied (it
    returns what it changed, falsy for nothing, or raises ValueError with why not), compiled once per
    (class, key) with `helpers` (name -> object) as closure variables."""
    cache_key = (cls, key)
    if cache_key not in _cache:
        _cache[cache_key] = _build(cls, transform, helpers)
    return _cache[cache_key]


def _build(cls, transform, helpers):
    fn = cls.forward
    try:
        source = textwrap.dedent(inspect.getsource(fn))
        code_fn = inspect.unwrap(fn)
    except (OSError, TypeError) as e:
        return None, None, f"source of {cls.__name__}.forward unavailable ({type(e).__name__})"
    if code_fn.__code__.co_freevars:
        return None, None, f"{cls.__name__}.forward is a closure; cannot be rewritten"
    tree = ast.parse(source)
    fdef = tree.body[0]
    if not isinstance(fdef, ast.FunctionDef):
        return None, None, f"{cls.__name__}.forward is not a plain function"
    fdef.decorator_list = [d for d in fdef.decorator_list if _decorator_name(d) not in _DOC_ONLY_DECORATORS]
    try:
        changed = transform(fdef, code_fn.__globals__)
    except ValueError as e:
        return None, None, f"{cls.__name__}.forward: {e}"
    if not changed:
        return None, None, f"{cls.__name__}.forward has no pattern to rewrite"
    # def _pypto_gym_make(<helpers>): <rewritten def>; return <name>  -- the helpers are closure cells
    maker = ast.FunctionDef(name="_pypto_gym_make", args=ast.arguments(
        posonlyargs=[], args=[ast.arg(name) for name in helpers], kwonlyargs=[], kw_defaults=[], defaults=[]),
        body=[fdef, ast.Return(ast.Name(fdef.name, ast.Load()))], decorator_list=[], returns=None, type_params=[])
    module = ast.fix_missing_locations(ast.Module(body=[maker], type_ignores=[]))
    namespace: dict = {}
    try:
        code = compile(module, f"<pypto_gym rewritten {cls.__module__}.{cls.__qualname__}.forward>", "exec")
        exec(code, code_fn.__globals__, namespace)  # noqa: S102 - the class's own source; defines into namespace only
    except Exception as e:  # noqa: BLE001
        return None, None, f"rewritten {cls.__name__}.forward failed to compile ({type(e).__name__}: {e})"
    return namespace["_pypto_gym_make"](*helpers.values()), changed, ""


class RewrittenForward:
    """Mixin for a SwappedForward whose replacement is a rewritten copy of its class's forward.

    Subclasses give `key` (what selects the rewrite besides the class), `build()` (calls `rewritten`) and
    may override `rejected_now()` (what to undo when the class's rewrite is rejected)."""

    @property
    def rewrite_key(self):
        """What a verdict holds for: the class, the rewrite, and the dtype and device the module computes in (the
        first call of an fp32 model says nothing of a bf16 one: dtype promotions differ)."""
        anchor = self.__dict__.get("_anchor")
        if anchor is None:
            anchor = self._anchor = next(self.module.parameters(), False)
        return type(self.module), self.key, anchor is not False and (anchor.dtype, anchor.device.type)

    def build(self):
        raise NotImplementedError

    @property
    def function(self):
        if self.__dict__.get("_fn") is None:
            self._fn = self.build()[0]
        return self._fn

    def __getstate__(self):  # the compiled function is rebuilt from the class's source after unpickling
        return dict(self.__dict__, _fn=None)

    @property
    def rejected(self) -> str | None:
        """Why the numerical check rejected this class's rewrite (None if accepted or not yet checked)."""
        status = _verified.get(self.rewrite_key)
        return status if isinstance(status, str) else None

    def rejected_now(self) -> None:
        """Called when this module learns its class's rewrite was rejected."""

    def verify(self, args, kwargs):
        """Compare the rewritten forward with the original on copies of this call's inputs; cache the verdict."""
        try:
            diff, scale = _compare_forwards(self, args, kwargs)
            ok = diff <= CHECK_REL_TOL * max(scale, 1e-6)
            verdict = True if ok else (f"numerical check failed: the rewritten forward differs from the original "
                                       f"(max abs diff {diff:.3g}, output scale {scale:.3g})")
        except Exception as e:  # noqa: BLE001 - an unverifiable rewrite is not used
            verdict = f"numerical check could not run ({type(e).__name__}: {str(e).splitlines()[0][:100]})"
        _verified[self.rewrite_key] = verdict
        if verdict is not True:
            self.rejected_now()
        return verdict

    def run(self, module, args, kwargs):
        """The rewrite once its class passed the check (checked on the first eager call), else the original."""
        verdict = _verified.get(self.rewrite_key)
        if verdict is None and not torch.compiler.is_compiling():
            verdict = self.verify(args, kwargs)
        if verdict is None or verdict is True:
            return self.function(module, *args, **kwargs)
        self.rejected_now()  # a module of a rejected class met for the first time
        return self.original(*args, **kwargs)


@contextlib.contextmanager
def _reference_and_no_hooks(module):
    """Inside `module`: every op call on the golden, uncounted; torch hooks set aside; bypass counts kept (a site's
    own and those of the sites attached to its rewrite: a vision attention's declines counted inside its rope
    site's check showed as four for one call)."""
    sites = [s for s in (site_of(m) for m in module.modules()) if s is not None]
    sites += [s.attention for s in sites if getattr(s, "attention", None) is not None]
    sites = [s for s in sites if hasattr(s, "bypassed")]
    saved_bypassed = [(s, dict(s.bypassed)) for s in sites]
    try:
        with torch_hooks_set_aside(module), dispatch.reference():
            yield
    finally:
        for s, bypassed in saved_bypassed:
            s.bypassed = bypassed


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _copy(obj):
    """A deep copy of a call's inputs for the check, which runs without grad: a tensor inside an autograd graph
    (a grad-enabled forward's activations), which deepcopy refuses, is copied as a detached clone."""
    memo = {id(t): t.detach().clone() for t in _tensors(obj) if t.requires_grad and not t.is_leaf}
    return copy.deepcopy(obj, memo)


def _compare_forwards(rewrite: RewrittenForward, args, kwargs) -> tuple[float, float]:
    """(max abs difference, max abs value) between the original and rewritten outputs, same inputs and RNG."""
    module = rewrite.module
    with _reference_and_no_hooks(module), torch.no_grad(), torch.random.fork_rng(devices=[]):
        rng = torch.random.get_rng_state()
        ref = list(_tensors(rewrite.original(*_copy(args), **_copy(kwargs))))
        torch.random.set_rng_state(rng)
        got = list(_tensors(rewrite.function(module, *_copy(args), **_copy(kwargs))))
    if len(ref) != len(got) or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(ref, got)):
        return float("inf"), 0.0
    diff = scale = 0.0
    for a, b in zip(ref, got):
        if not a.numel() or not a.is_floating_point():
            diff = diff if torch.equal(a, b) else float("inf")
            continue
        a, b = a.double(), b.double()
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        d = torch.where(same, 0.0, (a - b).abs().nan_to_num(nan=float("inf")))
        diff = max(diff, float(d.max()))
        scale = max(scale, float(a.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).abs().max()))
    return diff, scale
