"""The GELU MLP rule: every `fc2(gelu(fc1(x)))` MLP becomes a `linear` site whose first linear runs with its GELU in
the GEMM's epilogue (Qwen3-VL's vision MLP: `linear_fc1`, HF's `gelu_pytorch_tanh`, `linear_fc2`; its patch mergers'
`fc2(gelu(fc1(norm(x) regrouped)))`, `nn.GELU()`).

A module is a candidate when it has two linears named `fc1`/`fc2` or `linear_fc1`/`linear_fc2`, and nothing else with
weights but, for a patch merger, one `norm` run first. A probe then runs the module's own forward on a small random
input and requires, bit for bit, `fc2(F.gelu(fc1(x)))` or, with the norm, `fc2(F.gelu(fc1(norm(x viewed as rows of
the norm's width) viewed as rows of fc1's width)))` (the merger's regrouping of 4 patches into one row, before or
after its norm) in the erf or the tanh form. The form is named where the two differ far beyond bf16's rounding: the
activation module alone on inputs over [-4, 4] (`act_fn`), else the MLP's input scaled so fc1's output spreads that
wide; a forward that matches both forms (the probe could not tell them apart) or neither, QuickGELU (Qwen2-VL's
vision MLP: no such oneDNN epilogue) and a forward that runs more layers are skipped with the reason. With fc1 on the
meta device (an int8 checkpoint's linears hold no float weight: export.load) the forward cannot run: the form is the
activation module's alone, as the SwiGLU rule names SiLU by act_fn. The site calls
the norm as a module (its own site, if patched), `linear` with the activation on fc1's own weight and bias, then the
module's fc2 (its hooks stay; its bias in the GEMM's epilogue on the cpu backend, gemm.py). Only the `cpu` backend has
the fused kernel; the `torch` backend runs the golden (HF's two roundings, bit-identical); the `npu` backend runs
F.linear then torch_npu.npu_gelu in the module's form (kernels/npu/linear.py: torch's own gelu on an NPU computes the
tanh form whatever it is asked, so there the site is what computes a merger's erf GELU as the model asks); on PyPTO
the site is skipped with the reason (no linear kernel), the module's own kernels run. Under W8A8 the site's quant half
(quant/gelu_mlp.py) runs fc1, then the GELU and the quantisation of its output as one op for an int8 fc2; an int8 fc1
whose fc2 stays float runs in the module's forward, counted.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import config
from ...ops.defs.linear import ACTIVATIONS, LINEAR
from ..site import Candidate, Rule, Site, has_hooks, probe_failed, register, torch_hooks_set_aside, weight_details

_STATE = config.STATE
NAMES = (("linear_fc1", "linear_fc2"), ("fc1", "fc2"))
RUNS_ON = ("cpu", "torch", "npu", "auto")  # the fused kernel (cpu), the golden (torch), F.linear + npu_gelu (npu)
PROBE_SPREAD = 2.0  # the GELU input's std in the probe


def _linears(module):
    """(fc1, fc2) of a module with a pair of NAMES' linears, else None."""
    for a, b in NAMES:
        fc1, fc2 = getattr(module, a, None), getattr(module, b, None)
        if isinstance(fc1, torch.nn.Linear) and isinstance(fc2, torch.nn.Linear):
            return fc1, fc2
    return None


def _norm_width(norm) -> int | None:
    """The width a merger's norm takes (its weight's), or None without one."""
    w = getattr(norm, "weight", None)
    return int(w.shape[-1]) if isinstance(w, torch.Tensor) and w.dim() == 1 else None


def regrouped(norm, width: int, x, fc1):
    """A patch merger's input to fc1: its norm over rows of the norm's `width`, regrouped into rows of fc1's."""
    return norm(x.reshape(-1, width)).reshape(-1, fc1.in_features)


def _activation_form(act) -> str:
    """'gelu_tanh' or 'gelu' if the activation module is F.gelu in that form on [-4, 4] bit for bit, else ''."""
    h = torch.linspace(-4, 4, 257)
    try:
        with torch.no_grad():
            y = act(h)
    except Exception:  # noqa: BLE001 - an activation that cannot run on a vector names no form
        return ""
    return next((a for a in ("gelu_tanh", "gelu") if isinstance(y, torch.Tensor) and y.shape == h.shape
                 and torch.equal(y, F.gelu(h, approximate=ACTIVATIONS[a]))), "")


