"""`bench ops` for rms_norm and add_rms_norm: GutenOCR-3B's norms (text hidden 2048, vision 1280) against HF's module."""
import torch

from ...ops.defs.rms_norm import ADD_RMS_NORM, RMS_NORM
from . import BenchSpec, register


def _norm_shapes(quick, dtype, two=False):
    tokens = [64, 512, 4096] if quick else [64, 256, 512, 1024, 2048, 4096]
    shapes = [("decode", (1, 1, 2048))] + [("prefill", (1, s, 2048)) for s in tokens]
    shapes += [("vision", (t, 1280)) for t in ([3744] if quick else [1024, 3744])]
    gen = torch.Generator().manual_seed(0)
    out = []
    for phase, shape in shapes:
        xs = [torch.randn(shape, generator=gen).to(dtype) for _ in range(2 if two else 1)]
        gamma = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
        out.append((phase, xs[0].numel() // shape[-1], (*xs, gamma, 1e-6, "hf", *(["rounded"] if two else []))))
    return out


def hf_norm_module(gamma, eps):
    """HF's own RMSNorm module (Qwen2.5-VL's) with this weight."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRMSNorm

    m = Qwen2_5_VLRMSNorm(gamma.shape[0], eps=eps).to(gamma.dtype)
    m.weight.data = gamma
    return m


def _hf_rms_norm(args):
    m = hf_norm_module(args[1], args[2])
    return lambda: m(args[0])


def _hf_add_rms_norm(args):
    """The decoder layer's `residual + h`, then HF's norm."""
    m = hf_norm_module(args[2], args[3])

    def run():
        s = args[0] + args[1]
        return m(s), s
    return run


def _unfused_add_rms_norm(args, backend):
    """The add in torch, then the norm's own kernel: what the fused op saves."""
    x1, x2, gamma, eps, cast_mode = args[:5]
    return lambda: RMS_NORM.call((x1 + x2, gamma, eps, cast_mode), backend, None)


NORM_GOALS = {"vs_compile": 1.5, "floor": 1.5, "min_tokens": 512}


def hf_norm_kernels(x, gamma, prefix=""):
    """HF's RMSNorm forward, kernel by kernel: to(fp32), pow(2), mean(-1), + eps, rsqrt, mul, to(dtype), weight * h."""
    x = x.reshape(-1, x.shape[-1])
    R, D = x.shape
    gamma = torch.ones(D) if gamma is None else gamma
    h, v = torch.zeros(R, D), torch.zeros(R, 1)
    return [(f"{prefix}x.to(float32)", "cast", [x], (R, D), torch.float32, ()),
            (f"{prefix}h.pow(2)", "mul", [h, h], (R, D), torch.float32, ()),
            (f"{prefix}.mean(-1)", "mean", [h], (R, 1), torch.float32, (1.0 / D,)),
            (f"{prefix}variance + eps", "add_scalar", [v], (R, 1), torch.float32, (1e-6,)),
            (f"{prefix}torch.rsqrt", "rsqrt", [v], (R, 1), torch.float32, ()),
            (f"{prefix}h * rsqrt", "mul", [h, v], (R, D), torch.float32, ()),
            (f"{prefix}.to(dtype)", "cast", [h], (R, D), x.dtype, ()),
            (f"{prefix}weight * h", "mul", [x, gamma.reshape(1, D)], (R, D), x.dtype, ())]


def _hf_add_norm_kernels(args):
    x1, x2, gamma = (a.reshape(-1, a.shape[-1]) if a is not None else None for a in args[:3])
    return [("residual + hidden", "add", [x1, x2], x1.shape, x1.dtype, ()), *hf_norm_kernels(x1, gamma)]


register(RMS_NORM, BenchSpec(_norm_shapes, _hf_rms_norm, lambda a: a[0].clone, "clone()", NORM_GOALS,
                             hf_kernels=lambda a: hf_norm_kernels(a[0], a[1])))
register(ADD_RMS_NORM, BenchSpec(lambda quick, dtype: _norm_shapes(quick, dtype, two=True), _hf_add_rms_norm,
                                 lambda a: (lambda: (a[0].clone(), a[1].clone())), "clone() of x1 and x2", NORM_GOALS,
                                 unfused=_unfused_add_rms_norm, hf_kernels=_hf_add_norm_kernels))
