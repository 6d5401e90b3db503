"""The residual-add rule: `residual + h` followed by the next norm becomes one `add_rms_norm` (an RMSNorm site) or
`add_layer_norm` (a LayerNorm site: Qwen3-VL's vision blocks), by rewriting layer forwards (rewrite.py: the class's
own forward source with two statement patterns changed, checked numerically against the original on its first
call):

  decoder:  H = R + H ; R = H ; ... self.NORM(H) ...   ->  __n, R = add_norm(self.NORM, H, R) ; H = R ; ... __n ...
  vision:   H = H + E ; ... self.NORM(H) ...           ->  __n, H = add_norm(self.NORM, E, H) ; ... __n ...

NORM must be a patched norm site that takes a residual (`takes_residual`: its forward(h, residual) returns
(norm(residual + h), residual + h)); `add_norm` decides per call whether fusing is exactly the original: not when
the norm has torch hooks (which must see one tensor in and one out) or the add would promote or broadcast; then it
adds and calls the norm normally, and counts the bypass and its reason.
"""
from __future__ import annotations

import ast

import torch

from .rewrite import ReplaceNode, RewrittenForward, name_is, rewritten, self_attr_call
from .site import SwappedForward, has_hooks, site_of

_FUSED_NAME = "_pypto_gym_normed"
_HELPER = "_pypto_gym_add_norm"
_LAYER_SLOT = "_pypto_gym_fused_layer"


def residual_site(module):
    """The patched norm site of `module` that takes a residual, or None."""
    site = site_of(module)
    return site if getattr(site, "takes_residual", False) else None


def _bypass_reason(norm, hidden, residual) -> str | None:
    if has_hooks(norm):
        return "the norm has hooks"
    if not isinstance(residual, torch.Tensor) or residual.dtype != hidden.dtype or residual.shape != hidden.shape:
        return "the residual add promotes or broadcasts"
    return None


def add_norm(norm: torch.nn.Module, hidden, residual):
    """`x_out = residual + hidden; return norm(x_out), x_out`, as one fused op where that is exactly the same."""
    site = site_of(norm)
    reason = "the norm is not patched" if residual_site(norm) is None else _bypass_reason(norm, hidden, residual)
    if reason is None:
        return norm.forward(hidden, residual=residual)
    if site is not None:
        site.bypass(reason)
    x_out = residual + hidden
    return norm(x_out), x_out


def _assign_to(stmt) -> str | None:
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and name_is(stmt.targets[0]):
        return stmt.targets[0].id
    return None


def _norm_call(stmt, h: str, norms: set) -> ast.Call | None:
    """The single `self.NORM(h)` call inside stmt, NORM a fusable child, or None."""
    calls = [n for n in ast.walk(stmt) if self_attr_call(n, norms) and len(n.args) == 1 and name_is(n.args[0], h)
             and not n.keywords]
    return calls[0] if len(calls) == 1 else None


def _fused_call(norm: str, hidden: ast.expr, residual: str, target: str) -> ast.Assign:
    """`__n, target = add_norm(self.NORM, hidden, residual)`."""
    call = ast.Call(func=ast.Name(_HELPER, ast.Load()),
                    args=[ast.Attribute(value=ast.Name("self", ast.Load()), attr=norm, ctx=ast.Load()), hidden,
                          ast.Name(residual, ast.Load())], keywords=[])
    tup = ast.Tuple([ast.Name(_FUSED_NAME, ast.Store()), ast.Name(target, ast.Store())], ast.Store())
    return ast.Assign(targets=[tup], value=call)


