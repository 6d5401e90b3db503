"""The patch-embedding rule: a vision tower's Conv3d patch embedding runs as the GEMM it is (`vision.patch_embed`).

A module is a candidate when its `proj` is an nn.Conv3d whose kernel is its stride (no padding, dilation or
groups: each output sees one whole patch), as Qwen2-VL's and Qwen2.5-VL's patch embeddings (4.57 and 5.x, and
remote-code copies: found by that structure, not by a class name). A numerical probe then runs the module's own
forward on a few random patch rows and compares it with the op's golden (the conv3d on the rows viewed as
patches), so a forward that does anything else with its pixels is skipped with the reason. The patched forward
casts the rows to the weight's dtype as HF's does and calls `patch_embed` on the same weight (viewed, never
copied: the state dict and the module are unchanged). A model loaded with transformers' own
`fusion_config={"patch_embeddings": True}` has a linear there already and no candidate.
"""
from __future__ import annotations

import math

import torch

from ... import config
from ...ops import registry
from ...ops.defs.patch_embed import PATCH_EMBED
from ..site import (GEMM_PROBE_TOL, Candidate, Rule, Site, gemm_probe_diff, has_hooks, probe_failed, register,
                    torch_hooks_set_aside, weight_details)

_STATE = config.STATE


def _patch_conv(module) -> torch.nn.Conv3d | None:
    """module.proj when it is a Conv3d that sees each patch once (kernel = stride, no padding/dilation/groups)."""
    conv = getattr(module, "proj", None)
    if not isinstance(conv, torch.nn.Conv3d) or isinstance(conv.padding, str):
        return None
    plain = tuple(conv.kernel_size) == tuple(conv.stride) and not any(conv.padding) and \
        all(d == 1 for d in conv.dilation) and conv.groups == 1
    return conv if plain else None


class PatchEmbedSite(Site):
    """One patch embedding whose Conv3d runs as `patch_embed` (the GEMM) on its backend."""

    op = PATCH_EMBED.name

    def __init__(self, cand: Candidate, options):
        super().__init__(cand.module, cand.paths, cand.kind, options.backend, options.strict)
        self.call = PATCH_EMBED.bind(options.backend, self.stats)

    def details(self) -> dict:
        return {**weight_details(self.module.proj.weight), "fusion_bypassed": dict(self.bypassed)}


def patch_embed_forward(module, hidden_states):
    """HF's forward (rows cast to the weight's dtype, one output row per patch) with the conv as one GEMM."""
    site = module.__dict__["_pypto_gym_site"]
    conv = module.proj
    if not _STATE.enabled:
        return site.original(hidden_states)
    w = conv.weight
    why = ("proj has hooks" if has_hooks(conv) or "_hf_hook" in conv.__dict__  # accelerate's bring the weight
           else "autograd: patch_embed has no backward" if torch.is_grad_enabled() and
           (hidden_states.requires_grad or w.requires_grad) else "")
    if why:  # HF's own forward, counted
        site.bypass(why)
        return site.original(hidden_states)
    x = hidden_states.to(dtype=w.dtype).reshape(-1, math.prod(w.shape[1:]))
    return site.call(x, w, conv.bias)


PatchEmbedSite.FORWARD = patch_embed_forward


def _probe(module, conv) -> str:
    """'' if the module's forward is the conv over its input's rows viewed as patches, else why not."""
    w = conv.weight
    dtype = w.dtype if w.dtype in GEMM_PROBE_TOL else torch.float32
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(4, math.prod(w.shape[1:]), generator=gen).to(device=w.device, dtype=dtype)
    try:
        with torch.no_grad(), torch_hooks_set_aside(module):  # a probe is not a call anyone's hooks should see
            got, want = module.forward(x), PATCH_EMBED.golden(x, w, conv.bias)
    except Exception as e:  # noqa: BLE001 - a module that cannot embed [4, K] rows is not this site
        return probe_failed(e)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return "probe: output is not one row per patch of proj's channels"
    ok, diff = gemm_probe_diff(got, want, dtype)
    if not ok:
        return f"probe: forward is not proj's conv over its rows viewed as patches (max abs diff {diff:.3g})"
    return ""


class PatchEmbedRule(Rule):
    name, op, kind_suffix = "patch_embed", PATCH_EMBED.name, "patch_embed"
    labels = {PATCH_EMBED.name: "patch embedding"}
    after = ("text_attention",)  # listed last in the report
    site_class = PatchEmbedSite

    def classify(self, path, module, options=None):
        conv = _patch_conv(module)
        if conv is None:
            return None
        cand = Candidate(self, path, module, self.kind_of(path, module))
        family = None if options is None or options.backend == "auto" else registry.get(options.backend).family
        if family in PATCH_EMBED.unsupported:
            cand.reason = PATCH_EMBED.unsupported[family]
        elif conv.weight.is_meta:
            cand.reason = "meta device: the probe cannot run"
        else:
            cand.reason = _probe(module, conv)
        return cand

    def skipped_details(self, cand):
        return weight_details(cand.module.proj.weight)


PATCH_EMBEDS = register(PatchEmbedRule())
