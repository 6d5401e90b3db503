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

import torch

from ..args import FLOAT_DTYPES, ArgValueError, DType, Output, Tensor
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
