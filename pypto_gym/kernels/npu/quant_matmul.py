"""quant_matmul and quant_matmul_static on the npu backend: torch_npu.npu_quant_matmul (int32_gemm is not mapped).

npu_quant_matmul(x1, x2, scale, *, offset, pertoken_scale, bias, output_dtype): x1 = int8 rows [M, K],
x2 = the int8 weight as [K, N] (a transposed view of our [N, K]), scale = the per-channel fp32 scales,
pertoken_scale = the per-row fp32 scales (A2/A3 chips only), a float bias added after dequantisation,
output fp16/bf16 (the documented rows with pertoken_scale, torch_npu-npu_quant_matmul.md table 2). The float bias
goes in as float32, which both rows document (fp16 output takes no fp16 bias; the golden adds f32(bias) anyway),
as vllm-ascend passes it. The last dims of x1 and x2 (K, N) may not exceed 65535: an N above it (a 151,936-row
int8 lm_head) runs as column blocks of at most 65535, as vllm-ascend's w8a8_dynamic splits it; a K above it is
declined.
x2 goes in the NZ format (torch_npu.npu_format_cast(..., 29), "昇腾亲和的数据排布" of the page's 约束说明, for its
load bandwidth), converted once per weight and in-place version as vllm-ascend converts at load: on A2/A3 the [K, N]
weight not transposed (the page's recommendation there), on the inference series the [N, K] weight, passed
transposed (the page's requirement there). The NZ copy sits beside the model's [N, K] weight (which the other
backends read): twice the int8 weight memory on the device.
"""
from __future__ import annotations

import torch

from ...ops.args import dtype_name
from ...ops.defs.quant_matmul import INT32_GEMM, QUANT_MATMUL, QUANT_MATMUL_STATIC
from .backend import HALF, converted_once

MAX_LAST_DIM = 65535
ACL_FORMAT_FRACTAL_NZ = 29


def nz_weight(backend, w_q: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """x2 for npu_quant_matmul: rows a:b of the int8 weight [N, K] in the NZ format, as the chip series wants it."""
    tnpu = backend.torch_npu()
    if backend.series_of(w_q) == "a2_a3":
        return converted_once(w_q, ("nz", a, b),
                              lambda w: tnpu.npu_format_cast(w[a:b].t().contiguous(), ACL_FORMAT_FRACTAL_NZ))
    return converted_once(w_q, ("nz transposed", a, b),
                          lambda w: tnpu.npu_format_cast(w[a:b].contiguous(), ACL_FORMAT_FRACTAL_NZ)).t()


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
    blocks = [backend.torch_npu().npu_quant_matmul(x1, nz_weight(backend, w_q, a, b), w_scale[a:b],
                                                   pertoken_scale=pertoken,
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
    blocks = [tnpu.npu_quant_matmul(x1, nz_weight(backend, w_q, a, b), scale[a:b],
                                    bias=None if quant_bias is None else quant_bias[a:b],
                                    output_dtype=out_dtype) for a, b in _column_blocks(N)]
    y = blocks[0] if len(blocks) == 1 else torch.cat(blocks, -1)
    return y.reshape(*x_q.shape[:-1], N)

INT32_GEMM.not_on("npu", "int32_gemm is the CPU's merged gate/up GEMM; on the NPU each int8 linear runs "
                         "npu_quant_matmul")
