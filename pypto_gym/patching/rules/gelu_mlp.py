"""The GELU MLP rule: every `fc2(gelu(fc1(x)))` MLP becomes a `linear` site whose first linear runs with its GELU in
the GEMM's epilogue (Qwen3-VL's vision MLP: `linear_fc1`, HF's `gelu_pytorch_tanh`, `linear_fc2`).

A module is a candidate when it has two linears named `fc1`/`fc2` or `linear_fc1`/`linear_fc2`. A probe then runs the
module's own forward on a small random input scaled so the GELU's input spreads over [-4, 4] (where the erf and tanh
forms and QuickGELU differ far beyond bf16's rounding) and requires `fc2(F.gelu(fc1(x)))` bit for bit in the erf or
the tanh form, which names the site's activation; QuickGELU (Qwen2-VL's vision MLP: no such oneDNN epilogue) and a
forward that does more (the patch mergers: their norm first) are skipped with the reason. The site calls `linear`
with the activation on fc1's own weight and bias, then the module's fc2 (its hooks stay; its bias in the GEMM's
epilogue on the cpu backend, gemm.py). Only the `cpu` backend has the fused kernel; the `torch` backend runs the
golden (HF's two roundings, bit-identical); on the NPU and PyPTO backends the site is skipped with the reason (no
documented linear + GELU call: `npu_ffn`'s "gelu" does not say erf or tanh), the module's own kernels run.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import config
from ...ops.defs.linear import LINEAR
from ..site import Candidate, Rule, Site, has_hooks, probe_failed, register, torch_hooks_set_aside, weight_details

_STATE = config.STATE
NAMES = (("linear_fc1", "linear_fc2"), ("fc1", "fc2"))
FUSED_ON = ("cpu", "torch", "auto")  # where the site runs: the fused kernel (cpu) or the golden (torch)
PROBE_SPREAD = 2.0  # the GELU input's std in the probe


def _linears(module):
    """(fc1, fc2) of a module with a pair of NAMES' linears, else None."""
    for a, b in NAMES:
        fc1, fc2 = getattr(module, a, None), getattr(module, b, None)
        if isinstance(fc1, torch.nn.Linear) and isinstance(fc2, torch.nn.Linear):
            return fc1, fc2
    return None


def _probe(module, fc1, fc2) -> tuple[str, str]:
    """(activation, '') if the module computes fc2(gelu(fc1(x))) bit for bit, else ('', why not)."""
    w = fc1.weight
    if w.is_meta or getattr(fc1, "_hf_hook", None) is not None:
        return "", "its weights are not here to probe (meta device or offloaded)"
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(4, fc1.in_features, generator=gen).to(device=w.device, dtype=w.dtype)
    try:
        with torch.no_grad(), torch_hooks_set_aside(module):  # a probe is not a call anyone's hooks should see
            spread = float(fc1(x).float().std())
            if spread > 0:
                x = (x.float() * (PROBE_SPREAD / spread)).to(w.dtype)
            got, h = module.forward(x), fc1(x)
            forms = {"gelu_tanh": fc2(F.gelu(h, approximate="tanh")), "gelu": fc2(F.gelu(h))}
            quick = fc2(h * torch.sigmoid(1.702 * h))
    except Exception as e:  # noqa: BLE001 - a module that cannot run on [4, in_features] is not an MLP site
        return "", probe_failed(e)
    for activation, want in forms.items():
        if isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got, want):
            return activation, ""
    if isinstance(got, torch.Tensor) and got.shape == quick.shape and torch.allclose(got, quick):
        return "", "QuickGELU: no fused linear epilogue computes it (oneDNN's are GELU's erf and tanh forms)"
    return "", "probe: output is not fc2(gelu(fc1(x))) in the erf or the tanh form"


class GeluMlpSite(Site):
    """One patched GELU MLP: linear with its activation bound to its backend and counters."""

    op = LINEAR.name

    def __init__(self, cand: Candidate, options):
        super().__init__(cand.module, cand.paths, cand.kind, options.backend, options.strict)
        self.activation = cand.info["activation"]
        self.fc1, self.fc2 = _linears(cand.module)
        self.call = LINEAR.bind(options.backend, self.stats, activation=self.activation)

    def details(self) -> dict:
        return {**weight_details(self.fc1.weight), "activation": self.activation,
                "fusion_bypassed": dict(self.bypassed)}


def gelu_mlp_forward(module, x):
    """The forward of every patched GELU MLP: fc1 and its GELU as one `linear` call, then the module's fc2."""
    site = module.__dict__["_pypto_gym_site"]
    if not _STATE.enabled:
        return site.original(x)
    if has_hooks(site.fc1):
        site.bypass("fc1 has hooks")
        return site.original(x)
    if "forward" in site.fc1.__dict__:  # W8A8 made fc1 an int8 linear (its instance forward): it must run
        site.bypass("fc1 is an int8 linear (W8A8): the module's forward runs it")
        return site.original(x)
    return site.fc2(site.call(x, site.fc1.weight, site.fc1.bias))


GeluMlpSite.FORWARD = gelu_mlp_forward


class GeluMlpRule(Rule):
    name, op, kind_suffix = "gelu_mlp", LINEAR.name, "gelu_mlp"
    labels = {LINEAR.name: "GELU MLP"}
    after = ("mlp",)
    linears = ("linear_fc2", "fc2")
    site_class = GeluMlpSite

    def classify(self, path, module, options=None):
        pair = _linears(module)
        if pair is None:
            return None
        cand = Candidate(self, path, module, self.kind_of(path, module), info={"activation": None})
        backend = getattr(options, "backend", "auto")
        if backend not in FUSED_ON or (backend == "auto" and pair[0].weight.device.type != "cpu"):
            cand.reason = (f"no fused linear + GELU on the {backend if backend != 'auto' else 'NPU'} backend (no "
                           f"documented call: npu_ffn's 'gelu' does not say erf or tanh); the module's kernels run")
            return cand
        others = [name for name, child in module.named_children()
                  if child not in pair and any(True for _ in child.parameters())]
        if others:  # a patch merger: its norm before fc1
            cand.reason = f"its forward runs more layers than fc1 and fc2 ({', '.join(others)}): not one MLP"
            return cand
        cand.info["activation"], cand.reason = _probe(module, *pair)
        return cand

    def skipped_details(self, cand):
        return weight_details(_linears(cand.module)[0].weight)


GELU_MLPS = register(GeluMlpRule())
