"""The `cpu` backend: fused C++ kernels (csrc/rms_norm_cpu.cpp), built once per machine and cached.

Why C++ rather than torch.compile: one build serves every dtype, D and row count (no recompiles,
no guard overhead at one row), and a call is a single pybind hop. The build takes about a minute
on two cores the first time; afterwards torch's extension loader finds it in the cache directory
(PYPTO_GYM_CACHE, default ~/.cache/pypto_gym) unless the source changed.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path


from ..reference import QUANT_RANGES
from ..registry import Backend, register
from ..validation import FLOAT_DTYPES

SOURCE = Path(__file__).with_name("csrc") / "rms_norm_cpu.cpp"


def cache_dir() -> Path:
    return Path(os.environ.get("PYPTO_GYM_CACHE", Path.home() / ".cache" / "pypto_gym"))


class CpuBackend(Backend):
    name = "cpu"
    devices = ("cpu",)

    def __init__(self):
        self._ext = None
        self._error = None
        self.build_seconds = None

    def extension(self):
        """Build (first time on this machine) or load the compiled kernels."""
        if self._ext is None and self._error is None:
            from torch.utils.cpp_extension import load

            build_dir = cache_dir() / "cpu_kernels"
            build_dir.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            if not any(build_dir.glob("*.so")):
                print("pypto-gym: building the fused CPU kernels (once per machine, ~1 min)...",
                      file=sys.stderr, flush=True)
            try:
                self._ext = load(name="pypto_gym_cpu_kernels", sources=[str(SOURCE)], build_directory=str(build_dir),
                                 extra_cflags=["-O3", "-march=native", "-fopenmp", "-fopenmp-simd"],
                                 extra_ldflags=["-fopenmp"], verbose=False)
            except Exception as e:  # noqa: BLE001 - reported as the reason every call falls back
                self._error = f"C++ kernels failed to build ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
            self.build_seconds = time.perf_counter() - t0
        return self._ext

    def unavailable_reason(self):
        self.extension()
        return self._error

    def supports(self, op, x, gamma=None, **args):
        if self._ext is not None and x.device.type == "cpu" and (gamma is None or gamma.dtype in FLOAT_DTYPES):
            return None  # fast path: every patched norm asks this on every call
        reason = super().supports(op, x)
        if reason is None and gamma is not None and gamma.dtype not in FLOAT_DTYPES:
            reason = f"gamma dtype {str(gamma.dtype).replace('torch.', '')} not supported"
        return reason

    def rms_norm(self, x, gamma, eps, cast_mode):
        return self._ext.norm(x, None, gamma, eps, cast_mode == "fp32")[0]

    def add_rms_norm(self, x1, x2, gamma, eps, cast_mode):
        y, x_out = self._ext.norm(x1, x2, gamma, eps, cast_mode == "fp32")
        return y, x_out

    def rms_norm_dynamic_quant(self, x, gamma, smooth_scales, beta, eps, dst_type):
        y, _, _, scale, _ = self._ext.quant(x, None, gamma, smooth_scales, None, beta, eps, *QUANT_RANGES[dst_type])
        return y, scale

    def add_rms_norm_dynamic_quant(self, x1, x2, gamma, smooth_scale1, smooth_scale2, beta, eps, dst_type):
        return tuple(self._ext.quant(x1, x2, gamma, smooth_scale1, smooth_scale2, beta, eps, *QUANT_RANGES[dst_type]))


register(CpuBackend())
