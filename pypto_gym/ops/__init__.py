"""The fused RMSNorm op family (SPEC 2): Python entry points over the `pypto_gym::*` custom ops.

Each entry point validates once (SPEC 2.5) and hands the call to `dispatch.call`, the one place
a call is resolved to a backend, run and counted. Plain eager calls (no autograd needed, not
being traced, ordinary tensors or Parameters) call it directly; everything else (torch.compile,
autograd, fake tensors) goes through the registered custom op, whose kernel is the same
`dispatch.call`. The direct hop exists only because the dispatcher costs more than the kernel
at decode size; both paths resolve, count and fall back identically.

`backend=None` means the process default ($PYPTO_GYM_BACKEND, else "auto"); `stats` is the
`Stats` to charge (a patched site passes its own; direct calls are charged to `GLOBAL_STATS`).
"""
from __future__ import annotations

import torch

from . import dispatch, library, registry, validation
from .backends import cpu as _cpu  # noqa: F401  (each import registers its backend)
from .backends import npu as _npu  # noqa: F401
from .backends import pypto_backend as _pypto  # noqa: F401
from .backends import torch_backend as _torch  # noqa: F401
from .dispatch import GLOBAL as GLOBAL_STATS
from .dispatch import BackendFallbackError, Stats
from .reference import pack_int4, unpack_int4
from .registry import backend_names

__all__ = ["rms_norm", "add_rms_norm", "rms_norm_dynamic_quant", "add_rms_norm_dynamic_quant", "quant_matmul",
           "pack_int4",
           "unpack_int4", "backend_names", "Stats", "GLOBAL_STATS", "BackendFallbackError", "BoundNorm"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # a Parameter disables __torch_function__: it is a plain tensor here
_FLOAT = validation.FLOAT_DTYPES
_is_compiling = torch.compiler.is_compiling
_is_grad_enabled = torch.is_grad_enabled


def _eager(*tensors) -> bool:
    """True when dispatch.call may run without the dispatcher: not traced, no autograd graph needed."""
    if _is_compiling():
        return False
    grad = _is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN or t.is_meta or (grad and t.requires_grad)):
            return False
    return True


def _route(backend, stats):
    return (registry.default_backend() if backend is None else registry.check_name(backend),
            dispatch.GLOBAL if stats is None else stats)


def rms_norm(x, gamma=None, eps=1e-6, *, cast_mode="hf", backend=None, stats=None):
    """y = gamma * (x / rms(x)); `hf` casts before the weight (HF Qwen/Llama), `fp32` after (vLLM, aclnn)."""
    validation.check_rms_norm(x, gamma, eps, cast_mode)
    backend, stats = _route(backend, stats)
    args = (x, gamma, float(eps), cast_mode)
    if _eager(x, gamma):
        return dispatch.call("rms_norm", backend, stats, args)
    return library.rms_norm_op(*args, backend, stats.id)


def add_rms_norm(x1, x2, gamma, eps=1e-6, *, cast_mode="hf", backend=None, stats=None):
    """(rms_norm(x1 + x2), x1 + x2): the residual add fused into the norm; x_out is the next residual."""
    validation.check_add_rms_norm(x1, x2, gamma, eps, cast_mode)
    backend, stats = _route(backend, stats)
    args = (x1, x2, gamma, float(eps), cast_mode)
    if _eager(x1, x2, gamma):
        return dispatch.call("add_rms_norm", backend, stats, args)
    return library.add_rms_norm_op(*args, backend, stats.id)


