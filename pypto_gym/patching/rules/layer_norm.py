"""The vision LayerNorm rule: a vision tower's LayerNorms with a bias become `layer_norm` sites.

These are Qwen3-VL's (and Qwen2-VL's) blocks' norm1 and norm2 and the patch mergers' norm (`norm`, Qwen2-VL's
`ln_q`, the DeepStack mergers' `norm`). A module is a candidate when it sits in the vision tower (its path says so)
and is a LayerNorm by structure: a 1-D weight and a 1-D bias of one width, and an eps (an RMSNorm has no bias:
the RMSNorm rule leaves such modules to this one). A probe then runs the module's own forward on a small random
input, on its own device with its own weight, and requires the op's golden exactly (a remote-code LayerNorm with
other math is skipped with the reason). A LayerNorm anywhere else in a model is not one of these sites.
"""
from __future__ import annotations

import torch

from ... import config
from ...ops.defs.add_layer_norm import ADD_LAYER_NORM
from ...ops.defs.layer_norm import LAYER_NORM
from ...kinds import part
from ..site import Candidate, Rule, Site, probe_failed, register, weight_details

_STATE = config.STATE


def layer_norm_kind(path: str) -> str:
    """`vision.norm1`, `vision.merger.norm`, `vision.deepstack_merger.norm`, ... from the module path."""
    parts = path.split(".")
    attr = parts[-1]
    if attr in ("norm1", "norm2"):
        return f"vision.{attr}"
    merger = next((p for p in reversed(parts[:-1]) if "merger" in p), None)
    if merger is not None:
        return f"vision.{'deepstack_merger' if 'deepstack' in merger else 'merger'}.{attr}"
    return f"vision.{attr}"


def layer_norm_shape(module) -> tuple | None:
    """(D, eps) of a LayerNorm with a bias, by structure (weight and bias of one width), else None."""
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    eps = getattr(module, "eps", None)
    if not (isinstance(weight, torch.Tensor) and isinstance(bias, torch.Tensor) and weight.dim() == bias.dim() == 1
            and weight.shape == bias.shape and isinstance(eps, float)):
        return None
    return int(weight.shape[0]), eps


def _probe(module, D: int, eps: float) -> str:
    """'' if the module's forward is F.layer_norm over its last dim, bit for bit, else why not."""
    weight = module.weight
    if weight.is_meta or getattr(module, "_hf_hook", None) is not None:
        return "its weights are not here to probe (meta device or offloaded)"
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(3, D, generator=gen) * 2 + 0.5).to(device=weight.device, dtype=weight.dtype)
    try:
        with torch.no_grad():
            y = module.forward(x)  # bypasses torch forward hooks (a ShapeRecorder must not see probes)
            expected = LAYER_NORM.golden(x, weight, module.bias, eps)
    except Exception as e:  # noqa: BLE001 - a module that cannot run on [3, D] is not a LayerNorm site
        return probe_failed(e)
    if not isinstance(y, torch.Tensor) or y.shape != expected.shape or not torch.equal(y, expected):
        return "probe: output differs from F.layer_norm over the last dim"
    return ""


class LayerNormSite(Site):
    """One patched vision LayerNorm: layer_norm (and add_layer_norm, in a fused block) bound to its eps."""

    op = LAYER_NORM.name
    takes_residual = True  # residual.py fuses the block's residual add into norm2: add_layer_norm

    def __init__(self, cand: Candidate, options):
        super().__init__(cand.module, cand.paths, cand.kind, options.backend, options.strict)
        self.eps = cand.info["eps"]
        self.call = LAYER_NORM.bind(options.backend, self.stats, eps=self.eps)
        self.add_call = ADD_LAYER_NORM.bind(options.backend, self.stats, eps=self.eps)
        self.fused = False
        # W8A8 static: the smooth scale (fp32 [D]) of the linear reading its rows, folded into weight and bias per
        # call as an export folds it into the checkpoint's (Qwen3-VL's vision linears quantise their own input)
        self.weight_fold = None

    def details(self) -> dict:
        return {**weight_details(self.module.weight), "eps": self.eps, "fused_residual": self.fused,
                "fusion_bypassed": dict(self.bypassed)}


def layer_norm_forward(module, hidden_states, residual=None):
    """The forward of every patched LayerNorm; with `residual`, returns (norm(residual + h), residual + h)."""
    site = module.__dict__["_pypto_gym_site"]
    weight, bias = module._parameters["weight"], module._parameters["bias"]
    if _STATE.enabled:
        if site.weight_fold is not None:
            weight, bias = ((t.float() * site.weight_fold).to(t.dtype) for t in (weight, bias))
        if residual is None:
            return site.call(hidden_states, weight, bias)
        return site.add_call(residual, hidden_states, weight, bias)
    if residual is None:
        return site.original(hidden_states)
    x_out = residual + hidden_states
    return site.original(x_out), x_out


LayerNormSite.FORWARD = layer_norm_forward


class LayerNormRule(Rule):
    name, op = "layer_norm", LAYER_NORM.name
    labels = {LAYER_NORM.name: "layer norm"}
    after = ("patch_embed",)  # listed after the sites every family has
    site_class = LayerNormSite

    def kind_of(self, path, module):
        return layer_norm_kind(path)

    def classify(self, path, module, options=None):
        shape = layer_norm_shape(module)
        if shape is None or part(path) != "vision":
            return None
        D, eps = shape
        cand = Candidate(self, path, module, layer_norm_kind(path), info={"eps": eps})
        if module._parameters.get("weight") is not module.weight or module._parameters.get("bias") is not module.bias:
            cand.reason = "weight and bias are not registered nn.Parameters"
        else:
            cand.reason = _probe(module, D, eps)
        return cand

    def skipped_details(self, cand):
        return {**weight_details(cand.module.weight), "eps": cand.info["eps"]}


LAYER_NORMS = register(LayerNormRule())
