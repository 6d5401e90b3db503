"""The residual-add rule: `residual + h` followed by the next norm becomes one `add_rms_norm`, by
rewriting layer forwards.

transformers' layers (Qwen2/2.5-VL/Qwen3 decoder layers, Qwen2.5-VL vision blocks, and remote-code
copies of them) differ between versions in arguments and return values, so rather than keeping a
hand-written copy per class and version, the layer's own `forward` source is parsed and two
statement patterns are rewritten; everything else stays verbatim:

  decoder:  H = R + H ; R = H ; ... self.NORM(H) ...   ->  __n, R = add_norm(self.NORM, H, R) ; H = R ; ... __n ...
  vision:   H = H + E ; ... self.NORM(H) ...           ->  __n, H = add_norm(self.NORM, E, H) ; ... __n ...

NORM must be a patched norm site. `add_norm` (norm.py) reaches the rewritten code as a closure
variable: the function keeps the layer module's own globals (live, so a later monkeypatch of
that module is still seen) and nothing is added to them. A class whose forward has neither
pattern, or whose source cannot be read or recompiled, is left alone and the reason reported.

A rewrite must not change a layer's result unnoticed: the first eager call of each rewritten
class runs the original and the rewritten forward on copies of the same inputs, both on the
reference backend with torch hooks set aside, and compares them. On a mismatch (or if the check
cannot run) every layer of that class goes back to its original forward, with the reason in the
report. The installed forward is a `functools.partial` of a module-level function, so a patched
model pickles and comes back fused.
"""
from __future__ import annotations

import ast
import contextlib
import copy
import inspect
import textwrap

import torch

from ..ops import dispatch
from .norm import add_norm, norm_site
from .site import SwappedForward, torch_hooks_set_aside

_FUSED_NAME = "_pypto_gym_normed"
_HELPER = "_pypto_gym_add_norm"
_LAYER_SLOT = "_pypto_gym_fused_layer"
# Decorators that only write docstrings (and re-read the source file, which an exec'd function
# has not got); every other decorator, e.g. deprecate_kwarg, is kept.
_DOC_ONLY_DECORATORS = {"auto_docstring", "add_start_docstrings", "add_start_docstrings_to_model_forward",
                        "replace_return_docstrings", "add_code_sample_docstrings"}
CHECK_REL_TOL = 2e-2  # of the output's magnitude: above nondeterminism, far below a wrong rewrite
_cache: dict = {}  # (class, norms) -> (function, fused names, reason)
_verified: dict = {}  # (class, norms) -> True, or the reason the rewrite was rejected


def _name(node, ident=None) -> bool:
    return isinstance(node, ast.Name) and (ident is None or node.id == ident)


def _assign_to(stmt) -> str | None:
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and _name(stmt.targets[0]):
        return stmt.targets[0].id
    return None


def _norm_call(stmt, h: str, norms: set) -> ast.Call | None:
    """The single `self.NORM(h)` call inside stmt, NORM a fusable child, or None."""
    calls = [n for n in ast.walk(stmt) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and _name(n.func.value, "self") and n.func.attr in norms and len(n.args) == 1
             and _name(n.args[0], h) and not n.keywords]
    return calls[0] if len(calls) == 1 else None


def _fused_call(norm: str, hidden: ast.expr, residual: str, target: str) -> ast.Assign:
    """`__n, target = add_norm(self.NORM, hidden, residual)`."""
    call = ast.Call(func=ast.Name(_HELPER, ast.Load()),
                    args=[ast.Attribute(value=ast.Name("self", ast.Load()), attr=norm, ctx=ast.Load()), hidden,
                          ast.Name(residual, ast.Load())], keywords=[])
    tup = ast.Tuple([ast.Name(_FUSED_NAME, ast.Store()), ast.Name(target, ast.Store())], ast.Store())
    return ast.Assign(targets=[tup], value=call)


class _ReplaceCall(ast.NodeTransformer):
    def __init__(self, call):
        self.call = call

    def visit_Call(self, node):
        return ast.Name(_FUSED_NAME, ast.Load()) if node is self.call else self.generic_visit(node)


