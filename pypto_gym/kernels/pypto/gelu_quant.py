"""gelu_dynamic_quant and gelu_quant on the pypto backend: the GELU (lib.gelu), its rounding to x's dtype and the
quantisation in one kernel each, whole-row tiles (the row max needs the row; a row that does not fit the unified
buffer with the GELU's temporaries is declined)."""
from ...ops.defs.gelu_quant import GELU_DYNAMIC_QUANT, GELU_QUANT
from ...ops.quantize import QUANT_RANGES
from .backend import Tiles, rows, vector
from .budget import Budget, vector_problem
from .norm_quant import static_rows

LIVE_FP32 = 5  # x, the polynomial's t and r, exp(-z^2), their product (the erf form's widest step)
ALIGN = 32  # int8 outputs: 32-byte rows


def gelu_tiles(D: int) -> Tiles | None:
    """One whole row per tile; None when it does not fit the unified buffer."""
    cols = -(-D // ALIGN) * ALIGN
    return None if vector_problem((1, cols), LIVE_FP32) else Tiles(1, cols)


def _supports(backend, x, *rest):
    if gelu_tiles(x.shape[-1]) is None:
        return f"a row of {x.shape[-1]} does not fit PyPTO's unified buffer with the GELU's temporaries"
    return backend.runs_on(x)


def gelu_dynamic_quant_kernel(pypto):
    from . import lib as pl

    def gelu_dynamic_quant(x: pypto.Tensor(), smooth: pypto.Tensor(), y: pypto.Tensor(), scale: pypto.Tensor(),
                           tanh_form, qmax, qmin, rows, cols):
        pypto.set_vec_tile_shapes(rows, cols)
        a = pl.gelu(pl.f32(x), tanh_form)
        if x.dtype != pl.FP32:  # the one rounding the module's output has
            a = pl.f32(pypto.cast(a, x.dtype))
        q, s = pl.quantise(a * pl.f32(smooth), qmax, qmin)
        y[:] = q
        scale[:] = s
    return gelu_dynamic_quant


def gelu_quant_kernel(pypto):
    from . import lib as pl

    def gelu_quant(x: pypto.Tensor(), smooth: pypto.Tensor(), scale: pypto.Tensor(), offset: pypto.Tensor(),
                   y: pypto.Tensor(), tanh_form, rows, cols):
        pypto.set_vec_tile_shapes(rows, cols)
        a = pl.gelu(pl.f32(x), tanh_form)
        if x.dtype != pl.FP32:
            a = pl.f32(pypto.cast(a, x.dtype))
        y[:] = pl.quantise_static(a * pl.f32(smooth), scale, offset)
    return gelu_quant


@GELU_DYNAMIC_QUANT.impl("pypto", supports=_supports)
def _(backend, x, smooth_scales, approximate, dst_type):
    y, scale = GELU_DYNAMIC_QUANT.empty_outputs(x, smooth_scales, approximate, dst_type)
    if x.numel():
        D = x.shape[-1]
        tiles = gelu_tiles(D)
        backend.launch("gelu_dynamic_quant", gelu_dynamic_quant_kernel, x, [rows(x), vector(smooth_scales, D, x, 1.0)],
                       [y.view(-1, D), scale.view(-1, 1)], [int(approximate == "tanh"), *QUANT_RANGES[dst_type]],
                       tiles=tiles, budget=Budget(vector=tiles.shape, live=LIVE_FP32))
    return y, scale


@GELU_QUANT.impl("pypto", supports=_supports)
def _(backend, x, scale, offset, smooth_scales, approximate):
    y = GELU_QUANT.empty_outputs(x, scale, offset, smooth_scales, approximate)
    if x.numel():
        D = x.shape[-1]
        tiles = gelu_tiles(D)
        backend.launch("gelu_quant", gelu_quant_kernel, x,
                       [rows(x), vector(smooth_scales, D, x, 1.0), *static_rows(scale, offset, D, x)],
                       [y.view(-1, D)], [int(approximate == "tanh")], tiles=tiles,
                       budget=Budget(vector=tiles.shape, live=LIVE_FP32))
    return y
