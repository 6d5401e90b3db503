"""The PyPTO kernels `bench pypto` and `bench layer` cost pypto-gym's fused kernels against.

Not ops: baselines. Each HF eager torch op of a norm, an MLP activation or a rotary embedding becomes the
PyPTO kernel that op would be on an NPU (same inputs, outputs and dtypes; one launch each), so the sum of
their SIM estimates is what the unfused model costs on PyPTO's 910B2 model. Also: a copy kernel moving
given bytes (the model's own memory floor: what the cost model charges for moving them at all) and
rms_norm exactly as the source documents write it (reference 001: `pypto.rms_norm`, vec tiles 128 on every
leading dim and 2048 on the last). Estimates are SIM's AICore time (launch overhead not modelled).
No `from __future__ import annotations` here: PyPTO reads the kernels' `pypto.Tensor()` annotations.
"""

import torch

from ..kernels.pypto.backend import Tiles
from ..kernels.pypto.budget import Budget
from ..kernels.pypto.rope import rope_tiles
from ..ops import registry


def _cast(pypto):
    def cast(x: pypto.Tensor(), out: pypto.Tensor(), rows, heads, cols):
        pypto.set_vec_tile_shapes(rows, heads, cols)
        out[:] = pypto.cast(x, out.dtype)
    return cast


def _copy(pypto):
    def copy(x: pypto.Tensor(), out: pypto.Tensor(), rows, heads, cols):
        pypto.set_vec_tile_shapes(rows, heads, cols)
        out[:] = x * 1.0
    return copy


def _mul(pypto):
    def mul(a: pypto.Tensor(), b: pypto.Tensor(), out: pypto.Tensor(), rows, heads, cols):
        pypto.set_vec_tile_shapes(rows, heads, cols)
        out[:] = pypto.cast(pypto.cast(a, pypto.DT_FP32) * pypto.cast(b, pypto.DT_FP32), out.dtype)
    return mul


def _add(pypto):
    def add(a: pypto.Tensor(), b: pypto.Tensor(), out: pypto.Tensor(), rows, heads, cols):
        pypto.set_vec_tile_shapes(rows, heads, cols)
        out[:] = pypto.cast(pypto.cast(a, pypto.DT_FP32) + pypto.cast(b, pypto.DT_FP32), out.dtype)
    return add


def _mean(pypto):
    def mean(x: pypto.Tensor(), out: pypto.Tensor(), inv_d, rows, heads, cols):
        pypto.set_vec_tile_shapes(rows, heads, cols)
        out[:] = pypto.sum(x * inv_d, -1, keepdim=True)
    return mean


def _add_eps_rsqrt(pypto):  # two torch ops: `variance + eps` then `torch.rsqrt`, costed as one each below
    def add_scalar(x: pypto.Tensor(), out: pypto.Tensor(), eps, rows, heads, cols):
        pypto.set_vec_tile_shapes(rows, heads, cols)
        out[:] = x + eps
    return add_scalar


def _rsqrt(pypto):
    def rsqrt(x: pypto.Tensor(), out: pypto.Tensor(), rows, heads, cols):
        pypto.set_vec_tile_shapes(rows, heads, cols)
        out[:] = pypto.rsqrt(x)
    return rsqrt


def _neg(pypto):
    def neg(x: pypto.Tensor(), out: pypto.Tensor(), rows, heads, cols):
        pypto.set_vec_tile_shapes(rows, heads, cols)
        out[:] = pypto.neg(x)
    return neg


