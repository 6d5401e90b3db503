"""The decoder attention rule: every text decoder layer's attention runs as one `decoder_attention` call through
transformers' own attention interface (`text.attention` sites), no forward rewritten (SPEC 14).

transformers' text attention modules (Llama, Qwen2/2.5-VL text, Qwen3, 4.57 and 5.x, remote-code copies alike)
call `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]` after the KV cache update. pypto-gym registers
"pypto_gym" there, and in `AttentionMaskInterface` with transformers' own `sdpa_mask` (so the masks our function
gets are exactly the ones sdpa gets), and sets it on the config the patched modules read (the text config:
instance-scoped to this model; the vision tower keeps its own). The function finds the module's site and runs the
op; a module without a site, the switch off, or a call the site declines (autograd, dropout, a sliding window, a
float mask, ...) runs transformers' `sdpa_attention_forward` itself, each decline counted with why. The first call
per dtype and device compares the op's golden with transformers' sdpa on the same inputs: a mismatch (a
transformers whose sdpa path the golden does not follow) sends every call back to sdpa, with the reason in the
report. Unpatch restores the configured implementation.

Only models configured with `sdpa` (transformers' default) are taken: eager rounds the softmax differently and a
flash-attention model is already one call per layer.
"""
from __future__ import annotations

import inspect

import torch

from ... import config
from ...ops import ArgTypeError, ArgValueError, dispatch, dtype_name
from ...ops.defs.decoder_attention import DECODER_ATTENTION
from ..rewrite import CHECK_REL_TOL
from ...kinds import part
from ..site import Candidate, Rule, Site, register

IMPLEMENTATION = "pypto_gym"
SLOT = "_pypto_gym_attention_site"  # the module's own forward may carry another site (text.rope) in site.SLOT
_STATE = config.STATE
_uses_interface: dict = {}  # class -> bool
_verified: dict = {}  # (class, dtype, device) -> True or the reason the op's result was rejected


def _sdpa():
    from transformers.integrations import sdpa_attention

    return sdpa_attention


def decode_gqa() -> str:
    """How the installed transformers hands a masked GQA decode step to sdpa: 5.x packs the query heads of a KV head
    as rows (`pack_gqa`), 4.57 repeats the KV heads."""
    return "pack" if hasattr(_sdpa(), "pack_gqa") else "repeat"


def register_implementation() -> None:
    """"pypto_gym" in transformers' attention and mask interfaces (idempotent)."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


def uses_attention_interface(cls) -> bool:
    """True when cls.forward dispatches its attention through transformers' ALL_ATTENTION_FUNCTIONS."""
    if cls not in _uses_interface:
        try:
            _uses_interface[cls] = "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
        except (OSError, TypeError):
            _uses_interface[cls] = False
    return _uses_interface[cls]


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      **kwargs):
    """transformers' attention function "pypto_gym": the module's site runs it, else transformers' sdpa does."""
    site = module.__dict__.get(SLOT)
    if site is not None and _STATE.enabled:
        out = site.apply(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
        if out is not None:
            return out, None
    return _sdpa().sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, is_causal=is_causal, **kwargs)


def _scale_and_causal(module, q, scaling, is_causal) -> tuple[float, bool]:
    """The op's scale and is_causal from what the module handed over (None: its defaults, as sdpa takes them)."""
    return (float(scaling if scaling is not None else q.shape[-1] ** -0.5),
            bool(is_causal if is_causal is not None else getattr(module, "is_causal", True)))


