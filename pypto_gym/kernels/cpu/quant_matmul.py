"""quant_matmul, quant_matmul_static and int32_gemm on the cpu backend: the exact int32 GEMM this CPU runs fastest,
then the golden's epilogue as one C++ pass (quant_matmul.cpp)."""
from __future__ import annotations

import functools

import torch

from ... import hardware
from ...ops.defs.quant_matmul import INT32_GEMM, QUANT_MATMUL, QUANT_MATMUL_STATIC, exact_product


def _saturation_probe():
    """int8 operands on which a GEMM that sums int8 products in int16 (oneDNN's s8s8 path capped below VNNI,
    vpmaddubsw) returns wrong sums: 127 x 127 and -128 x -128 over K=2048, and random codes with the extremes."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-128, 128, (24, 2048), generator=gen, dtype=torch.int8)
    w = torch.randint(-128, 128, (40, 2048), generator=gen, dtype=torch.int8)
    x[0], w[0], x[1], w[1] = 127, 127, -128, -128
    return x, w


@functools.lru_cache(maxsize=1)
def int_mm_is_exact() -> bool:
    """Whether torch._int_mm gives exact int32 sums in this process, decided once by a self-test against the exact
    product (not by flags alone: a oneDNN capped below VNNI, by ONEDNN_MAX_CPU_ISA or its older name
    DNNL_MAX_CPU_ISA, saturates). Only asked where the CPU has int8 dot products, the one place it is fast."""
    if not hardware.native_int8():
        return False
    x, w = _saturation_probe()
    try:
        got = torch._int_mm(x, w.t())
    except (RuntimeError, TypeError):
        return False
    return torch.equal(got, exact_product(x, w).to(torch.int32))


def fastest_int32_gemm(backend, x2, w_q):
    """x2 @ w_q^T in int32, exact, by this CPU's fastest exact path (measured, docs "int8 GEMMs"): torch._int_mm
    (oneDNN) where the CPU has int8 dot products and its self-test passed (`int_mm_is_exact`); otherwise the
    cpu kernels' int16 multiply-add GEMM (quant_matmul.cpp: SIMD on AVX2 and AVX-512, scalar on a generic build)."""
    if int_mm_is_exact():
        return torch._int_mm(x2, w_q.t())
    return backend.ext.int8_gemm(x2, w_q)


def which_int32_gemm() -> str:
    """What `fastest_int32_gemm` runs here, for the patch report."""
    if int_mm_is_exact():
        return "torch._int_mm (oneDNN: int8 dot products, self-tested exact)"
    if hardware.native_int8():
        return (f"the cpu kernels' int16 multiply-add GEMM ({hardware.best_isa()}): torch._int_mm failed its "
                f"exactness self-test here (oneDNN capped below VNNI?)")
    if hardware.best_isa() != "generic":
        return f"the cpu kernels' int16 multiply-add GEMM ({hardware.best_isa()}: no int8 dot products)"
    return "the cpu kernels' int8 GEMM, scalar (no SIMD)"


@INT32_GEMM.impl("cpu")
def _(backend, x_q, w_q):
    return fastest_int32_gemm(backend, x_q, w_q)


@QUANT_MATMUL.impl("cpu")
def _(backend, x_q, w_q, x_scale, w_scale, bias, out_dtype):
    """The exact int32 GEMM this CPU runs fastest (`fastest_int32_gemm`), then the golden's epilogue in its order as
    one C++ pass (quant_matmul.cpp). Chosen by measurement over torch's other int8 GEMMs (README, "int8
    GEMMs"): the fastest that takes int8 rows with per-row scales as they are and stays bit-identical to
    the golden."""
    K, N = x_q.shape[-1], w_q.shape[0]
    acc = fastest_int32_gemm(backend, x_q.reshape(-1, K), w_q)
    return backend.ext.dequant(acc, x_scale, w_scale, bias, out_dtype).reshape(*x_q.shape[:-1], N)


@QUANT_MATMUL_STATIC.impl("cpu")
def _(backend, x_q, w_q, deq_scale, quant_bias, out_dtype):
    """The exact int32 GEMM (`fastest_int32_gemm`), then the golden's epilogue as one C++ pass (quant_matmul.cpp):
    the bias added to the accumulator in int64, one conversion, the multiply."""
    K, N = x_q.shape[-1], w_q.shape[0]
    acc = fastest_int32_gemm(backend, x_q.reshape(-1, K), w_q)
    return backend.ext.dequant_static(acc, deq_scale, quant_bias, out_dtype).reshape(*x_q.shape[:-1], N)

