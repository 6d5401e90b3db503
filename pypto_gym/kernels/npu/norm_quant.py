"""The norm + quant ops on the npu backend: torch_npu.npu_add_rms_norm_dynamic_quant and npu_add_rms_norm_quant.

npu_add_rms_norm_dynamic_quant(x1, x2, gamma, *, smooth_scale1, smooth_scale2, beta, epsilon,
output_mask, y_dtype) -> (y1, y2, x_out, scale1, scale2): 2-8 dims, no empty tensors, fp16/bf16, A2/A3
chips; output_mask=[True, two] asks for the second branch only with a second smooth scale; int4 is
y_dtype=torch.quint4x2 (eight codes per int32, D % 8 == 0). rms_norm_dynamic_quant is the same op with
x2 = 0 (x + 0 == x exactly), which keeps SPEC 2.3's fp32 math.

npu_add_rms_norm_quant(x1, x2, gamma, scales1, zero_points1, beta, scales2, zero_points2, *, axis=-1, epsilon,
div_mode=True) -> (y1, y2, x_out): x = x1 + x2, y1 = round(rms_norm(x) * gamma (+ beta) / scales1 + zero_points1)
with div_mode=True (our rule); scales2 must be None; 1-8 dims, no empty tensors, fp16 (bf16 on A2/A3). The scale
and offset go in repeated to D (as vllm-ascend passes them: aclnn_input_scale, aclnn_input_offset) in the dtypes of
the page's table (torch_npu-npu_add_rms_norm_quant.md, 各产品型号支持数据类型说明): fp16 x takes float32 scales and
int32 zero points, bf16 x bfloat16 for both; a scale or offset those dtypes do not hold exactly is declined, never
rounded. rms_norm_quant is the same op with x2 = 0 (x + 0 == x exactly).
"""
import torch

from ...ops.args import dtype_name
from ...ops.defs.norm_quant import (
    ADD_RMS_NORM_DYNAMIC_QUANT,
    ADD_RMS_NORM_QUANT,
    RMS_NORM_DYNAMIC_QUANT,
    RMS_NORM_QUANT,
)
from ...ops.quantize import unpack_int4_from_int32
from .backend import as_rows, needs, quant_limits

NAME = "npu_add_rms_norm_dynamic_quant"


def _npu_supports(backend, x, *rest):
    dst_type = rest[-1]
    if x.dim() > 8:
        return f"rank {x.dim()} > 8"
    return quant_limits(NAME, x, dst_type, backend)


def _npu_add_quant(backend, x1, x2, gamma, smooth_scale1, smooth_scale2, beta, eps, dst_type):
    D = x1.shape[-1]
    vec = (lambda t: None if t is None else t.reshape(D))  # noqa: E731
    two = smooth_scale2 is not None
    # keywords a torch_npu release may lack (beta, y_dtype) only where the call needs them (npu.py: NEWER_KEYWORDS)
    optional = {"beta": vec(beta)} if beta is not None else {}
    if dst_type == "int4":
        optional["y_dtype"] = torch.quint4x2
    y1, y2, x_out, s1, s2 = backend.torch_npu().npu_add_rms_norm_dynamic_quant(
        as_rows(x1), as_rows(x2), gamma.reshape(D), smooth_scale1=vec(smooth_scale1),
        smooth_scale2=vec(smooth_scale2), epsilon=eps, output_mask=[True, two], **optional)
    if dst_type == "int4":  # eight codes per int32 -> one code per int8
        y1 = unpack_int4_from_int32(y1)
        y2 = unpack_int4_from_int32(y2) if two else y2
    shape, row_shape = x1.shape, x1.shape[:-1]
    return (y1.reshape(shape), y2.reshape(shape) if two else None, x_out.reshape(shape), s1.reshape(row_shape),
            s2.reshape(row_shape) if two else None)


_npu_dynamic_supports = needs("npu_add_rms_norm_dynamic_quant")(_npu_supports)


@RMS_NORM_DYNAMIC_QUANT.impl("npu", supports=_npu_dynamic_supports)
def _(backend, x, gamma, smooth_scales, beta, eps, dst_type):
    y1, _, _, s1, _ = _npu_add_quant(backend, x, torch.zeros_like(x), gamma, smooth_scales, None, beta, eps, dst_type)
    return y1, s1


