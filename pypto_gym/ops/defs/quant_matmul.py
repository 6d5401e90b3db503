"""quant_matmul: the W8A8 linear, int8 x int8 with exact integer accumulation, dequantised (SPEC 8);
quant_matmul_static: its static form (SPEC 15).

y = fp32(x_q @ w_q^T, accumulated exactly) * x_scale[..., None] * w_scale (+ bias), cast to out_dtype.
x_q int8 [..., K] with per-row scales x_scale [...] (what the quant ops emit); w_q int8 [N, K] with
per-output-channel scales w_scale [N]; bias [N] in a float dtype or None. The order of the epilogue
(one fp32 conversion, the per-row scale, the per-channel scale, the bias in fp32, one cast) is the
one every backend follows. No gradient.

The static form is msModelSlim's W8A8 linear as vllm-ascend runs it (npu_quant_matmul with deq_scale and
an int32 bias): y = fp32(x_q @ w_q^T + quant_bias) * deq_scale, cast to out_dtype, where x_q are codes under
one static scale s_x and offset o, w_q per-channel codes under w_scale, deq_scale = s_x * w_scale (fp32
[N]) and quant_bias = rint(bias / deq_scale) - o * sum_k w_q[n, k] (int32 [N]): the offset's correction
and the float bias folded into one integer added to the exact integer product before the one conversion.
"""
from __future__ import annotations

import functools

import torch

from ... import hardware
from ..args import FLOAT_DTYPES, ArgValueError, DType, Output, Tensor, dtype_name
from ..backends.npu import HALF
from ..op import Op

EXACT_K = 1024  # int8 products are at most 2**14 in magnitude: sums of 1024 of them stay exact in fp32 (2**24)
MAX_K = 2 ** 17 - 1  # K * 128 * 128 must fit the int32 accumulator


def exact_product(x2, w_q) -> torch.Tensor:
    """x2 int8 [M, K] @ w_q int8 [N, K]^T exactly, as float64 (as an int32 accumulator is): computed in fp32 over
    chunks of EXACT_K columns, where every partial sum is an integer below 2**24, and summed in float64."""
    K = x2.shape[-1]
    acc = torch.zeros(x2.shape[0], w_q.shape[0], dtype=torch.float64, device=x2.device)
    for k in range(0, K, EXACT_K):
        acc += (x2[:, k:k + EXACT_K].to(torch.float32) @ w_q[:, k:k + EXACT_K].to(torch.float32).T).to(torch.float64)
    return acc


def quant_matmul(x_q, w_q, x_scale, w_scale, bias=None, out_dtype=torch.bfloat16):
    """W8A8 linear: (x_q @ w_q^T in int32) * x_scale[..., None] * w_scale (+ bias) as out_dtype, the integer
    product exact (`exact_product`)."""
    K, N = x_q.shape[-1], w_q.shape[0]
    acc = exact_product(x_q.reshape(-1, K), w_q)
    y = acc.to(torch.float32) * x_scale.reshape(-1, 1).to(torch.float32) * w_scale.to(torch.float32)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(out_dtype).reshape(*x_q.shape[:-1], N)


def quant_matmul_static(x_q, w_q, deq_scale, quant_bias=None, out_dtype=torch.bfloat16):
    """Static W8A8 linear: fp32(x_q @ w_q^T + quant_bias, an exact integer) * deq_scale as out_dtype."""
    K, N = x_q.shape[-1], w_q.shape[0]
    acc = exact_product(x_q.reshape(-1, K), w_q)
    if quant_bias is not None:
        acc = acc + quant_bias.to(torch.float64)
    y = acc.to(torch.float32) * deq_scale.to(torch.float32)
    return y.to(out_dtype).reshape(*x_q.shape[:-1], N)


def _k_in_range(ctx, *args):
    K = ctx.dims["K"]
    if not 0 < K <= MAX_K:
        raise ArgValueError("x_q", f"last dim K={K}; expected 1 <= K <= {MAX_K} (int32 accumulation)")