class DecoderAttentionSite(Site):
    """One text attention module whose attention runs as `decoder_attention`; its forward is left as it is."""

    op = DECODER_ATTENTION.name

    def __init__(self, cand: Candidate, options):
        super().__init__(cand.module, cand.paths, cand.kind, options.backend, options.strict)
        self.call = DECODER_ATTENTION.bind(options.backend, self.stats, decode_gqa=decode_gqa())
        self.previous = None

    def install(self) -> None:
        register_implementation()
        cfg = self.module.config
        self.previous = cfg._attn_implementation
        cfg._attn_implementation = IMPLEMENTATION
        self.module.__dict__[SLOT] = self

    def uninstall(self) -> None:
        self.module.__dict__.pop(SLOT, None)
        cfg = self.module.config
        if cfg._attn_implementation == IMPLEMENTATION and self.previous != IMPLEMENTATION:
            cfg._attn_implementation = self.previous

    def __setstate__(self, state):  # unpickled in a new process: its config names "pypto_gym"
        super().__setstate__(state)
        register_implementation()


    def details(self) -> dict:
        w = self.module.q_proj.weight
        return {"D": getattr(self.module, "head_dim", None), "dtype": dtype_name(w.dtype), "device": str(w.device),
                "fusion_bypassed": dict(self.bypassed)}

    def apply(self, module, q, k, v, mask, dropout, scaling, is_causal, kwargs):
        """HF's [B, Hq, S, D] query and [B, Hkv, Skv, D] cache -> [B, S, Hq, D], or None for transformers' sdpa to
        run, the reason counted."""
        why = self._declines(module, q, k, v, mask, dropout, kwargs)
        if why:
            self.bypass(why)
            return None
        scale, causal = _scale_and_causal(module, q, scaling, is_causal)
        key = (type(module), q.dtype, q.device.type)
        if key not in _verified and not torch.compiler.is_compiling():
            _verified[key] = self._check(module, q, k, v, mask, scaling, is_causal, kwargs)
        if _verified.get(key, True) is not True:
            self.bypass(_verified[key])
            return None
        try:
            return self.call(q, k, v, scale, causal, mask)
        except (ArgTypeError, ArgValueError) as e:
            self.bypass(f"the op refused the call ({str(e)[:80]})")
            return None

    def _check(self, module, q, k, v, mask, scaling, is_causal, kwargs):
        """The op's golden against transformers' sdpa on this call's inputs, as the module handed them over (first
        call per class, dtype, device)."""
        scale, causal = _scale_and_causal(module, q, scaling, is_causal)
        try:
            with torch.no_grad(), dispatch.reference():
                got = self.call(q, k, v, scale, causal, mask)
                want, _ = _sdpa().sdpa_attention_forward(module, q, k, v, mask, scaling=scaling, is_causal=is_causal,
                                                         **kwargs)
            diff = float((got.double() - want.double()).abs().max()) if got.shape == want.shape else float("inf")
            size = float(want.double().abs().max()) if want.numel() else 0.0
        except Exception as e:  # noqa: BLE001 - an unverifiable site is not used
            return f"first-call check could not run ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
        if diff <= CHECK_REL_TOL * max(size, 1e-6):
            return True
        return f"first-call check failed: decoder_attention differs from transformers' sdpa (max abs diff {diff:.3g})"

    @staticmethod
    def _declines(module, q, k, v, mask, dropout, kwargs) -> str:
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            return "autograd: decoder_attention has no backward"
        if dropout:
            return "dropout in training"
        for name in ("sliding_window", "softcap", "position_bias", "s_aux"):
            if kwargs.get(name) is not None:
                return f"{name} given: not decoder_attention's math"
        if kwargs.get("output_attentions"):
            return "output_attentions: the weights are not computed"
        if mask is not None and (mask.dtype != torch.bool or mask.dim() != 4):
            return f"a {dtype_name(mask.dtype)} mask of rank {mask.dim()}: expected transformers' bool [B, 1, S, Skv]"
        return ""


class DecoderAttentionRule(Rule):
    name, op, kind_suffix = "text_attention", DECODER_ATTENTION.name, "attention"
    labels = {DECODER_ATTENTION.name: "text attention"}
    after = ("attention",)  # the report lists the vision tower's sites first
    linears = ("q_proj", "k_proj", "v_proj", "o_proj")
    site_class = DecoderAttentionSite

    def classify(self, path, module, options=None):
        cfg = getattr(module, "config", None)
        if part(path) != "text" or cfg is None or not hasattr(module, "q_proj") \
                or not uses_attention_interface(type(module)):
            return None
        cand = Candidate(self, path, module, self.kind_of(path, module))
        impl = getattr(cfg, "_attn_implementation", None)
        if impl not in ("sdpa", IMPLEMENTATION):
            cand.reason = f"attention implementation {impl!r} configured: this site replaces transformers' sdpa only"
        return cand


TEXT_ATTENTIONS = register(DecoderAttentionRule())
