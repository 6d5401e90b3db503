"""The RMSNorm rule: every module that computes HF's RMSNorm becomes a `rms_norm` site.

A module is a candidate when it has a 1-D `weight`, no bias of that width (an RMSNorm has none: a
LayerNorm's is the layer_norm rule's) and an eps attribute (`variance_epsilon` or `eps`). A semantic
probe then runs the module's own forward on a small random input, on the module's own device with its
own weight (nothing moved or copied), and compares it with the `hf` RMSNorm formula: remote-code
norms with other class names pass, and look-alikes with other math (Gemma's `1 + weight`, a
LayerNorm without a bias) are skipped with the reason. Modules on the meta device cannot be run, so
they are classified by class name and attributes.

The site keeps the original Parameter (no copy; state_dict keys and `save_pretrained` output
unchanged). A fused layer (residual.py) calls the site's forward with the residual where the original
did `residual + hidden` and then `norm(...)`: one `add_rms_norm` (`takes_residual`).
"""
from __future__ import annotations

import torch

from ... import config
from ...ops.defs.rms_norm import ADD_RMS_NORM, RMS_NORM
from ...kinds import part
from ..site import Candidate, Rule, Site, probe_failed, register, site_of, weight_details

TEXT_KINDS = {"input_layernorm", "post_attention_layernorm", "q_norm", "k_norm"}
_PROBE_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
_STATE = config.STATE  # the master switch, read on every call


def norm_kind(path: str) -> str:
    """`vision.norm1`, `text.input_layernorm`, ... from the module path, for either transformers layout."""
    parts = path.split(".")
    attr, parent = parts[-1], parts[-2] if len(parts) > 1 else ""
    if part(path) == "vision":
        if parent == "merger" and attr == "ln_q":
            return "vision.merger.ln_q"
        if attr in ("norm1", "norm2"):
            return f"vision.{attr}"
        return f"other.{attr}"
    if attr in TEXT_KINDS:
        return f"text.{attr}"
    if attr == "norm" and not parent.isdigit():
        return "text.norm"
    return f"other.{attr}"