QUANT_MATMUL = Op(quant_matmul, [
    Tensor("x_q", "*R K", (torch.int8,), gen="int8"),
    Tensor("w_q", "N K", (torch.int8,), gen="int8"),
    Tensor("x_scale", "*R", (torch.float32,), gen="scale"),
    Tensor("w_scale", "N", (torch.float32,), gen="scale"),
    Tensor("bias", "N", FLOAT_DTYPES, optional=True, gen="small"),
    DType("out_dtype", default=torch.bfloat16, kw_only=True),
], [Output("y")], check=_k_in_range,
    examples=({"R": (2, 7), "K": 300, "N": 24}, {"R": (1,), "K": 2048, "N": 64, "out_dtype": torch.float32},
              {"R": (17,), "K": 16, "N": 8, "bias": None, "out_dtype": torch.float16}))


QUANT_MATMUL_STATIC = Op(quant_matmul_static, [
    Tensor("x_q", "*R K", (torch.int8,), gen="int8"),
    Tensor("w_q", "N K", (torch.int8,), gen="int8"),
    Tensor("deq_scale", "N", (torch.float32,), gen="scale"),
    Tensor("quant_bias", "N", (torch.int32,), optional=True,
           gen=lambda shape, g: torch.randint(-2 ** 20, 2 ** 20, shape, generator=g).to(torch.float32)),
    DType("out_dtype", default=torch.bfloat16, kw_only=True),
], [Output("y")], check=_k_in_range,
    examples=({"R": (2, 7), "K": 300, "N": 24}, {"R": (1,), "K": 2048, "N": 64, "out_dtype": torch.float32},
              {"R": (17,), "K": 16, "N": 8, "quant_bias": None, "out_dtype": torch.float16}))


def int32_gemm(x_q, w_q):
    """x_q int8 [M, K] @ w_q int8 [N, K]^T -> int32 [M, N], exact: the int32 accumulator of an int8 GEMM
    (`exact_product`). The W8A8 MLP's merged gate/up GEMM, whose accumulator dequant_swiglu_quant takes."""
    return exact_product(x_q, w_q).to(torch.int32)


INT32_GEMM = Op(int32_gemm, [
    Tensor("x_q", "M K", (torch.int8,), gen="int8"),
    Tensor("w_q", "N K", (torch.int8,), gen="int8"),
], [Output("acc", kind="exact")], check=_k_in_range,
    examples=({"M": 7, "K": 300, "N": 24}, {"M": 1, "K": 2048, "N": 64}, {"M": 33, "K": 16, "N": 8}))


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


INT32_GEMM.not_on("npu", "int32_gemm is the CPU's merged gate/up GEMM; on the NPU each int8 linear runs "
                         "npu_quant_matmul")
INT32_GEMM.not_on("pypto", "int32_gemm is not provided: PyPTO 0.2.0's int8 pypto.matmul is not wired in yet")


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


# npu_quant_matmul(x1, x2, scale, *, offset, pertoken_scale, bias, output_dtype): x1 = int8 rows [M, K],
# x2 = the int8 weight as [K, N] (a transposed view of our [N, K]), scale = the per-channel fp32 scales,
# pertoken_scale = the per-row fp32 scales (A2/A3 chips only), a float bias added after dequantisation,
# output fp16/bf16 (the documented rows with pertoken_scale, torch_npu-npu_quant_matmul.md table 2). The float bias
# goes in as float32, which both rows document (fp16 output takes no fp16 bias; the golden adds f32(bias) anyway),
# as vllm-ascend passes it. The last dims of x1 and x2 (K, N) may not exceed 65535: an N above it (a 151,936-row
# int8 lm_head) runs as column blocks of at most 65535, as vllm-ascend's w8a8_dynamic splits it; a K above it is
# declined.
MAX_LAST_DIM = 65535


def _column_blocks(N: int) -> list:
    return [(n, min(n + MAX_LAST_DIM, N)) for n in range(0, N, MAX_LAST_DIM)]


def _npu_k_limit(name, x_q):
    K = x_q.shape[-1]
    return f"{name}: K = {K} above the documented last-dim limit of {MAX_LAST_DIM}" if K > MAX_LAST_DIM else None


