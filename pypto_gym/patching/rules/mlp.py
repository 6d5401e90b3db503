"""The SwiGLU MLP rule: every `down_proj(act_fn(gate_proj(x)) * up_proj(x))` becomes a `swiglu` site.

A module is a candidate when it has gate_proj, up_proj and down_proj linears (Qwen2/2.5-VL text and
vision MLPs, Qwen3, Llama); a numerical probe then runs the module's own forward on a small random
input and compares it with `down_proj(silu(gate_proj(x)) * up_proj(x))` computed with its own
projections, so an MLP whose act_fn is GELU (Gemma) is skipped with the reason; an MLP that is not
gated at all (fc1 -> act -> fc2) is the GELU MLP rule's (gelu_mlp.py).

The patched forward calls the module's own projections (their hooks, accelerate's offload hooks and
tensor-parallel sharding stay theirs: with gate/up sharded column-wise the op runs on the local
shard, elementwise) and the fused op between them, instead of act_fn then a multiply. A torch hook
on act_fn would see nothing of that, so an MLP whose act_fn has hooks runs its original forward, the
call counted as bypassed. The norms' cast mode picks swiglu's: `fp32` rounds once, `hf`/`none` as HF.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import config
from ...ops.defs.swiglu import SWIGLU
from ..site import (GEMM_PROBE_TOL, Candidate, Rule, Site, gemm_probe_diff, has_hooks, probe_failed, register,
                    torch_hooks_set_aside, weight_details)

_STATE = config.STATE


def _linear(module, name):
    child = getattr(module, name, None)
    return child if isinstance(getattr(child, "weight", None), torch.Tensor) else None


class MlpSite(Site):
    """One patched SwiGLU MLP: swiglu bound to its backend, counters and cast mode."""

    op = SWIGLU.name

    def __init__(self, cand: Candidate, options):
        super().__init__(cand.module, cand.paths, cand.kind, options.backend, options.strict)
        self.cast_mode = "fp32" if options.cast_mode == "fp32" else "hf"
        self.call = SWIGLU.bind(options.backend, self.stats, cast_mode=self.cast_mode)
        self.quant = None  # W8A8 (pypto_gym.quant): int8 gate/up in, int8 rows out to an int8 down_proj

    def details(self) -> dict:
        return {**weight_details(self.module.gate_proj.weight), "fusion_bypassed": dict(self.bypassed),
                "quant": None if self.quant is None else self.quant.row()}


def mlp_forward(module, x):
    """The forward of every patched MLP: its projections and one fused swiglu between them."""
    site = module.__dict__["_pypto_gym_site"]
    if not _STATE.enabled:
        return site.original(x)
    if has_hooks(module.act_fn):
        site.bypass("act_fn has hooks")
        return site.original(x)
    if site.quant is not None:
        return site.quant.forward(site, module, x)
    return module.down_proj(site.call(module.gate_proj(x), module.up_proj(x)))


MlpSite.FORWARD = mlp_forward


# activations a gated MLP may have instead of SiLU: the probe's output must be closer to SiLU's than to each
_LOOKALIKES = (("GELU", F.gelu), ("GELU (tanh)", lambda t: F.gelu(t, approximate="tanh")),
               ("QuickGELU", lambda t: t * torch.sigmoid(1.702 * t)))
PROBE_GATE_STD = 2.0  # the probe's gate outputs: where SiLU and GELU differ by ~10%, far above bf16's rounding


def _probe(module) -> str:
    """'' if the module computes down_proj(silu(gate_proj(x)) * up_proj(x)), else why not.

    On N(0, 1) inputs a gate with small weights outputs z near 0, where gelu(z) ~ silu(z) ~ z/2 within bf16's
    rounding: a GeGLU MLP passed. So the input is scaled to gate outputs of std PROBE_GATE_STD, and the module
    must be closer to SiLU's result than to GELU's, GELU-tanh's and QuickGELU's (and within tolerance of it)."""
    w = module.gate_proj.weight
    hook = getattr(module.gate_proj, "_hf_hook", None)
    device = getattr(hook, "execution_device", None) or w.device
    dtype = w.dtype if w.dtype in GEMM_PROBE_TOL else torch.float32
    gen = torch.Generator(device="cpu").manual_seed(0)
    H = module.gate_proj.in_features if hasattr(module.gate_proj, "in_features") else w.shape[-1]
    x = torch.randn(4, H, generator=gen).to(device=device, dtype=dtype)
    try:
        with torch.no_grad(), torch_hooks_set_aside(module):  # a probe is not a call anyone's hooks should see
            spread = float(module.gate_proj(x).float().std())
            if spread > 0:
                x = (x.float() * (PROBE_GATE_STD / spread)).to(dtype)
            got = module.forward(x)
            gate, up = module.gate_proj(x), module.up_proj(x)
            want = module.down_proj(F.silu(gate) * up)
            others = [(name, module.down_proj(act(gate) * up)) for name, act in _LOOKALIKES]
    except Exception as e:  # noqa: BLE001 - a module that cannot run on [4, H] is not an MLP site
        return probe_failed(e)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return "probe: output is not a tensor of down_proj's output shape"
    act = type(getattr(module, "act_fn", None)).__name__
    ok, diff = gemm_probe_diff(got, want, dtype)
    if not ok:
        return f"probe: act_fn ({act}) is not SiLU: output differs from down_proj(silu(gate) * up) (max abs diff " \
               f"{diff:.3g})"
    for name, other in others:
        if float((got.float() - other.float()).abs().max()) < diff:
            return f"probe: act_fn ({act}) computes {name}, not SiLU (closer to down_proj({name.lower()}(gate) * up))"
    return ""


class MlpRule(Rule):
    name, op, kind_suffix = "mlp", SWIGLU.name, "mlp"
    labels = {SWIGLU.name: "mlp"}
    after = ("norm",)  # the report lists a layer's norms first
    linears = ("gate_proj", "up_proj", "down_proj")
    site_class = MlpSite

    def classify(self, path, module, options=None):
        if not all(_linear(module, n) is not None for n in ("gate_proj", "up_proj", "down_proj")):
            return None  # an fc1 -> act -> fc2 MLP is the GELU MLP rule's (gelu_mlp.py)
        cand = Candidate(self, path, module, self.kind_of(path, module))
        if not hasattr(module, "act_fn"):
            cand.reason = "no act_fn attribute: cannot tell its activation"
        elif module.gate_proj.weight.is_meta and getattr(module.gate_proj, "_hf_hook", None) is None:
            act = type(module.act_fn).__name__
            if "SiLU" not in act:
                cand.reason = f"meta device: act_fn {act} is not recognised as SiLU by name"
        else:
            cand.reason = _probe(module)
        return cand

    def skipped_details(self, cand):
        return weight_details(_linear(cand.module, "gate_proj").weight)


MLPS = register(MlpRule())
