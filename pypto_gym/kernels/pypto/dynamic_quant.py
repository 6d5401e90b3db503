"""dynamic_quant on the pypto backend: one kernel, whole-row tiles (the row max needs the row)."""
from ...ops.defs.dynamic_quant import DYNAMIC_QUANT
from ...ops.quantize import QUANT_RANGES
from .backend import first_runs_here, rows, vector


def dynamic_quant_kernel(pypto):
    from . import lib as pl

    def dynamic_quant(x: pypto.Tensor(), smooth: pypto.Tensor(), y: pypto.Tensor(), scale: pypto.Tensor(), qmax,
                      qmin, rows, cols):
        pypto.set_vec_tile_shapes(rows, cols)
        q, s = pl.quantise(pl.f32(x) * pl.f32(smooth), qmax, qmin)
        y[:] = q
        scale[:] = s
    return dynamic_quant


@DYNAMIC_QUANT.impl("pypto", supports=first_runs_here)
def _(backend, x, smooth_scales, dst_type):
    y, scale = DYNAMIC_QUANT.empty_outputs(x, smooth_scales, dst_type)
    if x.numel():
        D = x.shape[-1]
        backend.launch("dynamic_quant", dynamic_quant_kernel, x, [rows(x), vector(smooth_scales, D, x, 1.0)],
                       [y.view(-1, D), scale.view(-1, 1)], [*QUANT_RANGES[dst_type]], align=32)
    return y, scale