class BoundNorm:
    """rms_norm / add_rms_norm bound to one call site's constant arguments, validated once.

    A patched norm runs hundreds of times a token with the same eps, cast mode, backend, counters
    and weight, so those are checked here once (the "kernelize time" of HF kernels) and per call
    only what can change is: the activations, and that the weight still has the dtype it had.
    Any call that is not plain eager inference (tracing, autograd, a tensor subclass, a changed
    weight dtype, a bad input) takes the full entry point, with its validation and error messages.
    The kernels check the weight's size and device themselves, so no shortcut can read out of bounds.
    """

    __slots__ = ("D", "weight_dtype", "eps", "cast_mode", "backend", "stats")

    def __init__(self, weight, eps, cast_mode, backend, stats):
        D = weight.shape[-1]
        validation.check_rms_norm(torch.empty((1, D), device=weight.device), weight, eps, cast_mode)
        self.D, self.weight_dtype, self.eps, self.cast_mode = D, weight.dtype, float(eps), cast_mode
        self.backend, self.stats = registry.check_name(backend), stats

    def rms_norm(self, x, gamma):
        # the same conditions as validation + _eager, inlined: this is the hot path of a patched model
        if (type(x) in _PLAIN and x.dtype in _FLOAT and x.dim() and x.shape[-1] == self.D and type(gamma) in _PLAIN
                and gamma.dtype is self.weight_dtype and not x.is_meta and not _is_compiling()
                and not (_is_grad_enabled() and (x.requires_grad or gamma.requires_grad))):
            return dispatch.call("rms_norm", self.backend, self.stats, (x, gamma, self.eps, self.cast_mode))
        return rms_norm(x, gamma, self.eps, cast_mode=self.cast_mode, backend=self.backend, stats=self.stats)

    def add_rms_norm(self, x1, x2, gamma):
        if (type(x1) in _PLAIN and type(x2) in _PLAIN and x1.dtype in _FLOAT and x2.dtype is x1.dtype and x1.dim()
                and x1.shape == x2.shape and x1.shape[-1] == self.D and type(gamma) in _PLAIN
                and gamma.dtype is self.weight_dtype and not x1.is_meta and not _is_compiling()
                and not (_is_grad_enabled() and (x1.requires_grad or x2.requires_grad or gamma.requires_grad))):
            return dispatch.call("add_rms_norm", self.backend, self.stats, (x1, x2, gamma, self.eps, self.cast_mode))
        return add_rms_norm(x1, x2, gamma, self.eps, cast_mode=self.cast_mode, backend=self.backend, stats=self.stats)


def rms_norm_dynamic_quant(x, gamma, smooth_scales=None, beta=None, eps=1e-6, *, dst_type="int8", backend=None,
                           stats=None):
    """RMSNorm (+beta, *smooth) then per-row symmetric int8/int4 quantisation -> (y, scale). No gradient."""
    validation.check_quant(x, gamma, smooth_scales, None, beta, eps, dst_type, smooth_names=("smooth_scales", ""))
    backend, stats = _route(backend, stats)
    args = (x, gamma, smooth_scales, beta, float(eps), dst_type)
    if _eager(x, gamma, smooth_scales, beta):
        return dispatch.call("rms_norm_dynamic_quant", backend, stats, args)
    return library.rms_norm_dynamic_quant_op(*args, backend, stats.id)


def add_rms_norm_dynamic_quant(x1, x2, gamma, smooth_scale1=None, smooth_scale2=None, beta=None, eps=1e-6, *,
                               dst_type="int8", backend=None, stats=None):
    """aclnnAddRmsNormDynamicQuant: -> (y1, y2, x_out, scale1, scale2); y2/scale2 None without smooth_scale2."""
    validation.check_quant(x1, gamma, smooth_scale1, smooth_scale2, beta, eps, dst_type, x2=x2, x_name="x1")
    backend, stats = _route(backend, stats)
    args = (x1, x2, gamma, smooth_scale1, smooth_scale2, beta, float(eps), dst_type)
    if _eager(x1, x2, gamma, smooth_scale1, smooth_scale2, beta):
        return dispatch.call("add_rms_norm_dynamic_quant", backend, stats, args)
    y1, y2, x_out, s1, s2 = library.add_rms_norm_dynamic_quant_op(*args, backend, stats.id)
    return (y1, y2, x_out, s1, s2) if smooth_scale2 is not None else (y1, None, x_out, s1, None)


def quant_matmul(x_q, w_q, x_scale, w_scale, bias=None, *, out_dtype=torch.bfloat16, backend=None, stats=None):
    """W8A8 linear: (x_q @ w_q^T in int32) * x_scale[..., None] * w_scale (+ bias) as out_dtype.

    x_q int8 [..., K] and its per-row fp32 scales [...] (what the quant norms emit); w_q int8 [N, K]
    and its per-output-channel fp32 scales [N]; bias [N] in a float dtype or None. No gradient.
    """
    validation.check_quant_matmul(x_q, w_q, x_scale, w_scale, bias, out_dtype)
    backend, stats = _route(backend, stats)
    args = (x_q, w_q, x_scale, w_scale, bias, out_dtype)
    if _eager(x_scale, w_scale, bias):
        return dispatch.call("quant_matmul", backend, stats, args)
    return library.quant_matmul_op(*args, backend, stats.id)
