"""The rotary rule: every attention that rotates q and k with HF's rotary function becomes a `rope`
site (`text.rope`, `vision.rope`), or a `qk_norm_rope` site when q and k pass through per-head norms
first (`text.qk_norm_rope`: Qwen3).

A module is a candidate when its class's forward assigns `Q, K = F(...)` with F a function of its
module whose name says rotary (`apply_rotary_pos_emb`, `apply_multimodal_rotary_pos_emb` in
transformers 4.57, `apply_rotary_pos_emb_vision`). A numerical probe then runs F itself on small
random inputs in each form the op has (text: cos unsqueezed at its `unsqueeze_dim`, rounded as HF's
text function; vision: [S, H, D] with cos unsqueezed at -2, in fp32; MRoPE planes when F takes
`mrope_section`) and keeps the form whose result is bit-identical to the op's golden; a function
none of them matches is skipped with the reason.

The site is the attention module with its forward rewritten (rewrite.py): the call of F becomes a
call of the site, which maps F's arguments onto the op, and nothing else changes, so the patch is
instance-scoped (no function of transformers is reassigned; another model of the same class is
untouched, and Liger-style reassignment of F after patching is seen: the site then runs the new F,
counted). For qk_norm_rope the statements `Q = self.q_norm(X)<.transpose/.view ...>` lose the norm
call (the norm is per head vector, so it commutes with those) and the site normalises inside the
fused op with the norm sites' own weights and eps; those norm sites show it in the report. The
first eager call of each rewritten class is compared with the original forward (rewrite.py), and a
call the op cannot take (an argument the probe did not see) runs F, the bypass counted with why.
"""
from __future__ import annotations

import ast
import inspect
import textwrap

import torch

from ... import config
from ...ops import ArgTypeError, ArgValueError, dtype_name
from ...ops.defs.rope import QK_NORM_ROPE, ROPE
from ..rewrite import ReplaceNode, RewrittenForward, name_is, rewritten, self_attr_call
from ...kinds import part
from ..site import Candidate, Rule, Site, has_hooks, register
from .norm import norm_site

_STATE = config.STATE
_HELPER = "_pypto_gym_rope"
_ATTENTION_HELPER = "_pypto_gym_attention"
_NORMS = ("q_norm", "k_norm")
_SHAPE_METHODS = {"transpose", "view", "reshape", "permute", "contiguous"}
_forms: dict = {}  # rotary function -> (Form, reason)


class Form:
    """How one rotary function's arguments map onto the op: found by the probe. `cast_back`: the function rounds
    its results to q's and k's dtypes (Olmo2's, with fp32 cos and sin), where the op's hf mode keeps the dtype
    the products promote to (Llama's)."""

    def __init__(self, fn, unsqueeze_dim: int, cast_mode: str, cast_back: bool = False):
        self.fn, self.unsqueeze_dim, self.cast_mode, self.cast_back = fn, unsqueeze_dim, cast_mode, cast_back
        self.signature = inspect.signature(plain_function(fn))
        names = list(self.signature.parameters)
        self.mrope = "mrope_section" in names
        self.positional = 5 if self.mrope else 4  # HF's own calls: q, k, cos, sin (, mrope_section)

    def op_args(self, args, kwargs):
        """(q, k, cos, sin, mrope_section, unsqueeze_dim) for one call of the function, or None if it has an
        argument the probe did not establish the meaning of."""
        if not kwargs and len(args) == self.positional:
            q, k, cos, sin = args[:4]
            return q, k, cos, sin, list(args[4]) if self.mrope else [], self.unsqueeze_dim
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError:
            return None
        bound.apply_defaults()
        values = dict(bound.arguments)
        q, k, cos, sin = (values.pop(n) for n in list(self.signature.parameters)[:4])
        section = list(values.pop("mrope_section", []) or [])
        unsqueeze = values.pop("unsqueeze_dim", self.unsqueeze_dim)
        values.pop("position_ids", None)  # documented as unused by every HF function that takes it
        if values:
            return None
        return q, k, cos, sin, section, unsqueeze