def _cat(pypto):
    """torch.cat((-x2, x1)) of rotate_half, after its neg: the halves of one tensor swapped (the same bytes
    read and written; a concat of two separate inputs fails PyPTO 0.2.0's compiled-level check)."""
    def cat(x: pypto.Tensor(), out: pypto.Tensor(), rows, heads, cols):
        pypto.set_vec_tile_shapes(rows, heads, cols)
        T, H, D = x.shape[0], x.shape[1], x.shape[2]
        xf = pypto.cast(x, pypto.DT_FP32)
        x1 = pypto.view(xf, [T, H, D // 2], [0, 0, 0])
        x2 = pypto.view(xf, [T, H, D // 2], [0, 0, D // 2])
        out[:] = pypto.cast(pypto.concat([x2, x1], 2) * 1.0, out.dtype)
    return cat


def _silu(pypto):
    def silu(x: pypto.Tensor(), out: pypto.Tensor(), rows, heads, cols):
        pypto.set_vec_tile_shapes(rows, heads, cols)
        g = pypto.cast(x, pypto.DT_FP32)
        out[:] = pypto.cast(g * pypto.sigmoid(g), out.dtype)
    return silu


def _gelu_tanh(pypto):
    """HF's gelu_pytorch_tanh: 0.5 x (1 + tanh(u)) is x * sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3)."""
    def gelu_tanh(x: pypto.Tensor(), out: pypto.Tensor(), rows, heads, cols):
        pypto.set_vec_tile_shapes(rows, heads, cols)
        g = pypto.cast(x, pypto.DT_FP32)
        out[:] = pypto.cast(g * pypto.sigmoid((g + g * g * g * 0.044715) * 1.5957691216057308), out.dtype)
    return gelu_tanh


def _documents_rms_norm(pypto):
    def documents_rms_norm(x: pypto.Tensor(), g: pypto.Tensor(), out: pypto.Tensor(), eps, rows, cols):
        pypto.set_vec_tile_shapes(rows, cols)
        out[:] = pypto.rms_norm(x, g, eps)
    return documents_rms_norm


FACTORIES = {"cast": _cast, "copy": _copy, "mul": _mul, "add": _add, "mean": _mean, "add_scalar": _add_eps_rsqrt,
             "rsqrt": _rsqrt, "neg": _neg, "cat": _cat, "silu": _silu, "gelu_tanh": _gelu_tanh}


def _as3(t):
    """Every baseline kernel sees [tokens, heads, D]: rows [R, D] are [R, 1, D]."""
    return t.reshape(t.shape[0], 1, t.shape[1]) if t.dim() == 2 else t


def estimate(kind: str, inputs: list, out_shape, out_dtype, scalars=()) -> float:
    """SIM's AICore estimate (us) of one baseline kernel on these inputs (2-D rows or 3-D [T, H, D])."""
    backend = registry.get("pypto")
    inputs = [_as3(t).contiguous() for t in inputs]
    out = _as3(torch.empty(out_shape, dtype=out_dtype))
    T, H, D = inputs[0].shape
    tiles = rope_tiles(T, H, D)  # a tile spans the heads (as rope's own kernel), and the first input's width
    backend.launch(f"baseline_{kind}", FACTORIES[kind], inputs[0], inputs, [out], list(scalars), tiles=tiles)
    return backend.last_run.estimated_us


def copy_us(nbytes: int, rows: int) -> float:
    """The copy kernel's estimate for moving `nbytes` (read + written), as bf16 rows of the op's row count."""
    rows = max(1, rows)
    cols = max(16, -(-(nbytes // 4) // rows // 16) * 16)  # nbytes / 2 read, nbytes / 2 written, 2-byte values
    x = torch.zeros(rows, cols, dtype=torch.bfloat16)
    return estimate("copy", [x], x.shape, x.dtype)


def documents_rms_norm_us(x, gamma, eps) -> float:
    """rms_norm as reference 001 writes it: pypto.rms_norm, vec tiles 128 on the leading dim, 2048 on the last."""
    backend = registry.get("pypto")
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    # the reference's tiles as written, estimated by SIM only: 128 x 2048 fp32 is more than an A2/A3 UB holds (the
    # budget check would refuse it for a kernel of ours), so it is launched without one
    backend.launch("documents_rms_norm", _documents_rms_norm, rows, [rows, gamma.reshape(-1).contiguous()],
                   [out], [float(eps)], tiles=Tiles(128, 2048), budget=Budget())
    return backend.last_run.estimated_us
