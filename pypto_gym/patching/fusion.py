"""Fuse `residual + h` followed by the next norm into one `add_rms_norm`, by rewriting layer forwards.

transformers' layers (Qwen2/2.5-VL/Qwen3 decoder layers, Qwen2.5-VL vision blocks, and remote-code
copies of them) differ between versions in arguments and return values, so rather than keeping a
hand-written copy per class and version, the layer's own `forward` source is parsed and two
statement patterns are rewritten; everything else stays verbatim:

  decoder:  H = R + H ; R = H ; ... self.NORM(H) ...   ->  __n, R = self.NORM(H, residual=R) ; H = R ; ... __n ...
  vision:   H = H + E ; ... self.NORM(H) ...           ->  __n, H = self.NORM(E, residual=H) ; ... __n ...

NORM must be a patched site (its wrapper accepts `residual`). A class whose forward has neither
pattern, or whose source cannot be read or recompiled, is left alone and the reason reported.
The rewritten function is compiled once per class in the class's own module globals.
"""
from __future__ import annotations

import ast
import inspect
import textwrap
import types

import torch

_FUSED_NAME = "_pypto_gym_normed"
# Decorators that only write docstrings (and re-read the source file, which an exec'd function
# has not got); every other decorator, e.g. deprecate_kwarg, is kept.
_DOC_ONLY_DECORATORS = {"auto_docstring", "add_start_docstrings", "add_start_docstrings_to_model_forward",
                        "replace_return_docstrings", "add_code_sample_docstrings"}
_cache: dict = {}


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
    call = ast.Call(func=ast.Attribute(value=ast.Name("self", ast.Load()), attr=norm, ctx=ast.Load()),
                    args=[hidden], keywords=[ast.keyword("residual", ast.Name(residual, ast.Load()))])
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
                hidden_first = add.right.id == h  # keep the operand order of the original add
                res, hid = (r, h) if hidden_first else (h, r)
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
    ast.fix_missing_locations(tree)
    namespace: dict = {}
    try:
        code = compile(tree, f"<pypto_gym fused {cls.__module__}.{cls.__qualname__}.forward>", "exec")
        exec(code, code_fn.__globals__, namespace)  # noqa: S102 - recompiling the class's own source
    except Exception as e:  # noqa: BLE001
        return None, [], f"rewritten {cls.__name__}.forward failed to compile ({type(e).__name__}: {e})"
    return namespace[fdef.name], fused, ""


class FusedLayer:
    """A layer whose forward was swapped for the fused rewrite (restored exactly by uninstall)."""

    def __init__(self, path: str, module: torch.nn.Module, fused: list):
        self.path, self.module, self.fused = path, module, fused
        self._attr = "_old_forward" if "_old_forward" in module.__dict__ else "forward"
        self._saved = module.__dict__.get(self._attr)

    def install(self, fn) -> None:
        setattr(self.module, self._attr, types.MethodType(fn, self.module))

    def uninstall(self) -> None:
        if self._saved is None:
            self.module.__dict__.pop(self._attr, None)
        else:
            setattr(self.module, self._attr, self._saved)