def _probe_inputs(fn_mrope: bool, vision: bool, D: int, dtype=torch.bfloat16, angle_dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(0)
    if vision:
        q, k = torch.randn(3, 2, D, generator=gen), torch.randn(3, 1, D, generator=gen)
        cos_shape = (3, D)
    else:
        q, k = torch.randn(1, 2, 3, D, generator=gen), torch.randn(1, 1, 3, D, generator=gen)
        cos_shape = (3, 1, 3, D) if fn_mrope else (1, 3, D)
    cos, sin = (torch.randn(cos_shape, generator=gen) for _ in range(2))
    half = D // 2
    section = [half - 2 * (half // 3), half // 3, half // 3] if fn_mrope else []
    return [q.to(dtype), k.to(dtype), cos.to(angle_dtype), sin.to(angle_dtype)], section


# what the probe runs each form on: one dtype throughout, and bf16 q/k with fp32 cos/sin (Olmo2's rotary
# embedding returns fp32 angles): a function that casts back to q's dtype differs only there
PROBE_DTYPES = ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32))


def _form_result(fn, mrope, vision, unsqueeze_dim, cast_mode, cast_back, D):
    """(True, 0) if `fn` equals the golden in this form on every probe dtype pair, else (False, closest diff)."""
    closest = 0.0
    for dtype, angle_dtype in PROBE_DTYPES:
        (q, k, cos, sin), section = _probe_inputs(mrope, vision, D, dtype, angle_dtype)
        try:
            with torch.no_grad():
                got = fn(q, k, cos, sin, section) if mrope else fn(q, k, cos, sin)
            want = ROPE.golden(q, k, cos, sin, section, unsqueeze_dim, cast_mode)
        except Exception:  # noqa: BLE001 - a form the function cannot take is not its form
            return False, float("inf")
        if cast_back:
            want = (want[0].to(q.dtype), want[1].to(k.dtype))
        if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(g, torch.Tensor) for g in got)
                and all(g.shape == w.shape and g.dtype == w.dtype for g, w in zip(got, want))):
            return False, float("inf")
        if not all(torch.equal(g, w) for g, w in zip(got, want)):
            return False, max(float((g.float() - w.float()).abs().max()) for g, w in zip(got, want))
    return True, closest


def plain_function(fn):
    """The function a kernels-hub wrapper calls, else fn. With the `kernels` package installed (a dependency of
    transformers >= 5.25), `@use_kernel_forward_from_hub("rotary_pos_emb")` turns `apply_rotary_pos_emb` into an
    instance of a `Func` nn.Module whose forward calls the function (or a hub kernel once `kernelize`d): the
    module is what the attention calls, and probed as such; its signature and name are the function's."""
    forward = getattr(type(fn), "forward", None)
    code = getattr(forward, "__code__", None)
    if isinstance(fn, torch.nn.Module) and code is not None and "func" in code.co_freevars and forward.__closure__:
        return forward.__closure__[code.co_freevars.index("func")].cell_contents
    return fn


def function_name(fn) -> str:
    return getattr(plain_function(fn), "__name__", type(fn).__name__)


def probe(fn, D: int):
    """(Form, "") for the first form in which `fn` gives exactly the golden's result, else (None, why not)."""
    if fn in _forms:
        return _forms[fn]
    try:
        params = inspect.signature(plain_function(fn)).parameters
    except (TypeError, ValueError):
        return None, f"{function_name(fn)}: no signature"
    mrope = "mrope_section" in params
    default_u = params["unsqueeze_dim"].default if "unsqueeze_dim" in params else 1
    closest = float("inf")
    result = None, ""
    for vision, unsqueeze_dim, cast_mode in ((False, default_u, "hf"), (True, -2, "fp32"), (False, default_u, "fp32"),
                                              (True, -2, "hf")):
        if vision and mrope:
            continue
        for cast_back in (False, True):
            ok, diff = _form_result(fn, mrope, vision, unsqueeze_dim, cast_mode, cast_back, D)
            if ok:
                result = Form(fn, unsqueeze_dim, cast_mode, cast_back), ""
                break
            closest = min(closest, diff)
        if result[0] is not None:
            break
    if result[0] is None:
        result = None, (f"probe: {function_name(fn)} is not a rotate-half rotation of q and k in any form the op has "
                        f"(closest max abs diff {closest:.3g})")
    _forms[fn] = result
    return result