def rewrite_body(body: list, norms: set) -> tuple[list, list]:
    """Apply the two patterns to a statement list; returns (new body, names of fused norms)."""
    out, fused, i = [], [], 0
    while i < len(body):
        s = body[i]
        h = _assign_to(s)
        add = s.value if h and isinstance(s.value, ast.BinOp) and isinstance(s.value.op, ast.Add) else None
        if add is not None and i + 2 < len(body) and _name(add.left) and _name(add.right) \
                and h in (add.left.id, add.right.id):  # decoder: H = R + H ; R = H ; ... self.NORM(H)
            r = add.right.id if add.left.id == h else add.left.id
            nxt, call_stmt = body[i + 1], body[i + 2]
            call = _norm_call(call_stmt, h, norms) if _assign_to(nxt) == r and _name(nxt.value, h) else None
            if call is not None and r != h:
                # x_out = residual + hidden keeps the original operand order: `R + H` or `H + R`
                hid, res = (h, r) if add.right.id == h else (r, h)
                out.append(_fused_call(call.func.attr, ast.Name(hid, ast.Load()), res, r))
                out.append(ast.Assign(targets=[ast.Name(h, ast.Store())], value=ast.Name(r, ast.Load())))
                out.append(_ReplaceCall(call).visit(call_stmt))
                fused.append(call.func.attr)
                i += 3
                continue
        if add is not None and i + 1 < len(body) and _name(add.left, h):  # vision: H = H + E ; ... self.NORM(H)
            call = _norm_call(body[i + 1], h, norms)
            if call is not None:
                out.append(_fused_call(call.func.attr, add.right, h, h))
                out.append(_ReplaceCall(call).visit(body[i + 1]))
                fused.append(call.func.attr)
                i += 2
                continue
        out.append(s)
        i += 1
    return out, fused


def _decorator_name(node) -> str:
    node = node.func if isinstance(node, ast.Call) else node
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def fused_forward(cls, norms: frozenset):
    """(function, fused norm names, reason): the rewritten `cls.forward`, compiled once per class."""
    key = (cls, norms)
    if key not in _cache:
        _cache[key] = _build(cls, norms)
    return _cache[key]


def _build(cls, norms):
    fn = cls.forward
    try:
        source = textwrap.dedent(inspect.getsource(fn))
        code_fn = inspect.unwrap(fn)
    except (OSError, TypeError) as e:
        return None, [], f"source of {cls.__name__}.forward unavailable ({type(e).__name__})"
    if code_fn.__code__.co_freevars:
        return None, [], f"{cls.__name__}.forward is a closure; cannot be rewritten"
    tree = ast.parse(source)
    fdef = tree.body[0]
    if not isinstance(fdef, ast.FunctionDef):
        return None, [], f"{cls.__name__}.forward is not a plain function"
    fdef.decorator_list = [d for d in fdef.decorator_list if _decorator_name(d) not in _DOC_ONLY_DECORATORS]
    fdef.body, fused = rewrite_body(fdef.body, set(norms))
    if not fused:
        return None, [], f"{cls.__name__}.forward has no residual-add + norm pattern"
    # def _pypto_gym_make(_pypto_gym_add_norm): <rewritten def>; return <name>  -- the helper is a closure cell
    maker = ast.FunctionDef(name="_pypto_gym_make", args=ast.arguments(
        posonlyargs=[], args=[ast.arg(_HELPER)], kwonlyargs=[], kw_defaults=[], defaults=[]),
        body=[fdef, ast.Return(ast.Name(fdef.name, ast.Load()))], decorator_list=[], returns=None, type_params=[])
    module = ast.fix_missing_locations(ast.Module(body=[maker], type_ignores=[]))
    namespace: dict = {}
    try:
        code = compile(module, f"<pypto_gym fused {cls.__module__}.{cls.__qualname__}.forward>", "exec")
        exec(code, code_fn.__globals__, namespace)  # noqa: S102 - the class's own source; defines into namespace only
    except Exception as e:  # noqa: BLE001
        return None, [], f"rewritten {cls.__name__}.forward failed to compile ({type(e).__name__}: {e})"
    return namespace["_pypto_gym_make"](add_norm), fused, ""


