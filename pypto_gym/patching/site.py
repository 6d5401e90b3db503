"""Sites and site rules: the one mechanism by which pypto-gym changes a model, and undoes it exactly.

A site rule (norm.py, mlp.py, rope.py; quant adds its own) binds an op to a kind of module: it
finds candidates by structure, confirms each with a numerical probe against the module's own
forward, and gives every candidate it refuses a reason. A site is one patched module: it replaces
only the module's instance `forward` (accelerate's inner `_old_forward` when the model was
dispatched with device_map/offload, so its hooks keep moving weights and activations) by a
`functools.partial` of a module-level function, so a patched model pickles and deep-copies; the
site itself lives in the module's `__dict__`. Every site has live counters (a `Stats` carrying its
kind, which is what a ShapeRecorder files its calls under), a report row, and checks the switch on
every call: off means the module's original forward, bit-identical to the unpatched model.
"""
from __future__ import annotations

import contextlib
import fnmatch
import functools
import types
from dataclasses import dataclass, field

import torch
from torch.nn.modules import module as _nn_module

from .. import config
from ..kinds import kind
from ..ops import Stats, dtype_name

SLOT = "_pypto_gym_site"


class SwappedForward:
    """A module whose instance forward is swapped for `FORWARD(module, ...)`; `uninstall` restores it exactly."""

    SLOT = SLOT
    FORWARD = None  # the module-level function installed as forward(module, *args, **kwargs)

    def __init__(self, module):
        self.module = module
        self._attr = "_old_forward" if "_old_forward" in module.__dict__ else "forward"
        self._saved = module.__dict__.get(self._attr)  # accelerate's inner forward, or None

    def original(self, *args, **kwargs):
        """The module's own forward (accelerate's inner forward, or its class's)."""
        if self._saved is not None:
            return self._saved(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def install(self) -> None:
        setattr(self.module, self._attr, functools.partial(type(self).FORWARD, self.module))
        self.module.__dict__[self.SLOT] = self

    def uninstall(self) -> None:
        if self._saved is None:
            self.module.__dict__.pop(self._attr, None)
        else:
            setattr(self.module, self._attr, self._saved)
        self.module.__dict__.pop(self.SLOT, None)

    def __setstate__(self, state):  # unpickled in a new process: read the switches before the first call
        self.__dict__.update(state)
        config.STATE.load()


class Site(SwappedForward):
    """One patched module: where it is (every path it is reachable by), what it runs, live counters."""

    op = ""  # the op it runs, for the report
    rule = ""  # the rule that installed it

    def __init__(self, module, paths, kind: str, backend: str, strict=None):
        super().__init__(module)
        self.paths, self.kind, self.requested_backend = list(paths), kind, backend
        self.stats = Stats(site=kind, strict=strict)
        self.bypassed: dict[str, int] = {}  # calls that ran the original instead of the fused path, by reason
        self.linears: list = []  # its linears whose bias the GEMM's epilogue adds (gemm.py), set by patch_model

    @property
    def path(self) -> str:
        return self.paths[0]

    def bypass(self, why: str) -> None:
        """Count a call that ran the original forward (or part of it) instead of the fused path."""
        self.bypassed[why] = self.bypassed.get(why, 0) + 1

    def details(self) -> dict:
        """Rule-specific report fields (the norm rule: D, eps, dtype, device, fusion)."""
        return {}

    def row(self) -> dict:
        stats = self.stats
        return {**_row(self.path, self.paths, self.kind, self.op, "patched", ""), **self.details(),
                "backend": stats.backend or self.requested_backend, "requested_backend": self.requested_backend,
                "calls": stats.calls, "ran_on": dict(stats.ran), "fallbacks": self.fallbacks(),
                "bias_epilogue": {linear.name: linear.calls for linear in self.linears}}

    def fallbacks(self) -> dict:
        """The site's fallbacks by reason, its epilogue linears' among them (named by the linear)."""
        out = dict(self.stats.fallbacks)
        for linear in self.linears:
            for reason, n in linear.stats.fallbacks.items():
                key = f"{linear.name} (linear): {reason}"
                out[key] = out.get(key, 0) + n
        return out


def _row(path, paths, kind, op, status, reason) -> dict:
    return {"path": path, "paths": list(paths), "kind": kind, "op": op, "status": status, "reason": reason,
            "backend": None, "requested_backend": None, "D": None, "eps": None, "dtype": None, "device": None,
            "cast_mode": None,
            "fused_residual": False, "fused_into": None, "fusion_bypassed": {}, "quant": None, "rotary": None,
            "calls": 0, "ran_on": {}, "fallbacks": {}, "bias_epilogue": {}}


@dataclass
class Candidate:
    """A module a rule recognised by structure: patched if its probe passed (reason "") and it is selected."""

    rule: "Rule"
    path: str
    module: torch.nn.Module
    kind: str
    reason: str = ""
    aliases: tuple = ()  # further paths of the same module object (a module shared by two parents)
    info: dict = field(default_factory=dict)  # what the rule learnt (eps, D, ...), for its site and the report

    @property
    def paths(self) -> list[str]:
        return [self.path, *self.aliases]

    def names(self) -> list[str]:
        """What `sites=` globs are matched against: the kind, every path and the kind of every path."""
        return [self.kind, *self.paths, *(self.rule.kind_of(p, self.module) for p in self.aliases)]

    def row(self, reason: str) -> dict:
        return {**_row(self.path, self.paths, self.kind, self.rule.op, "skipped", reason),
                **self.rule.skipped_details(self)}


class Rule:
    """A site rule: which modules it patches (by structure + probe) and the site it installs on each."""

    name = ""
    op = ""
    labels: dict = {}  # op name -> how the report's summary line names its sites ("norm" for rms_norm)
    after: tuple = ()  # the rules that apply before this one (what it builds on, or what the report lists first)
    site_class: type[Site]  # what install() puts on a candidate
    linears: tuple = ()  # the module's children whose bias the cpu backend adds in the GEMM's epilogue (gemm.py)
    kind_suffix = ""  # a candidate's kind: "<part>.<kind_suffix>" (vision. or text.), unless kind_of says more

    def candidates(self, model: torch.nn.Module, options) -> list[Candidate]:
        """Every module shaped like this rule's kind, once, with every path it is reachable by."""
        paths: dict[int, list[str]] = {}
        modules = {}
        for path, module in model.named_modules(remove_duplicate=False):
            paths.setdefault(id(module), []).append(path)
            modules[id(module)] = module
        out = []
        for key, module_paths in paths.items():
            cand = self.classify(module_paths[0], modules[key], options)
            if cand is not None:
                cand.aliases = tuple(module_paths[1:])
                out.append(cand)
        return out

    def classify(self, path: str, module, options) -> Candidate | None:
        raise NotImplementedError

    def kind_of(self, path: str, module) -> str:
        return kind(path, self.kind_suffix)

    def install(self, cand: Candidate, options) -> Site:
        site = self.site_class(cand, options)
        site.install()
        return site

    def skipped_details(self, cand: Candidate) -> dict:
        """A skipped candidate's columns in the report: its width D (a head's, for the attention and rope rules;
        the weight rules say theirs with weight_details)."""
        return {"D": getattr(cand.module, "head_dim", None)}


def weight_details(weight: torch.Tensor) -> dict:
    """A skipped weight-bearing candidate's report columns: its output width, dtype and device."""
    return {"D": int(weight.shape[0]), "dtype": dtype_name(weight.dtype), "device": str(weight.device)}


RULES: list[Rule] = []  # module-level site rules (patching/rules/), in the order they are applied


def register(rule: Rule) -> Rule:
    """Add a rule (each module of patching/rules/ registers its own) and keep RULES in an order where every rule
    comes after the rules its `after` names."""
    if any(r.name == rule.name for r in RULES):
        raise ValueError(f"site rule {rule.name!r} registered twice")
    by_name = {r.name: r for r in (*RULES, rule)}
    ordered: list[Rule] = []

    def visit(r, seen=()):
        if r in ordered:
            return
        if r.name in seen:
            raise ValueError(f"site rules order themselves in a circle: {' -> '.join((*seen, r.name))}")
        for name in r.after:
            if name in by_name:
                visit(by_name[name], (*seen, r.name))
        ordered.append(r)
    for r in by_name.values():
        visit(r)
    RULES[:] = ordered
    return rule


def site_label(op_name: str) -> str:
    """How the report's summary line names the sites of an op: the label its rule gives, else the op's name."""
    return next((r.labels[op_name] for r in RULES if op_name in r.labels), op_name)


def selected(cand: Candidate, patterns) -> bool:
    """Glob selection by kind (`text.*`) or by any of the module's paths (`*.merger.ln_q`); a pattern
    starting with `!` excludes what it matches (`!*.mlp`)."""
    if not patterns:
        return True
    names = cand.names()
    include = [p for p in patterns if not p.startswith("!")]
    exclude = [p[1:] for p in patterns if p.startswith("!")]
    if any(fnmatch.fnmatchcase(n, p) for n in names for p in exclude):
        return False
    return not include or any(fnmatch.fnmatchcase(n, p) for n in names for p in include)


# a probe through the module's GEMMs (MLP, patch embedding): its sums and the formula's may round apart
GEMM_PROBE_TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def gemm_probe_diff(got: torch.Tensor, want: torch.Tensor, dtype) -> tuple[bool, float]:
    """(within GEMM_PROBE_TOL of want's largest value, the max abs difference) for a probe's two results."""
    diff = float((got.float() - want.float()).abs().max())
    return diff <= GEMM_PROBE_TOL[dtype] * (float(want.float().abs().max()) or 1.0), diff


def probe_failed(e: Exception) -> str:
    """The reason a probe that raised gives: the exception's type and first line."""
    return f"probe failed ({type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''})"


def has_hooks(module: torch.nn.Module) -> bool:
    """True when calling the module's forward directly would skip a torch hook someone registered."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or _nn_module._global_forward_hooks
                or _nn_module._global_forward_pre_hooks or _nn_module._global_backward_hooks
                or _nn_module._global_backward_pre_hooks)


@contextlib.contextmanager
def torch_hooks_set_aside(module: torch.nn.Module):
    """Inside: nothing that observes `module` or its descendants sees a call (a probe or a first-call check runs
    a module without the user seeing extra calls): no torch forward hook (the modules' own and global ones) fires,
    and a per-call forward wrapper is peeled off: an instance `forward` that is a plain function wrapping another
    (`__wrapped__`), as transformers 4.57's output recorders install around each model call to collect attentions
    and hidden states (a check that ran a layer twice returned 6 attentions for 4 layers). accelerate's hook (a
    functools.partial in forward) and pypto-gym's own sites stay: they compute, they do not observe."""
    hook_dicts = [d for m in module.modules() for d in (m._forward_hooks, m._forward_pre_hooks)]
    hook_dicts += [_nn_module._global_forward_hooks, _nn_module._global_forward_pre_hooks]
    saved = [(d, dict(d)) for d in hook_dicts]
    wrapped = [(m, m.__dict__["forward"]) for m in module.modules() if _observer(m.__dict__.get("forward"))]
    try:
        for d in hook_dicts:
            d.clear()
        for m, f in wrapped:
            inner = f
            while _observer(inner):
                inner = inner.__wrapped__
            m.__dict__["forward"] = inner
        yield
    finally:
        for d, items in saved:
            d.update(items)
        for m, f in wrapped:
            m.__dict__["forward"] = f


def _observer(forward) -> bool:
    """A forward wrapper that only observes: a plain function made with functools.wraps around another forward."""
    return isinstance(forward, types.FunctionType) and hasattr(forward, "__wrapped__")


def site_of(module: torch.nn.Module) -> Site | None:
    return module.__dict__.get(SLOT)


def execution_device(module, weight: torch.Tensor) -> str:
    """Where a module computes: accelerate's execution device for offloaded modules, else its weight's."""
    device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    return torch.device(device).type if device is not None else weight.device.type


def tensor_info(t: torch.Tensor) -> dict:
    return {"dtype": dtype_name(t.dtype), "device": str(t.device)}