# ---- recognising the statements ----------------------------------------------------------------------
def _rotary_calls(fdef, module_globals):
    """[(statement index, call, function name)] of `Q, K = F(...)` statements with F a rotary function."""
    found = []
    for i, stmt in enumerate(fdef.body):
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Tuple)
                and len(stmt.targets[0].elts) == 2 and all(name_is(e) for e in stmt.targets[0].elts)
                and isinstance(stmt.value, ast.Call) and name_is(stmt.value.func)):
            continue
        name = stmt.value.func.id
        if "rotary" in name and callable(module_globals.get(name)):
            found.append((i, stmt.value, name))
    return found


_rotary_of: dict = {}  # class -> (name of its rotary function or None, reason)


def rotary_function(cls):
    """(function, '') for the one rotary call in cls.forward; (None, '') when it has none (not a candidate);
    (None, why not) when it cannot be read or has several. The source is read once per class; the function is
    the one its module holds now (a function monkeypatched since an earlier patch is the one probed)."""
    module_globals = getattr(inspect.unwrap(cls.forward), "__globals__", {})
    if cls not in _rotary_of:
        try:
            fdef = ast.parse(textwrap.dedent(inspect.getsource(cls.forward))).body[0]
            calls = _rotary_calls(fdef, module_globals) if isinstance(fdef, ast.FunctionDef) else []
        except (OSError, TypeError, SyntaxError):
            calls = []  # a forward without readable source is not recognisable as an attention
        if not calls:
            _rotary_of[cls] = None, ""
        elif len(calls) > 1:
            _rotary_of[cls] = None, f"{cls.__name__}.forward has {len(calls)} rotary calls; expected one"
        else:
            _rotary_of[cls] = calls[0][2], ""
    name, reason = _rotary_of[cls]
    return (None, reason) if name is None else (module_globals.get(name), "")


