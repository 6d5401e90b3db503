"""The `pypto` backend: PyPTO JIT kernels (pypto_kernels.py) for all four ops.

NPU tensors run the kernels with RunMode.NPU. CPU tensors run the same kernels through PyPTO's
own compiler in RunMode.SIM with pass-verify, whose CPU calculator computes the outputs, and whose
cost model (an Ascend 910B2) gives the estimated AICore time of the call: on CPU this backend is
for verifying the kernels and estimating NPU time, not for speed (about half a second a call).
Adaptations of PyPTO 0.2.0 internals live in pypto_compat.py.
"""
from __future__ import annotations

import shutil

import torch

from ..reference import QUANT_RANGES, out_dtype
from ..registry import GAMMA_INDEX, Backend, register
from ..validation import FLOAT_DTYPES

UB_BYTES = 192 * 1024  # Ascend 910B unified buffer per vector core
LIVE_FP32_ROWS = 3  # x, the normalised row and one temporary, all fp32, must fit in one tile


def tile_shape(D: int) -> tuple[int, int] | None:
    """(rows, D) per tile so one tile fits the unified buffer, never splitting the reduce axis."""
    per_row = D * 4 * LIVE_FP32_ROWS
    if per_row > UB_BYTES:
        return None
    rows = 1
    while rows * 2 * per_row <= UB_BYTES and rows < 64:
        rows *= 2
    return rows, D