class FusedLayer(SwappedForward):
    """A layer whose forward was swapped for the fused rewrite (restored exactly by uninstall)."""

    SLOT = _LAYER_SLOT

    def __init__(self, path: str, module: torch.nn.Module, norms: frozenset, fused: list):
        super().__init__(module)
        self.path, self.norms, self.fused = path, norms, fused
        self._fn = None

    def __getstate__(self):  # the compiled function is rebuilt from the class's source after unpickling
        return dict(self.__dict__, _fn=None)

    @property
    def key(self):
        return type(self.module), self.norms

    @property
    def function(self):
        if self._fn is None:
            self._fn = fused_forward(type(self.module), self.norms)[0]
        return self._fn

    @property
    def rejected(self) -> str | None:
        """Why the numerical check rejected this class's rewrite (None if accepted or not yet checked)."""
        status = _verified.get(self.key)
        return status if isinstance(status, str) else None

    def install(self) -> None:
        super().install()
        for name in self.fused:
            norm_site(getattr(self.module, name)).fused = True

    def verify(self, args, kwargs):
        """Compare the rewritten forward with the original on copies of this call's inputs; cache the verdict."""
        try:
            diff, scale = _compare_forwards(self, args, kwargs)
            ok = diff <= CHECK_REL_TOL * max(scale, 1e-6)
            verdict = True if ok else (f"numerical check failed: the rewritten forward differs from the original "
                                       f"(max abs diff {diff:.3g}, output scale {scale:.3g})")
        except Exception as e:  # noqa: BLE001 - an unverifiable rewrite is not used
            verdict = f"numerical check could not run ({type(e).__name__}: {str(e).splitlines()[0][:100]})"
        _verified[self.key] = verdict
        if verdict is not True:
            for name in self.fused:
                norm_site(getattr(self.module, name)).fused = False
        return verdict


def fused_layer_forward(module, *args, **kwargs):
    """The forward of every fused layer: the rewrite once its class passed the check, else the original."""
    layer = module.__dict__[_LAYER_SLOT]
    verdict = _verified.get(layer.key)
    if verdict is None and not torch.compiler.is_compiling():
        verdict = layer.verify(args, kwargs)
    if verdict is None or verdict is True:
        return layer.function(module, *args, **kwargs)
    for name in layer.fused:  # a layer of a rejected class met for the first time
        norm_site(getattr(module, name)).fused = False
    return layer.original(*args, **kwargs)


FusedLayer.FORWARD = fused_layer_forward


@contextlib.contextmanager
def _reference_and_no_hooks(module):
    """Inside `module`: every op call on the golden, uncounted; torch hooks set aside; bypass counts kept."""
    sites = [s for s in (norm_site(m) for m in module.modules()) if s is not None]
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


def _compare_forwards(layer: FusedLayer, args, kwargs) -> tuple[float, float]:
    """(max abs difference, max abs value) between the original and rewritten outputs, same inputs and RNG."""
    module = layer.module
    with _reference_and_no_hooks(module), torch.no_grad(), torch.random.fork_rng(devices=[]):
        rng = torch.random.get_rng_state()
        ref = list(_tensors(layer.original(*copy.deepcopy(args), **copy.deepcopy(kwargs))))
        torch.random.set_rng_state(rng)
        got = list(_tensors(layer.function(module, *copy.deepcopy(args), **copy.deepcopy(kwargs))))
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


def fuse_layers(model, layers: list) -> list[dict]:
    """Rewrite every layer that has patched norm children and a recognised residual pattern (appended to
    `layers`); returns the rows of layers that have a fusable norm but could not be rewritten, with why."""
    skipped = []
    for path, module in model.named_modules():
        norms = frozenset(name for name, child in module.named_children() if norm_site(child) is not None)
        if not norms:
            continue
        fn, fused, reason = fused_forward(type(module), norms)
        if fn is None:
            kinds = {norm_site(getattr(module, n)).kind for n in norms}
            if kinds & {"text.post_attention_layernorm", "vision.norm2"}:
                skipped.append({"path": path, "reason": reason})
            continue
        layer = FusedLayer(path, module, norms, fused)
        layer.install()
        layers.append(layer)
    return skipped