def _npu_supports(backend, x_q, w_q, x_scale, w_scale, bias, out_dtype):
    name = "npu_quant_matmul"
    series = backend.series_of(x_q)
    if series != "a2_a3":
        return f"{name}: pertoken_scale is not supported on {series} chips"
    if not x_q.numel() or not w_q.numel():
        return f"{name}: empty tensors are not supported"
    if out_dtype not in HALF:
        return f"{name}: output_dtype {dtype_name(out_dtype)} not supported with pertoken_scale (float16, bfloat16)"
    return _npu_k_limit(name, x_q)


@QUANT_MATMUL.impl("npu", supports=_npu_supports)
def _(backend, x_q, w_q, x_scale, w_scale, bias, out_dtype):
    K, N = x_q.shape[-1], w_q.shape[0]
    x1, pertoken = x_q.reshape(-1, K), x_scale.reshape(-1)
    bias = None if bias is None else bias.to(torch.float32)
    blocks = [backend.torch_npu().npu_quant_matmul(x1, w_q[a:b].t(), w_scale[a:b], pertoken_scale=pertoken,
                                                   bias=None if bias is None else bias[a:b], output_dtype=out_dtype)
              for a, b in _column_blocks(N)]
    y = blocks[0] if len(blocks) == 1 else torch.cat(blocks, -1)
    return y.reshape(*x_q.shape[:-1], N)


# The static form as vllm-ascend's W8A8 method calls it: npu_quant_matmul(x, w^T, deq_scale, bias=quant_bias
# (int32), output_dtype). bf16 output takes the fp32 deq_scale (A2/A3); fp16 output takes it as int64, converted
# by npu_trans_quant_param (what msModelSlim stores for fp16 models), which keeps the scale's upper 19 bits (sign,
# exponent, 10 mantissa bits): round_mode=1 rounds to them (0, the default, truncates). So fp16 output on the NPU
# computes with a scale within 2^-11 of deq_scale: within the precision rule of the golden, not bit-identical
# (about half of fp16 outputs 1-2 ulp apart; docs/reference.md's precision classes).
TRANS_QUANT_ROUND = 1
def _npu_static_supports(backend, x_q, w_q, deq_scale, quant_bias, out_dtype):
    name = "npu_quant_matmul"
    if not x_q.numel() or not w_q.numel():
        return f"{name}: empty tensors are not supported"
    if out_dtype not in HALF:
        return f"{name}: output_dtype {dtype_name(out_dtype)} not supported with an int32 bias (float16, bfloat16)"
    if out_dtype == torch.bfloat16 and backend.series_of(x_q) != "a2_a3":
        return f"{name}: bfloat16 output is supported on Atlas A2/A3 chips only"
    return _npu_k_limit(name, x_q)


@QUANT_MATMUL_STATIC.impl("npu", supports=_npu_static_supports)
def _(backend, x_q, w_q, deq_scale, quant_bias, out_dtype):
    tnpu = backend.torch_npu()
    K, N = x_q.shape[-1], w_q.shape[0]
    scale = deq_scale if out_dtype == torch.bfloat16 else tnpu.npu_trans_quant_param(deq_scale,
                                                                                     round_mode=TRANS_QUANT_ROUND)
    x1 = x_q.reshape(-1, K)
    blocks = [tnpu.npu_quant_matmul(x1, w_q[a:b].t(), scale[a:b], bias=None if quant_bias is None else quant_bias[a:b],
                                    output_dtype=out_dtype) for a, b in _column_blocks(N)]
    y = blocks[0] if len(blocks) == 1 else torch.cat(blocks, -1)
    return y.reshape(*x_q.shape[:-1], N)


QUANT_MATMUL_STATIC.not_on("pypto", "quant_matmul_static is not provided: PyPTO 0.2.0's int8 pypto.matmul verifies "
                                    "only with the whole K in one cube tile, which a hidden size of 2048 overflows")
QUANT_MATMUL.not_on("pypto", "quant_matmul is not provided: PyPTO 0.2.0's int8 pypto.matmul runs on the cube unit, "
                             "whose tiling and SIM verification this backend does not have yet")