class PyptoBackend(Backend):
    name = "pypto"
    devices = ("cpu", "npu")

    def __init__(self):
        self._kernels = {}
        self._error = None
        self._poisoned = None
        self.last_estimated_us = None

    def unavailable_reason(self):
        if self._error is None:
            try:
                from . import pypto_compat

                pypto_compat.check_version()
            except Exception as e:  # noqa: BLE001 - missing or unsupported pypto is a reason, not a crash
                self._error = str(e)
            else:
                self._error = ""
        return self._error or self._poisoned

    def supports(self, op, args):
        x, gamma = args[0], args[GAMMA_INDEX[op]]
        reason = super().supports(op, args)
        if reason:
            return reason
        if x.device.type == "npu" and not hasattr(torch, "npu"):
            return "torch_npu not imported"
        if x.shape[-1] % 8:
            return f"D={x.shape[-1]} is not a multiple of 8 (PyPTO needs 32-byte aligned fp32 rows)"
        if tile_shape(x.shape[-1]) is None:
            return f"D={x.shape[-1]}: one fp32 row does not fit the {UB_BYTES // 1024} KB unified buffer"
        if not op.endswith("quant") and args[-1] == "none":
            return "cast_mode none not implemented by the PyPTO kernels"
        if gamma is not None and gamma.dtype not in FLOAT_DTYPES:
            return f"gamma dtype {str(gamma.dtype).replace('torch.', '')} not supported"
        return None

    # -- plumbing ---------------------------------------------------------------------------------
    def _kernel(self, device_type: str, name: str):
        import pypto

        from . import pypto_compat
        from .pypto_kernels import make_kernels

        pypto_compat.apply()
        mode = pypto.RunMode.NPU if device_type == "npu" else pypto.RunMode.SIM
        if mode not in self._kernels:
            self._kernels[mode] = make_kernels(mode)
        return self._kernels[mode][name]

    def _launch(self, name: str, x: torch.Tensor, tensors: list, scalars: list):
        """Run one kernel; on CPU, quietly, reading SIM's estimate and cleaning its output."""
        from . import pypto_compat

        kernel = self._kernel(x.device.type, name)
        rows, cols = tile_shape(x.shape[-1])
        args = (*tensors, *scalars, rows, cols)
        if x.device.type == "npu":
            kernel(*args)
            return
        scratch = pypto_compat.scratch_dir()
        try:
            with pypto_compat.quiet(scratch / "pypto.log"):
                kernel(*args)
        except Exception as e:
            self._poisoned = f"disabled after a kernel compile error in this process ({type(e).__name__})"
            raise
        run = pypto_compat.latest_run_dir(scratch)
        self.last_estimated_us = pypto_compat.estimated_aicore_us(run / "_simulate.swim.json") if run else None
        for child in scratch.iterdir():
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)

    @staticmethod
    def _rows(t):
        return t.reshape(-1, t.shape[-1]).contiguous()

    @staticmethod
    def _vec(t, D, like, fill):
        if t is None:
            return torch.full((1, D), fill, dtype=like.dtype, device=like.device)
        return t.reshape(1, D).contiguous()

    # -- ops --------------------------------------------------------------------------------------
    def rms_norm(self, x, gamma, eps, cast_mode):
        D = x.shape[-1]
        out = torch.empty(x.shape, dtype=out_dtype(x, gamma, cast_mode), device=x.device)
        if x.numel():
            g = self._vec(gamma, D, x, 1.0)
            self._launch("rms_norm", x, [self._rows(x), g, out.view(-1, D)], [float(eps), 1.0 / D, cast_mode == "hf"])
        return out

    def add_rms_norm(self, x1, x2, gamma, eps, cast_mode):
        D = x1.shape[-1]
        out = torch.empty(x1.shape, dtype=out_dtype(x1, gamma, cast_mode), device=x1.device)
        x_out = torch.empty_like(x1, memory_format=torch.contiguous_format)
        if x1.numel():
            g = self._vec(gamma, D, x1, 1.0)
            self._launch("add_rms_norm", x1, [self._rows(x1), self._rows(x2), g, out.view(-1, D), x_out.view(-1, D)],
                         [float(eps), 1.0 / D, cast_mode == "hf"])
        return out, x_out

    def residual_add(self, x1, x2):
        """x1 + x2 as its own PyPTO kernel: the unfused baseline for benchmarks (sets last_estimated_us)."""
        out = torch.empty_like(x1, memory_format=torch.contiguous_format)
        self._launch("residual_add", x1, [self._rows(x1), self._rows(x2), out.view(-1, x1.shape[-1])], [])
        return out

    def rms_norm_dynamic_quant(self, x, gamma, smooth_scales, beta, eps, dst_type):
        D = x.shape[-1]
        y = torch.empty(x.shape, dtype=torch.int8, device=x.device)
        scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
        if x.numel():
            qmax, qmin = QUANT_RANGES[dst_type]
            self._launch("rms_norm_dynamic_quant", x,
                         [self._rows(x), self._vec(gamma, D, x, 1.0), self._vec(smooth_scales, D, x, 1.0),
                          self._vec(beta, D, x, 0.0), y.view(-1, D), scale.view(-1, 1)],
                         [float(eps), 1.0 / D, qmax, qmin])
        return y, scale

    def add_rms_norm_dynamic_quant(self, x1, x2, gamma, smooth_scale1, smooth_scale2, beta, eps, dst_type):
        D = x1.shape[-1]
        two = smooth_scale2 is not None
        y1 = torch.empty(x1.shape, dtype=torch.int8, device=x1.device)
        y2 = torch.empty_like(y1) if two else None
        x_out = torch.empty_like(x1, memory_format=torch.contiguous_format)
        s1 = torch.empty(x1.shape[:-1], dtype=torch.float32, device=x1.device)
        s2 = torch.empty_like(s1) if two else None
        if x1.numel():
            qmax, qmin = QUANT_RANGES[dst_type]
            vec = [self._vec(gamma, D, x1, 1.0), self._vec(smooth_scale1, D, x1, 1.0)]
            outs = [y1.view(-1, D)]
            if two:
                vec.append(self._vec(smooth_scale2, D, x1, 1.0))
                outs.append(y2.view(-1, D))
            outs += [x_out.view(-1, D), s1.view(-1, 1)] + ([s2.view(-1, 1)] if two else [])
            self._launch("add_rms_norm_dynamic_quant2" if two else "add_rms_norm_dynamic_quant", x1,
                         [self._rows(x1), self._rows(x2), *vec, self._vec(beta, D, x1, 0.0), *outs],
                         [float(eps), 1.0 / D, qmax, qmin])
        return y1, y2, x_out, s1, s2


register(PyptoBackend())