def rewrite_body(body: list, norms: set) -> tuple[list, list]:
    """Apply the two patterns to a statement list; returns (new body, names of fused norms)."""
    out, fused, i = [], [], 0
    while i < len(body):
        s = body[i]
        h = _assign_to(s)
        add = s.value if h and isinstance(s.value, ast.BinOp) and isinstance(s.value.op, ast.Add) else None
        if add is not None and i + 2 < len(body) and name_is(add.left) and name_is(add.right) \
                and h in (add.left.id, add.right.id):  # decoder: H = R + H ; R = H ; ... self.NORM(H)
            r = add.right.id if add.left.id == h else add.left.id
            nxt, call_stmt = body[i + 1], body[i + 2]
            call = _norm_call(call_stmt, h, norms) if _assign_to(nxt) == r and name_is(nxt.value, h) else None
            if call is not None and r != h:
                # x_out = residual + hidden keeps the original operand order: `R + H` or `H + R`
                hid, res = (h, r) if add.right.id == h else (r, h)
                out.append(_fused_call(call.func.attr, ast.Name(hid, ast.Load()), res, r))
                out.append(ast.Assign(targets=[ast.Name(h, ast.Store())], value=ast.Name(r, ast.Load())))
                out.append(ReplaceNode(call, ast.Name(_FUSED_NAME, ast.Load())).visit(call_stmt))
                fused.append(call.func.attr)
                i += 3
                continue
        if add is not None and i + 1 < len(body) and name_is(add.left, h):  # vision: H = H + E ; ... self.NORM(H)
            call = _norm_call(body[i + 1], h, norms)
            if call is not None:
                out.append(_fused_call(call.func.attr, add.right, h, h))
                out.append(ReplaceNode(call, ast.Name(_FUSED_NAME, ast.Load())).visit(body[i + 1]))
                fused.append(call.func.attr)
                i += 2
                continue
        out.append(s)
        i += 1
    return out, fused


def fused_forward(cls, norms: frozenset):
    """(function, fused norm names, reason): the rewritten `cls.forward`, compiled once per class."""
    def transform(fdef, module_globals):
        fdef.body, fused = rewrite_body(fdef.body, set(norms))
        return fused

    fn, fused, reason = rewritten(cls, norms, transform, {_HELPER: add_norm})
    if fn is None and reason.endswith("has no pattern to rewrite"):
        reason = f"{cls.__name__}.forward has no residual-add + norm pattern"
    return fn, fused or [], reason


class FusedLayer(RewrittenForward, SwappedForward):
    """A layer whose forward was swapped for the fused rewrite (restored exactly by uninstall)."""

    SLOT = _LAYER_SLOT

    def __init__(self, path: str, module: torch.nn.Module, norms: frozenset, fused: list):
        super().__init__(module)
        self.path, self.key, self.fused = path, norms, fused
        self._fn = None

    def build(self):
        return fused_forward(type(self.module), self.key)

    def install(self) -> None:
        super().install()
        for name in self.fused:
            residual_site(getattr(self.module, name)).fused = True

    def rejected_now(self) -> None:
        for name in self.fused:
            residual_site(getattr(self.module, name)).fused = False


def fused_layer_forward(module, *args, **kwargs):
    """The forward of every fused layer: the rewrite once its class passed the check, else the original."""
    return module.__dict__[_LAYER_SLOT].run(module, args, kwargs)


FusedLayer.FORWARD = fused_layer_forward


def fuse_layers(model, layers: list) -> list[dict]:
    """Rewrite every layer that has patched norm children and a recognised residual pattern (appended to
    `layers`); returns the rows of layers that have a fusable norm but could not be rewritten, with why."""
    skipped = []
    for path, module in model.named_modules():
        norms = frozenset(name for name, child in module.named_children() if residual_site(child) is not None)
        if not norms:
            continue
        fn, fused, reason = fused_forward(type(module), norms)
        if fn is None:
            kinds = {residual_site(getattr(module, n)).kind for n in norms}
            if kinds & {"text.post_attention_layernorm", "vision.norm2"}:
                skipped.append({"path": path, "reason": reason})
            continue
        layer = FusedLayer(path, module, norms, fused)
        layer.install()
        layers.append(layer)
    return skipped