ADD_RMS_NORM_DYNAMIC_QUANT.impl("npu", supports=_npu_dynamic_supports)(_npu_add_quant)


STATIC_NAME = "npu_add_rms_norm_quant"
# (scales, zero points) dtypes per x dtype: the norm op's table; npu_quantize with div_mode=True takes float32 scales
# and int32 zero points on every chip series (torch_npu-npu_quantize.md; bfloat16 scales only on A2/A3)
STATIC_PARAM_DTYPES = {STATIC_NAME: {torch.float16: (torch.float32, torch.int32),
                                     torch.bfloat16: (torch.bfloat16, torch.bfloat16)},
                       "npu_quantize": {torch.float16: (torch.float32, torch.int32),
                                        torch.bfloat16: (torch.float32, torch.int32)}}


def exact_in(t, dtype) -> bool:
    """Whether `t` holds the same values in `dtype` (int8 codes always do in fp16/bf16/fp32/int32; a float is exact in
    an integer dtype when it is a finite integer in its range)."""
    if t is None or t.dtype in (dtype, torch.int8):
        return True
    if not dtype.is_floating_point and not bool(torch.isfinite(t.float()).all()):
        return False
    return torch.equal(t.to(dtype).to(t.dtype), t)


def npu_static_supports(name, backend, x, scale, offset) -> str | None:
    """The limits torch_npu's static quant ops share (npu_add_rms_norm_quant, npu_quantize), or None."""
    if not x.numel():
        return f"{name}: empty tensors are not supported"
    if x.dim() > 8:
        return f"{name}: rank {x.dim()} > 8"
    if x.dtype not in (torch.float16, torch.bfloat16):
        return f"{name}: dtype {dtype_name(x.dtype)} not supported (float16, bfloat16)"
    if x.dtype == torch.bfloat16 and backend.series_of(x) != "a2_a3":
        return f"{name}: bfloat16 is supported on Atlas A2/A3 chips only"
    if name == STATIC_NAME and backend.series_of(x) != "a2_a3" and x.shape[-1] < 32:
        return f"{name}: last dim {x.shape[-1]} < 32 on {backend.series_of(x)} chips"
    scale_t, zero_t = STATIC_PARAM_DTYPES[name][x.dtype]
    for arg, t, want in (("scale", scale, scale_t), ("offset", offset, zero_t)):
        if not exact_in(t, want):
            return f"{name}: {arg} {dtype_name(t.dtype)} is not exact in the {dtype_name(want)} it takes"
    return None


def npu_static_params(name, x, scale, offset):
    """scale and offset as torch_npu's static quant op `name` takes them: repeated to D, in the dtypes its page
    documents for x's dtype (STATIC_PARAM_DTYPES)."""
    D = x.shape[-1]
    scale_t, zero_t = STATIC_PARAM_DTYPES[name][x.dtype]
    zero = torch.zeros(1, dtype=zero_t, device=x.device) if offset is None else offset
    return scale.reshape(1).to(scale_t).expand(D).contiguous(), zero.reshape(1).to(zero_t).expand(D).contiguous()


def _npu_add_static(backend, x1, x2, gamma, scale, offset, beta, eps):
    scales, zeros = npu_static_params(STATIC_NAME, x1, scale, offset)
    D = x1.shape[-1]
    optional = {} if beta is None else {"beta": beta.reshape(D)}  # beta: a keyword older releases lack
    y, _, x_out = backend.torch_npu().npu_add_rms_norm_quant(
        as_rows(x1), as_rows(x2), gamma.reshape(D), scales, zeros, epsilon=eps, div_mode=True, **optional)
    return y.reshape(x1.shape), x_out.reshape(x1.shape)


@RMS_NORM_QUANT.impl("npu", supports=needs(STATIC_NAME)(lambda backend, x, gamma, scale, offset, *rest:
                     npu_static_supports(STATIC_NAME, backend, x, scale, offset)))
def _(backend, x, gamma, scale, offset, beta, eps):
    return _npu_add_static(backend, x, torch.zeros_like(x), gamma, scale, offset, beta, eps)[0]


ADD_RMS_NORM_QUANT.impl("npu", supports=needs(STATIC_NAME)(lambda backend, x1, x2, gamma, scale, offset, *rest:
                        npu_static_supports(STATIC_NAME, backend, x1, scale, offset)))(_npu_add_static)

