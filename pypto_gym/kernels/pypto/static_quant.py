"""static_quant on the pypto backend: one kernel, the static scale and offset as [1, D] rows (norm_quant.py)."""
from ...ops.defs.static_quant import STATIC_QUANT
from .backend import first_runs_here, rows, vector
from .norm_quant import static_rows


def static_quant_kernel(pypto):
    from . import lib as pl

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
