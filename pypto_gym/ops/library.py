"""The five ops as torch.library custom ops (namespace `pypto_gym`), with fake kernels and backward.

Registering them makes a patched model traceable: `torch.compile(fullgraph=True)` sees one opaque
node per norm (shape from the fake kernel) instead of a graph break, and autograd gets explicit
backward formulas so a patched model can be fine-tuned. Outputs are never None in a custom-op
schema, so the 5-output op returns empty tensors for absent branches and the Python entry point
maps them back to None.

Each op's kernel is `dispatch.call`, the same function eager calls reach: the backend is chosen
per call, at run time, also inside a compiled graph. `backend` is the requested backend name and
`stats` the id of the counters to charge (a patched site's, or 0 for direct calls).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import dispatch
from .reference import out_dtype


def _run(op, backend, stats, *args):
    return dispatch.call(op, backend, dispatch.Stats.lookup(stats), args)


# ---- rms_norm -----------------------------------------------------------------------------------
@torch.library.custom_op("pypto_gym::rms_norm", mutates_args=())
def rms_norm_op(x: Tensor, gamma: Optional[Tensor], eps: float, cast_mode: str, backend: str, stats: int) -> Tensor:
    return _run("rms_norm", backend, stats, x, gamma, eps, cast_mode)


@rms_norm_op.register_fake
def _(x, gamma, eps, cast_mode, backend, stats):
    return x.new_empty(x.shape, dtype=out_dtype(x, gamma, cast_mode))


def rms_norm_backward(gy, x, gamma, eps, cast_mode):
    """Gradients of SPEC 2.1 w.r.t. x and gamma, following the casts autograd sees in HF's module."""
    D = x.shape[-1]
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    n = xf * r
    g = None if gamma is None else gamma.reshape(D)
    grad_g = None
    if cast_mode == "hf":
        nc = n.to(x.dtype)
        gn = (gy if g is None else gy * g).to(x.dtype).float()
        if g is not None:
            grad_g = (gy * nc).reshape(-1, D).sum(0)
    else:
        gyf = gy.float()
        gn = gyf if g is None else gyf * g.float()
        if g is not None:
            grad_g = (gyf * n).reshape(-1, D).sum(0)
    grad_x = r * (gn - n * (gn * n).mean(-1, keepdim=True))
    if grad_g is not None:
        grad_g = grad_g.to(gamma.dtype).reshape(gamma.shape)
    return grad_x.to(x.dtype), grad_g


def _rms_norm_setup(ctx, inputs, output):
    x, gamma, eps, cast_mode, _, _ = inputs
    ctx.save_for_backward(x, gamma)
    ctx.eps, ctx.cast_mode = eps, cast_mode


def _rms_norm_bwd(ctx, gy):
    x, gamma = ctx.saved_tensors
    gx, gg = rms_norm_backward(gy, x, gamma, ctx.eps, ctx.cast_mode)
    return gx, gg, None, None, None, None


rms_norm_op.register_autograd(_rms_norm_bwd, setup_context=_rms_norm_setup)


# ---- add_rms_norm -------------------------------------------------------------------------------
@torch.library.custom_op("pypto_gym::add_rms_norm", mutates_args=())
def add_rms_norm_op(x1: Tensor, x2: Tensor, gamma: Optional[Tensor], eps: float, cast_mode: str,
                    backend: str, stats: int) -> tuple[Tensor, Tensor]:
    return _run("add_rms_norm", backend, stats, x1, x2, gamma, eps, cast_mode)


@add_rms_norm_op.register_fake
def _(x1, x2, gamma, eps, cast_mode, backend, stats):
    return x1.new_empty(x1.shape, dtype=out_dtype(x1, gamma, cast_mode)), torch.empty_like(x1)


def _add_rms_norm_setup(ctx, inputs, output):
    _, _, gamma, eps, cast_mode, _, _ = inputs
    ctx.save_for_backward(output[1], gamma)
    ctx.eps, ctx.cast_mode = eps, cast_mode


