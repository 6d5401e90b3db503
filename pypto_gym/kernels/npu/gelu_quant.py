"""gelu_dynamic_quant and gelu_quant on the npu backend: torch_npu.npu_gelu, then npu_dynamic_quant or npu_quantize.

npu_gelu(input, approximate='none') (torch_npu-npu_gelu.md) computes GELU in the form asked for, 'none' (erf) or
'tanh', its output in the input's dtype: the one rounding the golden's activation has. Its page notes that torch's own
gelu on an NPU ignores `approximate` and computes the tanh form, so this call is how an erf GELU (a patch merger's
nn.GELU()) is computed as the model asks. Limits from its page: at most 8 dims; Atlas A2 fp32/fp16/bf16, the Atlas
training and inference series fp16/fp32; Atlas A3 is not among its products: declined there. The activation is then
quantised by the dynamic_quant and static_quant mappings, whose limits apply too (npu_dynamic_quant: Atlas A2/A3,
fp16/bf16, the smooth scale in x's dtype; npu_quantize: no smooth scale): two kernels, the activation written once
between them. torch_npu 26.0.0 has npu_gelu_quant (aclnnGeluQuant), which would be one; no page documents it (its
op-plugin test runs on Ascend950 only), so it is not called.
"""
import torch

from ...ops.args import dtype_name
from ...ops.defs.gelu_quant import GELU_DYNAMIC_QUANT, GELU_QUANT
from .backend import HALF
from .dynamic_quant import npu_dynamic_quant, npu_dynamic_quant_supports
from .static_quant import npu_quantize, npu_quantize_supports

NAME = "npu_gelu"
NOT_ON_ITS_PAGE = ("Ascend910_93", "Ascend950")  # Atlas A3 and newer: npu_gelu's page lists A2 and the older series


def npu_gelu_supports(backend, x) -> str | None:
    if x.dim() > 8:
        return f"{NAME}: rank {x.dim()} > 8"
    name = backend.device_name(x.device.index)
    if name.startswith(NOT_ON_ITS_PAGE):
        return f"{NAME}: {name} is not among its page's products (Atlas A2, training and inference series)"
    series = backend.series_of(x)
    dtypes = (torch.float32, *HALF) if series == "a2_a3" else (torch.float32, torch.float16)
    if x.dtype not in dtypes:
        return f"{NAME}: dtype {dtype_name(x.dtype)} not supported on {series} chips"
    return None


def npu_gelu(backend, x, approximate):
    return backend.torch_npu().npu_gelu(x, approximate=approximate)


@GELU_DYNAMIC_QUANT.impl("npu", supports=lambda backend, x, smooth_scales, approximate, dst_type:
                         npu_gelu_supports(backend, x) or npu_dynamic_quant_supports(backend, x, smooth_scales,
                                                                                     dst_type))
def _(backend, x, smooth_scales, approximate, dst_type):
    return npu_dynamic_quant(backend, npu_gelu(backend, x, approximate), smooth_scales, dst_type)


@GELU_QUANT.impl("npu", supports=lambda backend, x, scale, offset, smooth_scales, approximate:
                 npu_gelu_supports(backend, x) or npu_quantize_supports(backend, x, scale, offset, smooth_scales))
def _(backend, x, scale, offset, smooth_scales, approximate):
    return npu_quantize(backend, npu_gelu(backend, x, approximate), scale, offset, smooth_scales)
