"""The fused RMSNorm op family (SPEC 2): Python entry points over the `pypto_gym::*` custom ops.

Each entry point validates once (SPEC 2.5), resolves the backend for this exact call (SPEC 2.6),
counts the call and any fallback, then runs. In plain eager inference it calls the backend
directly, skipping the dispatcher hop (tens of microseconds at decode); under torch.compile, with
autograd, or for fake/meta tensors it goes through the registered custom op.
"""
from __future__ import annotations

import torch

from . import library, validation
from . import registry
from .backends import cpu as _cpu  # noqa: F401  (each import registers its backend)
from .backends import npu as _npu  # noqa: F401
from .backends import pypto_backend as _pypto  # noqa: F401
from .backends import torch_backend as _torch  # noqa: F401
from .reference import pack_int4, unpack_int4
from .registry import GLOBAL_STATS, Stats, backend_names

__all__ = ["rms_norm", "add_rms_norm", "rms_norm_dynamic_quant", "add_rms_norm_dynamic_quant", "pack_int4",
           "unpack_int4", "backend_names", "Stats", "GLOBAL_STATS"]


def _direct_ok(*tensors) -> bool:
    """True when the backend can be called without the dispatcher (plain eager, no grad needed)."""
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) is not torch.Tensor or t.is_meta or (grad and t.requires_grad)):
            return False
    return True


def _prepare(op, backend, stats, x, **args):
    """Resolve the backend for this call and count it (skipped while tracing: no Python side effects)."""
    requested = registry.default_backend() if backend is None else backend
    chosen, reason = registry.resolve(op, requested, x, **args)
    compiling = torch.compiler.is_compiling()
    if not compiling:
        for s in (GLOBAL_STATS, stats):
            if s is not None:
                s.calls += 1
                s.backend = chosen.name
                if reason:
                    s.fallbacks[reason] += 1
    return chosen, compiling


def rms_norm(x, gamma=None, eps=1e-6, *, cast_mode="hf", backend="auto", stats=None):
    """y = gamma * (x / rms(x)); `hf` casts before the weight (HF Qwen/Llama), `fp32` after (vLLM, aclnn)."""
    validation.check_rms_norm(x, gamma, eps, cast_mode)
    b, compiling = _prepare("rms_norm", backend, stats, x, gamma=gamma, cast_mode=cast_mode)
    if not compiling and _direct_ok(x, gamma):
        return registry.run("rms_norm", b, (x, gamma, float(eps), cast_mode), stats)
    return library.rms_norm_op(x, gamma, float(eps), cast_mode, b.name)


def add_rms_norm(x1, x2, gamma, eps=1e-6, *, cast_mode="hf", backend="auto", stats=None):
    """(rms_norm(x1 + x2), x1 + x2): the residual add fused into the norm; x_out is the next residual."""
    validation.check_add_rms_norm(x1, x2, gamma, eps, cast_mode)
    b, compiling = _prepare("add_rms_norm", backend, stats, x1, gamma=gamma, cast_mode=cast_mode)
    if not compiling and _direct_ok(x1, x2, gamma):
        return registry.run("add_rms_norm", b, (x1, x2, gamma, float(eps), cast_mode), stats)
    return library.add_rms_norm_op(x1, x2, gamma, float(eps), cast_mode, b.name)


def rms_norm_dynamic_quant(x, gamma, smooth_scales=None, beta=None, eps=1e-6, *, dst_type="int8", backend="auto",
                           stats=None):
    """RMSNorm (+beta, *smooth) then per-row symmetric int8/int4 quantisation -> (y, scale)."""
    validation.check_quant(x, gamma, smooth_scales, None, beta, eps, dst_type, smooth_names=("smooth_scales", ""))
    b, compiling = _prepare("rms_norm_dynamic_quant", backend, stats, x, gamma=gamma, dst_type=dst_type)
    args = (x, gamma, smooth_scales, beta, float(eps), dst_type)
    if not compiling and _direct_ok(x, gamma, smooth_scales, beta):
        return registry.run("rms_norm_dynamic_quant", b, args, stats)
    return library.rms_norm_dynamic_quant_op(*args, b.name)


def add_rms_norm_dynamic_quant(x1, x2, gamma, smooth_scale1=None, smooth_scale2=None, beta=None, eps=1e-6, *,
                               dst_type="int8", backend="auto", stats=None):
    """aclnnAddRmsNormDynamicQuant: -> (y1, y2, x_out, scale1, scale2); y2/scale2 None without smooth_scale2."""
    validation.check_quant(x1, gamma, smooth_scale1, smooth_scale2, beta, eps, dst_type, x2=x2, x_name="x1")
    b, compiling = _prepare("add_rms_norm_dynamic_quant", backend, stats, x1, gamma=gamma, dst_type=dst_type)
    args = (x1, x2, gamma, smooth_scale1, smooth_scale2, beta, float(eps), dst_type)
    if not compiling and _direct_ok(x1, x2, gamma, smooth_scale1, smooth_scale2, beta):
        return registry.run("add_rms_norm_dynamic_quant", b, args, stats)
    y1, y2, x_out, s1, s2 = library.add_rms_norm_dynamic_quant_op(*args, b.name)
    return (y1, y2, x_out, s1, s2) if smooth_scale2 is not None else (y1, None, x_out, s1, None)