def _add_rms_norm_bwd(ctx, gy, gx_out):
    x_out, gamma = ctx.saved_tensors
    gx, gg = rms_norm_backward(gy, x_out, gamma, ctx.eps, ctx.cast_mode)
    total = gx if gx_out is None else gx + gx_out
    return total, total, gg, None, None, None, None


add_rms_norm_op.register_autograd(_add_rms_norm_bwd, setup_context=_add_rms_norm_setup)


# ---- quant ops (inference only: integer outputs have no gradient) -------------------------------
@torch.library.custom_op("pypto_gym::rms_norm_dynamic_quant", mutates_args=())
def rms_norm_dynamic_quant_op(x: Tensor, gamma: Tensor, smooth_scales: Optional[Tensor], beta: Optional[Tensor],
                              eps: float, dst_type: str, backend: str, stats: int) -> tuple[Tensor, Tensor]:
    return _run("rms_norm_dynamic_quant", backend, stats, x, gamma, smooth_scales, beta, eps, dst_type)


@rms_norm_dynamic_quant_op.register_fake
def _(x, gamma, smooth_scales, beta, eps, dst_type, backend, stats):
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("pypto_gym::add_rms_norm_dynamic_quant", mutates_args=())
def add_rms_norm_dynamic_quant_op(x1: Tensor, x2: Tensor, gamma: Tensor, smooth_scale1: Optional[Tensor],
                                  smooth_scale2: Optional[Tensor], beta: Optional[Tensor], eps: float,
                                  dst_type: str, backend: str, stats: int
                                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    y1, y2, x_out, s1, s2 = _run("add_rms_norm_dynamic_quant", backend, stats, x1, x2, gamma, smooth_scale1,
                                 smooth_scale2, beta, eps, dst_type)
    if y2 is None:
        y2, s2 = x1.new_empty((0,), dtype=torch.int8), x1.new_empty((0,), dtype=torch.float32)
    return y1, y2, x_out, s1, s2


@add_rms_norm_dynamic_quant_op.register_fake
def _(x1, x2, gamma, smooth_scale1, smooth_scale2, beta, eps, dst_type, backend, stats):
    rows = x1.shape[:-1]
    two = smooth_scale2 is not None
    return (x1.new_empty(x1.shape, dtype=torch.int8),
            x1.new_empty(x1.shape if two else (0,), dtype=torch.int8), torch.empty_like(x1),
            x1.new_empty(rows, dtype=torch.float32), x1.new_empty(rows if two else (0,), dtype=torch.float32))


@torch.library.custom_op("pypto_gym::quant_matmul", mutates_args=())
def quant_matmul_op(x_q: Tensor, w_q: Tensor, x_scale: Tensor, w_scale: Tensor, bias: Optional[Tensor],
                    out_dtype: torch.dtype, backend: str, stats: int) -> Tensor:
    return _run("quant_matmul", backend, stats, x_q, w_q, x_scale, w_scale, bias, out_dtype)


@quant_matmul_op.register_fake
def _(x_q, w_q, x_scale, w_scale, bias, out_dtype, backend, stats):
    return x_q.new_empty((*x_q.shape[:-1], w_q.shape[0]), dtype=out_dtype)


def _non_differentiable(op, n_inputs: int) -> None:
    """Quantisation has no useful gradient: every output is marked non-differentiable, so callers
    with requires_grad inputs get outputs that do not require grad, not a backward that raises."""
    def setup_context(ctx, inputs, output):
        # one output is a Tensor: unpacking it would mark its rows, and leave the output differentiable
        ctx.mark_non_differentiable(*((output,) if isinstance(output, torch.Tensor) else output))

    def backward(ctx, *grads):
        return (None,) * n_inputs

    op.register_autograd(backward, setup_context=setup_context)


_non_differentiable(rms_norm_dynamic_quant_op, 8)
_non_differentiable(add_rms_norm_dynamic_quant_op, 10)
_non_differentiable(quant_matmul_op, 8)
