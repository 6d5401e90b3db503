"""The vision attention rule: every Qwen2.5-VL / Qwen2-VL vision attention runs the attention of all its windows as
one `varlen_attention` call (`vision.attention` sites) instead of HF's loop of one attention call per window.

A module is a candidate when its class's forward has the vision attention's statement `if <flash attention>: one
call with cu_seq_lens_q=... else: one call per window` (transformers 4.57 and 5.x, remote-code copies alike: found
by that structure, not by a class name) and a rotary call the rotary rule patches as `vision.rope`. The two ops
share one rewrite of the forward (rope.py): the rotary call goes through the rope site, and before the
flash-or-loop statement the rewrite asks this site for the attention of every window; the statement runs only
when the site declines (a call needing autograd, dropout in training, a flash-attention model, a call the op
refuses), each decline counted with why. So the forward is qkv -> the fused rotary -> the fused attention ->
proj, and the first call of the rewritten class is compared with HF's own forward (rewrite.py).
"""
from __future__ import annotations

import ast
import inspect
import textwrap

import torch

from ...ops import ArgTypeError, ArgValueError, dtype_name
from ...ops.defs.varlen_attention import VARLEN_ATTENTION
from ..site import Candidate, Rule, Site, register, selected, site_of
from .rope import ROPES, RopeSite, window_attention_statement

_has_window_loop: dict = {}  # class -> bool


def has_window_attention(cls) -> bool:
    """True when cls.forward has the vision attention's flash-or-per-window statement."""
    if cls not in _has_window_loop:
        try:
            fdef = ast.parse(textwrap.dedent(inspect.getsource(cls.forward))).body[0]
            _has_window_loop[cls] = isinstance(fdef, ast.FunctionDef) and \
                window_attention_statement(fdef) is not None
        except (OSError, TypeError, SyntaxError):
            _has_window_loop[cls] = False
    return _has_window_loop[cls]


class AttentionSite(Site):
    """One vision attention whose windows run as one `varlen_attention` call, inside its rope site's rewrite."""

    op = VARLEN_ATTENTION.name

    def __init__(self, cand: Candidate, options):
        super().__init__(cand.module, cand.paths, cand.kind, options.backend, options.strict)
        self.call = VARLEN_ATTENTION.bind(options.backend, self.stats,
                                          cast_mode="fp32" if options.cast_mode == "fp32" else "hf")

    def install(self) -> None:  # the rope site owns the forward: this site joins its rewrite
        site_of(self.module).attach(self)

    def uninstall(self) -> None:
        rope = site_of(self.module)
        if isinstance(rope, RopeSite) and rope.attention is self:
            rope.attach(None)


    def details(self) -> dict:
        w = getattr(getattr(self.module, "qkv", None), "weight", None)
        return {"D": getattr(self.module, "head_dim", None), "dtype": None if w is None else dtype_name(w.dtype),
                "device": None if w is None else str(w.device), "cast_mode": self.call.constants["cast_mode"],
                "fusion_bypassed": dict(self.bypassed)}

    def apply(self, module, q, k, v, cu_seqlens, scaling):
        """HF's [1, H, T, D] q, k, v -> the attention of every window as [1, T, H, D] (the layout HF's loop
        concatenates), or None for HF's own statement to run, the reason counted."""
        why = self._declines(module, q, k, v, cu_seqlens)
        if why:
            self.bypass(why)
            return None
        bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
        try:
            out = self.call(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), bounds, float(scaling))
        except (ArgTypeError, ArgValueError) as e:
            self.bypass(f"the op refused the call ({str(e)[:80]})")
            return None
        return out.unsqueeze(0)

    @staticmethod
    def _declines(module, q, k, v, cu_seqlens) -> str:
        impl = attention_implementation(module)
        if "flash" in str(impl):
            return "flash attention configured: HF makes one call already"
        if impl not in SDPA:  # set after patching (set_attn_implementation): the rule declined it at patch time
            return f"attention implementation {impl!r} configured: varlen_attention's golden is sdpa's math"
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            return "autograd: varlen_attention has no backward"
        if module.training and getattr(module, "attention_dropout", 0.0):
            return "dropout in training"
        if q.dim() != 4 or q.shape[0] != 1:
            return f"q of shape {tuple(q.shape)}; expected HF's [1, H, T, D]"
        return ""


SDPA = (None, "sdpa")  # what varlen_attention's golden (HF's per-window sdpa loop) is the math of


def attention_implementation(module):
    """The attention implementation a vision attention's config names (None where it names none: sdpa)."""
    return getattr(getattr(module, "config", None), "_attn_implementation", None)


class AttentionRule(Rule):
    name, op, kind_suffix = "attention", VARLEN_ATTENTION.name, "attention"
    labels = {VARLEN_ATTENTION.name: "vision attention"}
    after = ("rope",)  # a vision attention site joins its rope site's rewrite
    linears = ("qkv", "proj")
    site_class = AttentionSite

    def classify(self, path, module, options=None):
        if not has_window_attention(type(module)):
            return None
        cand = Candidate(self, path, module, self.kind_of(path, module))
        rope = ROPES.classify(path, module, options)
        if rope is None or rope.reason:
            cand.reason = f"its rotary call is not a rope site ({rope.reason if rope else 'none found'})"
        elif options is not None and selected(cand, options.sites) and not selected(rope, options.sites):
            cand.reason = f"runs inside its {rope.kind} site, which sites= does not select (add {rope.kind})"
        else:
            cand.reason = RopeSite.rewrite(type(module), fused=False, attention=True)[2]
        impl = attention_implementation(module)
        if not cand.reason and impl not in SDPA and "flash" not in str(impl):
            # eager rounds the softmax's exps differently from sdpa: the torch backend would not be the model's math
            cand.reason = f"attention implementation {impl!r} configured: varlen_attention's golden is sdpa's math"
        return cand


ATTENTIONS = register(AttentionRule())