def _norm_statement(stmt, norm: str):
    """The `self.NORM(X)` call of `Q = <shape methods of> self.NORM(X)`, or None."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and name_is(stmt.targets[0])):
        return None
    node = stmt.value
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _SHAPE_METHODS \
            and not name_is(node.func.value, "self"):
        node = node.func.value
    if self_attr_call(node, {norm}) and len(node.args) == 1 and not node.keywords:
        return node
    return None


def window_attention_statement(fdef):
    """(index, the flash branch's call, its target name) of the vision attention's `if <flash>: one call with
    cu_seq_lens_q ... else: one call per window` statement, or None."""
    for i, stmt in enumerate(fdef.body):
        if not isinstance(stmt, ast.If):
            continue
        for branch in (stmt.body, stmt.orelse):
            for node in branch:
                if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.value, ast.Call)
                        and any(kw.arg == "cu_seq_lens_q" for kw in node.value.keywords)):
                    continue
                target = node.targets[0]
                target = target.elts[0] if isinstance(target, ast.Tuple) and target.elts else target
                if name_is(target) and len(node.value.args) >= 4 and name_is(node.value.args[0], "self"):
                    return i, node.value, target.id
    return None


def transform(fdef, module_globals, fused_norms: bool, attention: bool = False):
    """Route the rotary call through the site; with fused_norms, also drop q_norm/k_norm from the statements
    assigning the names rotated (only uses between them and the rotation would see unnormalised values:
    refused); with attention, put `OUT = <the site's attention>(self, Q, K, V, cu_seqlens, scaling)` before the
    vision attention's flash-or-per-window statement, which then runs only when the site declines (returns
    None). Returns what changed."""
    changed = []
    if attention:
        found = window_attention_statement(fdef)
        if found is None:
            raise ValueError("no `if <flash attention>: ... cu_seq_lens_q=... else: <per-window loop>` statement")
        i, call, target = found
        keywords = {kw.arg: kw.value for kw in call.keywords}
        if "scaling" not in keywords:
            raise ValueError("the flash branch's attention call has no scaling=")
        fused = ast.Assign(targets=[ast.Name(target, ast.Store())], value=ast.Call(
            func=ast.Name(_ATTENTION_HELPER, ast.Load()),
            args=[*call.args[:4], keywords["cu_seq_lens_q"], keywords["scaling"]], keywords=[]))
        declined = ast.If(test=ast.Compare(left=ast.Name(target, ast.Load()), ops=[ast.Is()],
                                           comparators=[ast.Constant(None)]), body=[fdef.body[i]], orelse=[])
        fdef.body[i:i + 1] = [fused, declined]
        changed.append("window attention")
    calls = _rotary_calls(fdef, module_globals)
    if len(calls) != 1:
        raise ValueError(f"{len(calls)} rotary calls")
    i, call, name = calls[0]
    changed.insert(0, name)
    if fused_norms:
        for norm, arg in zip(_NORMS, call.args[:2]):
            if not name_is(arg):
                raise ValueError(f"the rotary call's {'q' if norm == 'q_norm' else 'k'} is not a name")
            j = max((j for j in range(i) if _norm_statement(fdef.body[j], norm) is not None
                     and fdef.body[j].targets[0].id == arg.id), default=None)
            if j is None:
                raise ValueError(f"no `{arg.id} = self.{norm}(...)` statement before the rotation")
            if any(name_is(n, arg.id) and isinstance(n.ctx, ast.Load)
                   for stmt in fdef.body[j + 1:i] for n in ast.walk(stmt)):
                raise ValueError(f"{arg.id} is used between self.{norm} and the rotation")
            norm_call = _norm_statement(fdef.body[j], norm)
            fdef.body[j] = ReplaceNode(norm_call, norm_call.args[0]).visit(fdef.body[j])
            changed.append(norm)
    call.args = [ast.Name("self", ast.Load()), ast.Name(name, ast.Load()), *call.args]
    call.func = ast.Name(_HELPER, ast.Load())
    return changed


# ---- the site -----------------------------------------------------------------------------------------
class RopeSite(RewrittenForward, Site):
    """One attention whose rotary call runs `rope` (or `qk_norm_rope`, with its q/k norm sites' weights)."""

    def __init__(self, cand: Candidate, options):
        super().__init__(cand.module, cand.paths, cand.kind, options.backend, options.strict)
        self.form: Form = cand.info["form"]
        self.norms = cand.info["norms"]  # the q_norm/k_norm sites, when fused
        self.op = (QK_NORM_ROPE if self.norms else ROPE).name
        self.attention = None  # the vision.attention site (attention.py) whose op this rewrite also runs
        cast = "fp32" if options.cast_mode == "fp32" else self.form.cast_mode  # hf: HF's own rounding per form
        if self.norms:
            q_site, k_site = self.norms
            self.call = QK_NORM_ROPE.bind(options.backend, self.stats, q_eps=q_site.eps, k_eps=k_site.eps,
                                          cast_mode=cast)
        else:
            self.call = ROPE.bind(options.backend, self.stats, cast_mode=cast)
        self._fn = None

    @property
    def key(self):
        """Which rewrite of the class (rewrite.py's verdicts are per key)."""
        return "rope", bool(self.norms), self.attention is not None

    @staticmethod
    def rewrite(cls, fused: bool, attention: bool = False):
        """(function, what changed, reason): cls.forward with its rotary call (and, fused, its q/k norms; with
        attention, its per-window attention) routed through the site."""
        return rewritten(cls, ("rope", fused, attention), lambda fdef, g: transform(fdef, g, fused, attention),
                         {_HELPER: rope_call, _ATTENTION_HELPER: attention_call})

    def build(self):
        return self.rewrite(type(self.module), bool(self.norms), self.attention is not None)

    def attach(self, attention) -> None:
        """Run `attention`'s op in this site's rewrite too (None: detach); the rewrite is rebuilt and checked."""
        self.attention = attention
        self._fn = None

    def install(self) -> None:
        super().install()
        for s in self.norms:
            s.fused_into = f"{self.op} at {self.path}"

    def uninstall(self) -> None:
        for s in self.norms:
            s.fused_into = None
        super().uninstall()

    def rejected_now(self) -> None:
        for s in self.norms:
            s.fused_into = None


    def details(self) -> dict:
        q_proj = getattr(self.module, "q_proj", None) or getattr(self.module, "qkv", None)
        w = getattr(q_proj, "weight", None)
        return {"D": getattr(self.module, "head_dim", None), "dtype": None if w is None else dtype_name(w.dtype),
                "device": None if w is None else str(w.device), "fusion_bypassed": dict(self.bypassed),
                "rotary": {"function": function_name(self.form.fn), "cast_mode": self.call.constants["cast_mode"],
                           "rejected": self.rejected}}

    def apply(self, fn, args, kwargs):
        """One rotary call of the rewritten forward: the fused op where it takes the call, else `fn` itself."""
        if fn is not self.form.fn:
            self.bypass(f"{function_name(fn)} was replaced after patching")
            return self._unfused(fn, args, kwargs)
        mapped = self.form.op_args(args, kwargs)
        if mapped is None:
            self.bypass("a call with arguments the probe did not see")
            return self._unfused(fn, args, kwargs)
        q, k, cos, sin, section, unsqueeze = mapped
        try:
            if self.norms:
                qw, kw = (s.module._parameters["weight"] for s in self.norms)
                out = self.call(q, k, qw, kw, cos, sin, section, unsqueeze)
            else:
                out = self.call(q, k, cos, sin, section, unsqueeze)
        except (ArgTypeError, ArgValueError) as e:
            self.bypass(f"the op refused the call ({str(e)[:80]})")
            return self._unfused(fn, args, kwargs)
        if self.form.cast_back:
            return out[0].to(q.dtype), out[1].to(k.dtype)
        return out

    def _unfused(self, fn, args, kwargs):
        if self.norms:  # the rewritten forward dropped the norms: apply them first (per head: exact)
            q_norm, k_norm = (s.module for s in self.norms)
            args = (q_norm(args[0]), k_norm(args[1]), *args[2:])
        return fn(*args, **kwargs)


def rope_call(module, fn, *args, **kwargs):
    """What the rewritten forward calls instead of the rotary function `fn`."""
    return module.__dict__["_pypto_gym_site"].apply(fn, args, kwargs)


def attention_call(module, q, k, v, cu_seqlens, scaling):
    """What the rewritten forward runs before HF's flash-or-per-window statement: the attention of every window
    as [1, T, H, D], or None for HF's own statement to run (no attention site attached, or it declined)."""
    attention = module.__dict__["_pypto_gym_site"].attention
    return None if attention is None else attention.apply(module, q, k, v, cu_seqlens, scaling)


def rope_forward(module, *args, **kwargs):
    """The forward of every patched attention: the rewrite (once its class passed the check), else the
    original; the original also when the switch is off or a fused norm has hooks (which must see it run)."""
    site = module.__dict__["_pypto_gym_site"]
    if not _STATE.enabled:
        return site.original(*args, **kwargs)
    if site.norms and any(has_hooks(s.module) for s in site.norms):
        site.bypass("q_norm/k_norm has hooks")
        return site.original(*args, **kwargs)
    return site.run(module, args, kwargs)


RopeSite.FORWARD = rope_forward


class RopeRule(Rule):
    name, op = "rope", ROPE.name
    labels = {ROPE.name: "rope", QK_NORM_ROPE.name: "qk-norm+rope"}
    after = ("norm", "mlp")  # a qk_norm_rope site takes over its q/k norm sites
    site_class = RopeSite

    def kind_of(self, path, module):
        if part(path) == "text" and all(hasattr(module, n) for n in _NORMS):
            return "text.qk_norm_rope"
        return f"{part(path)}.rope"

    def classify(self, path, module, options=None):
        fn, reason = rotary_function(type(module))
        if fn is None and not reason:
            return None
        cand = Candidate(self, path, module, self.kind_of(path, module), reason=reason, info={"norms": ()})
        if fn is not None:
            D = int(getattr(module, "head_dim", 0) or 0)
            cand.info["form"], cand.reason = probe(fn, D if D >= 2 and D % 2 == 0 else 16)
        if not cand.reason:  # the rotation alone must be rewritable; q/k norm fusion is decided at install
            cand.reason = RopeSite.rewrite(type(module), fused=False)[2]
        return cand

    def install(self, cand, options):
        if cand.kind == "text.qk_norm_rope":
            sites = tuple(norm_site(getattr(cand.module, n)) for n in _NORMS)
            # the fused op rounds its norm as HF-Llama does: a one-rounding q/k norm keeps its own site
            if all(s is not None and s.cast_mode == options.cast_mode for s in sites) \
                    and RopeSite.rewrite(type(cand.module), fused=True)[0] is not None:
                cand.info["norms"] = sites
        return super().install(cand, options)


ROPES = register(RopeRule())
