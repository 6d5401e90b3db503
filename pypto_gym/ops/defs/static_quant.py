"""static_quant (SPEC 15): static per-tensor int8 of a linear's input that no fused op produced.

y = clamp(rint(n / f32(scale) + f32(offset)), -128, 127) with n = f32(x) (* f32(smooth_scales), SmoothQuant's
1/s for the linear's input channels, as dynamic_quant takes it) (ops/quantize.py `quantize_static`): one scale
and one integer offset fixed offline by calibration, msModelSlim's W8A8 activation rule and torch_npu's
npu_quantize with div_mode=True (which has no smooth scale: a checkpoint folds it into the source's weights).
What a static int8 o_proj and down_proj run on their float input (the norms' static forms produce the other
linears' codes directly); no gradient.
"""
import torch

from ..args import Output, Tensor, dtype_name
from ..backends.pypto_backend import first_runs_here, rows, vector
from ..op import Op
from ..quantize import quantize_static
from .norm_quant import STATIC_OFFSET, STATIC_SCALE, npu_static_params, npu_static_supports, static_rows, \
    static_scalars


def static_quant(x, scale, offset=None, smooth_scales=None):
    """Static per-tensor int8 of f32(x) (* smooth_scales) under `scale` and `offset` -> y int8. No gradient."""
    n = x.to(torch.float32)
    if smooth_scales is not None:
        n = n * smooth_scales.reshape(x.shape[-1]).to(torch.float32)
    return quantize_static(n, scale, offset)


STATIC_QUANT = Op(static_quant, [
    Tensor("x", "*R D"), STATIC_SCALE, STATIC_OFFSET,
    Tensor("smooth_scales", "D", None, floats=True, optional=True, flat=True, gen="smooth"),
], [Output("y", "codes")], min_dims={"D": 1},
    examples=({"R": (2, 5), "D": 2048}, {"R": (3,), "D": 1280, "offset": None, "smooth_scales": None},
              {"R": (7,), "D": 40, "dtype": torch.float16}, {"R": (4,), "D": 33, "dtype": torch.float32}))


@STATIC_QUANT.impl("cpu")
def _(backend, x, scale, offset, smooth_scales):
    return backend.ext.static_quant(x, smooth_scales, *static_scalars(scale, offset))


# npu_quantize(x, scales, zero_points, dtype, axis, div_mode): torch.qint8 codes, axis -1, div_mode=True divides by
# the scale (our rule, bit for bit: vllm-ascend's div_mode=False multiplies by a reciprocal, which rounds differently);
# with div_mode=True the page documents float32 (bfloat16 on A2/A3) scales and int8/uint8/int32 zero points, so the
# scale goes in as float32 and the offset as int32, repeated to D (norm_quant.py's npu_static_params).
NAME = "npu_quantize"


def _npu_supports(backend, x, scale, offset, smooth_scales):
    if smooth_scales is not None:
        return (f"{NAME} has no smooth scale (a checkpoint folds it into the source's weights); smooth_scales "
                f"{dtype_name(smooth_scales.dtype)} given")
    return npu_static_supports(NAME, backend, x, scale, offset)


@STATIC_QUANT.impl("npu", supports=_npu_supports)
def _(backend, x, scale, offset, smooth_scales):
    scales, zeros = npu_static_params(NAME, x, scale, offset)
    return backend.torch_npu().npu_quantize(x, scales, zeros, torch.qint8, -1, True)


def static_quant_kernel(pypto):
    from ..backends import pypto_lib as pl

    def static_quant(x: pypto.Tensor(), smooth: pypto.Tensor(), scale: pypto.Tensor(), offset: pypto.Tensor(),
                     y: pypto.Tensor(), rows, cols):
        pypto.set_vec_tile_shapes(rows, cols)
        y[:] = pl.quantise_static(pl.f32(x) * pl.f32(smooth), scale, offset)
    return static_quant


@STATIC_QUANT.impl("pypto", supports=first_runs_here)
def _(backend, x, scale, offset, smooth_scales):
    y = STATIC_QUANT.empty_outputs(x, scale, offset, smooth_scales)
    if x.numel():
        D = x.shape[-1]
        backend.launch("static_quant", static_quant_kernel, x,
                       [rows(x), vector(smooth_scales, D, x, 1.0), *static_rows(scale, offset, D, x)],
                       [y.view(-1, D)], [], align=32)
    return y
