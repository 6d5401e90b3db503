"""A patched site's bf16 linears on the cpu backend: the `linear` op, whose cpu kernel adds the bias in the GEMM's
epilogue rather than by a pass before it (kernels/cpu/linear.py says why and what it measured).

The cpu backend takes it for a site's linears (the MLP's projections, the vision attention's qkv and proj, the
decoder attention's q/k/v/o) where it applies: a plain nn.Linear with a bias, bf16 weight and input on CPU, oneDNN's
bf16 matmul supported, no hooks, no autograd (the epilogue GEMM has no backward), outside torch.compile (inductor's
lowering of the op wants frozen weights: a compiled model keeps F.linear and inductor's own GEMMs). Each such linear
calls the op through its own counters (`stats`: per backend, fallbacks with their reasons, seen by ShapeRecorder as
the site's calls of `linear`); every other call runs the linear's own forward, and one declined for autograd is
counted in the site's bypasses.
"""
from __future__ import annotations

import torch

from .. import config, hardware
from ..ops import Stats
from ..ops.defs.linear import LINEAR
from .site import Site, SwappedForward, has_hooks

_STATE = config.STATE
_BACKENDS = ("cpu", "auto")  # where the cpu kernels run; never the torch reference, pypto's or the NPU's


class EpilogueLinear(SwappedForward):
    """One linear of a site whose calls run the `linear` op (bias in the GEMM's epilogue on the cpu backend);
    `uninstall` restores its forward."""

    SLOT = "_pypto_gym_epilogue_linear"

    def __init__(self, module: torch.nn.Linear, name: str, site: Site):
        super().__init__(module)
        self.name, self.site = name, site
        self.stats = Stats(site=site.kind, strict=site.stats.strict)
        self.op = LINEAR.bind(site.requested_backend, self.stats, activation="none")

    @property
    def calls(self) -> int:
        return self.stats.calls


def epilogue_linear_forward(module, x):
    linear = module.__dict__[EpilogueLinear.SLOT]
    if not _STATE.enabled or torch.compiler.is_compiling() or x.device.type != "cpu" or x.dtype != torch.bfloat16 \
            or x.dim() < 2 or x.numel() == 0:
        return linear.original(x)
    if torch.is_grad_enabled() and (x.requires_grad or module.weight.requires_grad or module.bias.requires_grad):
        linear.site.bypass(f"{linear.name}: autograd (the epilogue GEMM has no backward)")
        return linear.original(x)
    return linear.op(x, module.weight, module.bias)


EpilogueLinear.FORWARD = epilogue_linear_forward


def eligible(module) -> bool:
    """A plain nn.Linear with a bf16 bias and weight on CPU, no hooks, where oneDNN's bf16 matmul runs."""
    return (type(module) is torch.nn.Linear and module.bias is not None and module.weight.dtype == torch.bfloat16
            and module.bias.dtype == torch.bfloat16 and module.weight.device.type == "cpu"
            and getattr(module, "_hf_hook", None) is None and not has_hooks(module)
            and EpilogueLinear.SLOT not in module.__dict__ and hardware.onednn_bf16())


def install(site: Site, names: tuple, options) -> list[EpilogueLinear]:
    """The epilogue linears of `site` (its module's children `names` that are eligible), installed; none off the
    cpu backend or under a quantisation mode (which turns the linears into int8 ones)."""
    if options.backend not in _BACKENDS or options.quant is not None:
        return []
    out = []
    for name in names:
        child = getattr(site.module, name, None)
        if child is not None and eligible(child):
            linear = EpilogueLinear(child, name, site)
            linear.install()
            out.append(linear)
    return out