def _probe(module, fc1, fc2, norm=None, act=None) -> tuple[str, str]:
    """(activation, '') if the module computes fc2(gelu(fc1(x))) (after its norm, regrouped) bit for bit in one GELU
    form, else ('', why not)."""
    w = fc1.weight
    if w.is_meta or getattr(fc1, "_hf_hook", None) is not None:
        return "", "its weights are not here to probe (meta device or offloaded)"
    gen = torch.Generator(device="cpu").manual_seed(0)
    width = fc1.in_features if norm is None else _norm_width(norm)
    rows = 4 if norm is None else 2 * max(1, fc1.in_features // width)
    x = torch.randn(rows, width, generator=gen).to(device=w.device, dtype=w.dtype)
    named = "" if act is None else _activation_form(act)
    try:
        with torch.no_grad(), torch_hooks_set_aside(module):  # a probe is not a call anyone's hooks should see
            spread = float(fc1(x).float().std()) if norm is None else 0.0
            if spread > 0 and not named:
                x = (x.float() * (PROBE_SPREAD / spread)).to(w.dtype)
            got = module.forward(x)
            h = fc1(x if norm is None else regrouped(norm, width, x, fc1))
            forms = {"gelu_tanh": fc2(F.gelu(h, approximate="tanh")), "gelu": fc2(F.gelu(h))}
            quick = fc2(h * torch.sigmoid(1.702 * h))
    except Exception as e:  # noqa: BLE001 - a module that cannot run on this input is not an MLP site
        return "", probe_failed(e)
    matched = [a for a, want in forms.items()
               if isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got, want)]
    if named in matched:
        return named, ""
    if len(matched) == 1 and not named:
        return matched[0], ""
    if len(matched) == 2:
        return "", "probe: its output is both GELU forms' (fc1's output never left where they agree): form unknown"
    if isinstance(got, torch.Tensor) and got.shape == quick.shape and torch.allclose(got, quick):
        return "", "QuickGELU: no fused linear epilogue computes it (oneDNN's are GELU's erf and tanh forms)"
    what = "fc2(gelu(fc1(x)))" if norm is None else "fc2(gelu(fc1(norm(x) regrouped)))"
    return "", f"probe: output is not {what} in the erf or the tanh form"


class GeluMlpSite(Site):
    """One patched GELU MLP: linear with its activation bound to its backend and counters."""

    op = LINEAR.name

    def __init__(self, cand: Candidate, options):
        super().__init__(cand.module, cand.paths, cand.kind, options.backend, options.strict)
        self.activation = cand.info["activation"]
        self.approximate = ACTIVATIONS[self.activation]  # F.gelu's form, for the W8A8 half's gelu quant ops
        self.fc1, self.fc2 = _linears(cand.module)
        self.norm = cand.info["norm"]  # a patch merger's norm (run as a module, before the regrouping), or None
        self.norm_width = None if self.norm is None else _norm_width(self.norm)
        self.act = cand.info["act"]  # the activation module (HF's act_fn, nn.GELU()), if the MLP has one
        self.call = LINEAR.bind(options.backend, self.stats, activation=self.activation)
        self.quant = None  # W8A8 (pypto_gym.quant): the GELU's output quantised in its kernel for an int8 fc2

    def details(self) -> dict:
        return {**weight_details(self.fc1.weight), "activation": self.activation, "norm_first": self.norm is not None,
                "fusion_bypassed": dict(self.bypassed), "quant": None if self.quant is None else self.quant.row()}


def gelu_mlp_forward(module, x):
    """The forward of every patched GELU MLP: fc1 and its GELU as one `linear` call, then the module's fc2."""
    site = module.__dict__["_pypto_gym_site"]
    if not _STATE.enabled:
        return site.original(x)
    if site.quant is not None:
        return site.quant.forward(site, module, x)
    if has_hooks(site.fc1):
        site.bypass("fc1 has hooks")
        return site.original(x)
    if "forward" in site.fc1.__dict__:  # W8A8 made fc1 an int8 linear (its instance forward): it must run
        site.bypass("fc1 is an int8 linear (W8A8): the module's forward runs it")
        return site.original(x)
    if site.norm is not None:
        x = regrouped(site.norm, site.norm_width, x, site.fc1)
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
        cand = Candidate(self, path, module, self.kind_of(path, module), info={"activation": None, "norm": None,
                                                                                "act": None})
        backend = getattr(options, "backend", "auto")
        if backend not in RUNS_ON or (backend == "auto" and pair[0].weight.device.type not in ("cpu", "npu")):
            where = f"the {backend} backend" if backend != "auto" else f"{pair[0].weight.device.type} tensors"
            cand.reason = (f"no linear + GELU for {where} (the cpu, torch and npu backends have one); the module's "
                           f"kernels run")
            return cand
        others = [name for name, child in module.named_children()
                  if child not in pair and any(True for _ in child.parameters())]
        norm = getattr(module, "norm", None) if others == ["norm"] else None
        if others and (norm is None or _norm_width(norm) is None or pair[0].in_features % _norm_width(norm)):
            cand.reason = f"its forward runs more layers than fc1 and fc2 ({', '.join(others)}): not one MLP"
            return cand
        acts = [child for child in module.children() if not any(True for _ in child.parameters())]
        cand.info["norm"], cand.info["act"] = norm, acts[0] if len(acts) == 1 else None
        if pair[0].weight.is_meta and getattr(pair[0], "_hf_hook", None) is None:
            # no weights to run (an int8 checkpoint's linears: export.load): the form from the activation module alone
            cand.info["activation"] = "" if cand.info["act"] is None else _activation_form(cand.info["act"])
            if not cand.info["activation"]:
                cand.reason = "meta device: no activation module that computes a GELU form on its own to read"
            return cand
        cand.info["activation"], cand.reason = _probe(module, *pair, norm, cand.info["act"])
        return cand

    def skipped_details(self, cand):
        return weight_details(_linears(cand.module)[0].weight)


GELU_MLPS = register(GeluMlpRule())
