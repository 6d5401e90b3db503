"""A patched site's bf16 linears on the cpu backend: the bias added in the GEMM's epilogue, not by a pass before it.

On CPU, `F.linear(x, W, b)` (HF's nn.Linear) first copies `b` into every row of the output and then has oneDNN
accumulate `x W^T` onto it: a whole pass over the output before the GEMM. On the document page's vision block
(3744 rows; qkv, proj, gate, up, down) that copy was ~15 % of the five GEMMs' time (bf16, Intel AMX: 110 vs 94 ms),
and the block's GEMMs are most of its time. oneDNN's matmul primitive can add the bias in its epilogue, as the
product is written: `torch.ops.mkldnn._linear_pointwise` (what inductor's oneDNN fusion calls), here on the weight
as it is (no prepacked copy). Its outputs equalled F.linear's bit for bit on every shape tried (both are oneDNN's
bf16 matmul rounding fp32 sums once), so the cpu backend takes it for a site's linears (the MLP's projections,
the vision attention's qkv and proj, the decoder attention's q/k/v/o) where it applies: a plain nn.Linear with a
bias, bf16 weight and input on CPU, oneDNN's bf16 matmul supported, no hooks, no autograd (it has no backward),
outside torch.compile (inductor's lowering of the op wants frozen weights: a compiled model keeps F.linear and
inductor's own GEMMs). fp32 is left to F.linear: there the op was slower at the page's shapes and not bit-equal.
Every other call runs the linear's own forward; a call declined for autograd is counted in the site's bypasses.
"""
from __future__ import annotations

import torch

from .. import config
from .site import Site, SwappedForward, has_hooks

_STATE = config.STATE
_BACKENDS = ("cpu", "auto")  # where the cpu kernels run; never the torch reference, pypto's or the NPU's


class EpilogueLinear(SwappedForward):
    """One linear of a site whose bias oneDNN adds in the GEMM's epilogue; `uninstall` restores its forward."""

    SLOT = "_pypto_gym_epilogue_linear"

    def __init__(self, module: torch.nn.Linear, name: str, site: Site):
        super().__init__(module)
        self.name, self.site, self.calls = name, site, 0


def epilogue_linear_forward(module, x):
    linear = module.__dict__[EpilogueLinear.SLOT]
    if not _STATE.enabled or torch.compiler.is_compiling() or x.device.type != "cpu" or x.dtype != torch.bfloat16 \
            or x.dim() < 2 or x.numel() == 0:
        return linear.original(x)
    if torch.is_grad_enabled() and (x.requires_grad or module.weight.requires_grad or module.bias.requires_grad):
        linear.site.bypass(f"{linear.name}: autograd (the epilogue GEMM has no backward)")
        return linear.original(x)
    linear.calls += 1
    return torch.ops.mkldnn._linear_pointwise(x, module.weight, module.bias, "none", [], "")


EpilogueLinear.FORWARD = epilogue_linear_forward


def onednn_bf16() -> bool:
    """Whether oneDNN runs bf16 matmuls on this CPU (AVX-512 BF16 or AMX; not on AVX2-only CPUs)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def eligible(module) -> bool:
    """A plain nn.Linear with a bf16 bias and weight on CPU, no hooks, where oneDNN's bf16 matmul runs."""
    return (type(module) is torch.nn.Linear and module.bias is not None and module.weight.dtype == torch.bfloat16
            and module.bias.dtype == torch.bfloat16 and module.weight.device.type == "cpu"
            and getattr(module, "_hf_hook", None) is None and not has_hooks(module)
            and EpilogueLinear.SLOT not in module.__dict__ and onednn_bf16())


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