def eps_of(module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _probe(module, weight: torch.Tensor, eps: float) -> tuple[str, str]:
    """('', cast mode) if the module computes the RMSNorm formula, else (why not, ''). The cast mode is how it
    rounds: "hf" (Llama/Qwen: the normalised x rounded to x's dtype, then times the weight) unless its output is
    bit-identical to the one-rounding form instead, "fp32" (T5/Olmo2/GPT-OSS: the weight times the fp32
    normalised x, rounded once), which HF-style code cannot tell from its class name."""
    hook = getattr(module, "_hf_hook", None)  # accelerate: weights may live elsewhere until pre_forward
    device = getattr(hook, "execution_device", None) or weight.device
    dtype = weight.dtype if weight.is_floating_point() and weight.dtype in _PROBE_TOL else torch.float32
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(2, weight.shape[0], generator=gen).to(device=device, dtype=dtype) * 3 + 0.5
    try:
        with torch.no_grad():
            if hook is None:
                y = module.forward(x)  # bypasses torch forward hooks (a ShapeRecorder must not see probes)
                expected = RMS_NORM.golden(x, weight, eps, "hf")
            else:  # accelerate: the weight is only materialised between pre_forward and post_forward
                (x,), _ = hook.pre_forward(module, x)
                try:
                    y = module._old_forward(x)
                    expected = RMS_NORM.golden(x, module.weight, eps, "hf")
                finally:
                    hook.post_forward(module, x)
    except Exception as e:  # noqa: BLE001 - a module that cannot run on [2, D] is not an RMSNorm site
        return probe_failed(e), ""
    if not isinstance(y, torch.Tensor) or y.shape != expected.shape:
        return "probe: output is not a tensor of the input's shape", ""
    if not torch.equal(y, expected) and y.dtype == x.dtype:
        with torch.no_grad():
            one_rounding = RMS_NORM.golden(x, weight if hook is None else module.weight, eps, "fp32")
        if torch.equal(y, one_rounding):
            return "", "fp32"
    diff = float((y.float() - expected.float()).abs().max())
    scale = float(expected.float().abs().max()) or 1.0
    if not diff <= _PROBE_TOL[dtype] * scale:
        return f"probe: output differs from the RMSNorm formula (max abs diff {diff:.3g})", ""
    return "", "hf"


class NormSite(Site):
    """One patched norm: rms_norm (and add_rms_norm, in a fused layer) bound to its eps and cast mode."""

    op = RMS_NORM.name
    takes_residual = True  # residual.py fuses the add before it: forward(h, residual) -> (norm(r + h), r + h)

    def __init__(self, cand: Candidate, options):
        super().__init__(cand.module, cand.paths, cand.kind, options.backend, options.strict)
        self.eps = cand.info["eps"]
        # "hf" (the default) means as the module rounds: HF-Llama's two roundings, or the one its probe found
        self.cast_mode = cand.info["cast_mode"] if options.cast_mode == "hf" else options.cast_mode
        self.call = RMS_NORM.bind(options.backend, self.stats, eps=self.eps, cast_mode=self.cast_mode)
        self.add_call = ADD_RMS_NORM.bind(options.backend, self.stats, eps=self.eps, cast_mode=self.cast_mode,
                                          norm_input="rounded")
        self.fused = False
        self.fused_into = None  # "qk_norm_rope at <attention path>": the rotary site normalises for this norm
        self.quant = None  # W8A8 (pypto_gym.quant): the norm emits int8 rows for the linears after it
        # W8A8 static: a consumer's smooth scale (fp32 [D]) folded into the weight per call, as an export folds it
        # into the checkpoint's weight (the merger's ln_q, whose rows are regrouped before mlp.0 quantises them)
        self.weight_fold = None

    def details(self) -> dict:
        return {**weight_details(self.module.weight), "eps": self.eps, "cast_mode": self.cast_mode,
                "fused_residual": self.fused, "fused_into": self.fused_into, "fusion_bypassed": dict(self.bypassed),
                "quant": None if self.quant is None else self.quant.row()}


def norm_forward(module, hidden_states, residual=None):
    """The forward of every patched norm; with `residual`, returns (norm(residual + h), residual + h)."""
    site = module.__dict__["_pypto_gym_site"]
    if _STATE.enabled:
        if site.quant is not None:
            return site.quant.forward(site, module, hidden_states, residual)
        w = module._parameters["weight"]
        if site.weight_fold is not None:
            w = (w.float() * site.weight_fold).to(w.dtype)
        if residual is None:
            return site.call(hidden_states, w)
        return site.add_call(residual, hidden_states, w)
    if residual is None:
        return site.original(hidden_states)
    x_out = residual + hidden_states
    return site.original(x_out), x_out


NormSite.FORWARD = norm_forward


class NormRule(Rule):
    name, op = "norm", RMS_NORM.name
    labels = {RMS_NORM.name: "norm"}
    site_class = NormSite

    def kind_of(self, path, module):
        return norm_kind(path)

    def classify(self, path, module, options=None):
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        eps = eps_of(module)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or eps is None:
            return None
        if isinstance(bias, torch.Tensor) and bias.shape == weight.shape:  # a LayerNorm (layer_norm.py's, in vision)
            return None
        cand = Candidate(self, path, module, norm_kind(path), info={"eps": eps, "cast_mode": "hf"})
        if module._parameters.get("weight") is not weight:
            cand.reason = "weight is not a registered nn.Parameter"
        elif weight.is_meta and getattr(module, "_hf_hook", None) is None:
            name = type(module).__name__
            if not (name.endswith("RMSNorm") and "Gemma" not in name):
                cand.reason = f"meta device: {name} is not recognised as an RMSNorm by name"
        else:
            cand.reason, cand.info["cast_mode"] = _probe(module, weight, eps)
        return cand

    def skipped_details(self, cand):
        return {**weight_details(cand.module.weight), "eps": cand.info["eps"]}


NORMS = register(NormRule())


def norm_site(module) -> NormSite | None:
    site = site_of(module)
    return site if isinstance(site, NormSite) else None
