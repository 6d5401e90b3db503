"""swiglu and silu_and_mul on the npu backend: torch_npu.npu_swiglu.

npu_swiglu(input, dim=-1) -> swish(A) * B for A, B the halves of input along dim: 1-8 dims, not empty,
fp32/fp16/bf16, Atlas A2/A3. It computes in fp32 and rounds once (our fp32 mode; in hf mode it differs
from HF's two roundings by at most an ulp). Two views of one merged tensor are passed as that tensor;
separate gate and up are concatenated first (one copy).
"""
import torch

from ...ops.defs.swiglu import SILU_AND_MUL, SWIGLU


def _npu_supports(backend, gate, up, cast_mode):
    if not 1 <= gate.dim() <= 8:
        return f"npu_swiglu: rank {gate.dim()} not in 1-8"
    if not gate.numel():
        return "npu_swiglu: empty tensors are not supported"
    if backend.series_of(gate) != "a2_a3":
        return "npu_swiglu: supported on Atlas A2/A3 chips only"
    return None


def merged_halves(gate, up):
    """The [..., 2I] tensor whose two halves gate and up are (views of one contiguous buffer), else None."""
    shape = (*gate.shape[:-1], 2 * gate.shape[-1])
    strides = [1]
    for d in reversed(shape[1:]):
        strides.insert(0, strides[0] * d)
    if (gate.stride() != tuple(strides) or up.stride() != gate.stride()
            or up.data_ptr() != gate.data_ptr() + gate.shape[-1] * gate.element_size()):
        return None
    return gate.as_strided(shape, strides)


@SWIGLU.impl("npu", supports=_npu_supports)
def _(backend, gate, up, cast_mode):
    merged = merged_halves(gate, up)
    if merged is None:
        merged = torch.cat([gate, up], dim=-1)
    return backend.torch_npu().npu_swiglu(merged, dim=-1)


@SILU_AND_MUL.impl("npu", supports=lambda backend, x, cast_mode: _npu_supports(backend, x, x, cast_mode))
def _(backend, x, cast_mode):
    return backend.torch_npu().npu_swiglu(x, dim=-1)

