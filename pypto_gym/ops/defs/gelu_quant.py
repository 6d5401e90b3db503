"""gelu_dynamic_quant and gelu_quant: a GELU MLP's middle in W8A8, its activation quantised for the int8 second linear
(Qwen3-VL's vision `linear_fc2`, a patch merger's) in the pass that computes it, as swiglu_dynamic_quant feeds a
SwiGLU MLP's down_proj.

a = F.gelu(x, approximate) in x's dtype (`none`: erf, `nn.GELU()`; `tanh`: HF's `gelu_pytorch_tanh`): one rounding,
exactly the tensor the module's fc2 would read; n = f32(a) (* f32(smooth_scales), SmoothQuant's 1/s, optional).
Dynamic: (y, scale) = per-row symmetric int8/int4 of n (ops/quantize.py: scale = row_max|n| / qmax, fp32, shape
x.shape[:-1]). Static: y = clamp(rint(n / f32(scale) + f32(offset))) under one calibrated scale and offset. So the
codes equal `dynamic_quant(F.gelu(x))` / `static_quant(F.gelu(x), ...)`, without the [tokens, I] activation written
out and read back between the two. A NaN or an infinity in x makes its row's dynamic scale NaN or inf and its codes 0,
as the golden's. At +inf torch's erf GELU is NaN through oneDNN (fp32, and bf16/fp16 where the CPU has them) and inf
through its own kernel; the kernels here give inf, GELU's limit (a static code 127 where torch's NaN path gives 0).
No gradient.
"""
import torch
import torch.nn.functional as F

from ..args import Choice, Output, Tensor
from ..op import Op
from ..quantize import DST_TYPES, quantize_rows, quantize_static
from .norm_quant import STATIC_OFFSET, STATIC_SCALE

APPROXIMATIONS = ("none", "tanh")  # F.gelu's and torch_npu.npu_gelu's `approximate`


def _activation(x, smooth_scales, approximate):
    n = F.gelu(x, approximate=approximate).to(torch.float32)
    return n if smooth_scales is None else n * smooth_scales.reshape(x.shape[-1]).to(torch.float32)


def gelu_dynamic_quant(x, smooth_scales=None, approximate="none", dst_type="int8"):
    """F.gelu(x) in x's dtype (* smooth_scales), per-row symmetric int8/int4 -> (y, scale). No gradient."""
    return quantize_rows(_activation(x, smooth_scales, approximate), dst_type)


def gelu_quant(x, scale, offset=None, smooth_scales=None, approximate="none"):
    """F.gelu(x) in x's dtype (* smooth_scales), static per-tensor int8 under `scale` and `offset` -> y. No
    gradient."""
    return quantize_static(_activation(x, smooth_scales, approximate), scale, offset)


SMOOTH = Tensor("smooth_scales", "D", None, floats=True, optional=True, flat=True, gen="smooth")
APPROXIMATE = Choice("approximate", APPROXIMATIONS, default="none", kw_only=True)

GELU_DYNAMIC_QUANT = Op(gelu_dynamic_quant, [
    Tensor("x", "*R D"), SMOOTH, APPROXIMATE,
    Choice("dst_type", DST_TYPES, default="int8", kw_only=True),
], [Output("y", "codes"), Output("scale", "scale")], min_dims={"D": 1},
    examples=({"R": (2, 5), "D": 1024, "approximate": "tanh"}, {"R": (3,), "D": 1280, "smooth_scales": None},
              {"R": (7,), "D": 40, "dtype": torch.float16, "dst_type": "int4"},
              {"R": (4,), "D": 33, "dtype": torch.float32, "approximate": "tanh"}))

GELU_QUANT = Op(gelu_quant, [
    Tensor("x", "*R D"), STATIC_SCALE, STATIC_OFFSET, SMOOTH, APPROXIMATE,
], [Output("y", "codes")], min_dims={"D": 1},
    examples=({"R": (2, 5), "D": 1024, "approximate": "tanh", "smooth_scales": None},
              {"R": (3,), "D": 1280, "offset": None},
              {"R": (7,), "D": 40, "dtype": torch.float16}, {"R": (4,), "D": 33, "dtype": torch.float32}))
