"""The norm + quant ops on the pypto backend: the norm (lib.quant_input) and the quantisation in one kernel each;
the static scale and offset as [1, D] fp32 rows (what torch_npu's repeat to D is)."""
import torch

from ...ops.defs.norm_quant import (
    ADD_RMS_NORM_DYNAMIC_QUANT,
    ADD_RMS_NORM_QUANT,
    RMS_NORM_DYNAMIC_QUANT,
    RMS_NORM_QUANT,
)
from ...ops.quantize import QUANT_RANGES
from .backend import first_runs_here, rows, vector


def quant_kernel(pypto):
    from . import lib as pl

    def rms_norm_dynamic_quant(x: pypto.Tensor(), g: pypto.Tensor(), smooth: pypto.Tensor(), beta: pypto.Tensor(),
                               y: pypto.Tensor(), scale: pypto.Tensor(), eps, inv_d, qmax, qmin, rows, cols):
        pypto.set_vec_tile_shapes(rows, cols)
        q, s = pl.quantise(pl.quant_input(x, g, beta, eps, inv_d) * pl.f32(smooth), qmax, qmin)
        y[:] = q
        scale[:] = s
    return rms_norm_dynamic_quant


def add_quant_kernel(pypto):
    from . import lib as pl

    def add_rms_norm_dynamic_quant(x1: pypto.Tensor(), x2: pypto.Tensor(), g: pypto.Tensor(), smooth: pypto.Tensor(),
                                   beta: pypto.Tensor(), y: pypto.Tensor(), x_out: pypto.Tensor(),
                                   scale: pypto.Tensor(), eps, inv_d, qmax, qmin, rows, cols):
        pypto.set_vec_tile_shapes(rows, cols)
        s = pypto.add(x1, x2)
        q, sc = pl.quantise(pl.quant_input(s, g, beta, eps, inv_d) * pl.f32(smooth), qmax, qmin)
        y[:] = q
        x_out[:] = s
        scale[:] = sc
    return add_rms_norm_dynamic_quant


def add_quant2_kernel(pypto):
    from . import lib as pl

    def add_rms_norm_dynamic_quant2(x1: pypto.Tensor(), x2: pypto.Tensor(), g: pypto.Tensor(),
                                    smooth1: pypto.Tensor(), smooth2: pypto.Tensor(), beta: pypto.Tensor(),
                                    y1: pypto.Tensor(), y2: pypto.Tensor(), x_out: pypto.Tensor(),
                                    scale1: pypto.Tensor(), scale2: pypto.Tensor(), eps, inv_d, qmax, qmin, rows,
                                    cols):
        pypto.set_vec_tile_shapes(rows, cols)
        s = pypto.add(x1, x2)
        n = pl.quant_input(s, g, beta, eps, inv_d)
        q1, sc1 = pl.quantise(n * pl.f32(smooth1), qmax, qmin)
        q2, sc2 = pl.quantise(n * pl.f32(smooth2), qmax, qmin)
        y1[:] = q1
        y2[:] = q2
        x_out[:] = s
        scale1[:] = sc1
        scale2[:] = sc2
    return add_rms_norm_dynamic_quant2


@RMS_NORM_DYNAMIC_QUANT.impl("pypto", supports=first_runs_here)
def _(backend, x, gamma, smooth_scales, beta, eps, dst_type):
    y, scale = RMS_NORM_DYNAMIC_QUANT.empty_outputs(x, gamma, smooth_scales, beta, eps, dst_type)
    if x.numel():
        D = x.shape[-1]
        backend.launch("rms_norm_dynamic_quant", quant_kernel, x,
                       [rows(x), vector(gamma, D, x, 1.0), vector(smooth_scales, D, x, 1.0), vector(beta, D, x, 0.0)],
                       [y.view(-1, D), scale.view(-1, 1)], [float(eps), 1.0 / D, *QUANT_RANGES[dst_type]], align=32)
    return y, scale


@ADD_RMS_NORM_DYNAMIC_QUANT.impl("pypto", supports=first_runs_here)
def _(backend, x1, x2, gamma, smooth_scale1, smooth_scale2, beta, eps, dst_type):
    y1, y2, x_out, s1, s2 = ADD_RMS_NORM_DYNAMIC_QUANT.empty_outputs(x1, x2, gamma, smooth_scale1, smooth_scale2, beta,
                                                                     eps, dst_type)
    if x1.numel():
        D = x1.shape[-1]
        vectors = [vector(gamma, D, x1, 1.0), vector(smooth_scale1, D, x1, 1.0)]
        scalars = [float(eps), 1.0 / D, *QUANT_RANGES[dst_type]]
        if smooth_scale2 is not None:
            vectors.append(vector(smooth_scale2, D, x1, 1.0))
            backend.launch("add_rms_norm_dynamic_quant2", add_quant2_kernel, x1,
                           [rows(x1), rows(x2), *vectors, vector(beta, D, x1, 0.0)],
                           [y1.view(-1, D), y2.view(-1, D), x_out.view(-1, D), s1.view(-1, 1), s2.view(-1, 1)],
                           scalars, align=32)
        else:
            backend.launch("add_rms_norm_dynamic_quant", add_quant_kernel, x1,
                           [rows(x1), rows(x2), *vectors, vector(beta, D, x1, 0.0)],
                           [y1.view(-1, D), x_out.view(-1, D), s1.view(-1, 1)], scalars, align=32)
    return y1, y2, x_out, s1, s2


def static_rows(scale, offset, D, like):
    """The static scale and offset as [1, D] fp32 kernel inputs: runtime values, one kernel for every scale."""
    zero = torch.zeros(1) if offset is None else offset
    return [t.reshape(1, 1).to(device=like.device, dtype=torch.float32).expand(1, D).contiguous()
            for t in (scale, zero)]


def static_kernel(pypto):
    from . import lib as pl

    def rms_norm_quant(x: pypto.Tensor(), g: pypto.Tensor(), beta: pypto.Tensor(), scale: pypto.Tensor(),
                       offset: pypto.Tensor(), y: pypto.Tensor(), eps, inv_d, rows, cols):
        pypto.set_vec_tile_shapes(rows, cols)
        y[:] = pl.quantise_static(pl.quant_input(x, g, beta, eps, inv_d), scale, offset)
    return rms_norm_quant


def add_static_kernel(pypto):
    from . import lib as pl

    def add_rms_norm_quant(x1: pypto.Tensor(), x2: pypto.Tensor(), g: pypto.Tensor(), beta: pypto.Tensor(),
                           scale: pypto.Tensor(), offset: pypto.Tensor(), y: pypto.Tensor(), x_out: pypto.Tensor(),
                           eps, inv_d, rows, cols):
        pypto.set_vec_tile_shapes(rows, cols)
        s = pypto.add(x1, x2)
        y[:] = pl.quantise_static(pl.quant_input(s, g, beta, eps, inv_d), scale, offset)
        x_out[:] = s
    return add_rms_norm_quant


@RMS_NORM_QUANT.impl("pypto", supports=first_runs_here)
def _(backend, x, gamma, scale, offset, beta, eps):
    y = RMS_NORM_QUANT.empty_outputs(x, gamma, scale, offset, beta, eps)
    if x.numel():
        D = x.shape[-1]
        backend.launch("rms_norm_quant", static_kernel, x,
                       [rows(x), vector(gamma, D, x, 1.0), vector(beta, D, x, 0.0), *static_rows(scale, offset, D, x)],
                       [y.view(-1, D)], [float(eps), 1.0 / D], align=32)
    return y


@ADD_RMS_NORM_QUANT.impl("pypto", supports=first_runs_here)
def _(backend, x1, x2, gamma, scale, offset, beta, eps):
    y, x_out = ADD_RMS_NORM_QUANT.empty_outputs(x1, x2, gamma, scale, offset, beta, eps)
    if x1.numel():
        D = x1.shape[-1]
        backend.launch("add_rms_norm_quant", add_static_kernel, x1,
                       [rows(x1), rows(x2), vector(gamma, D, x1, 1.0), vector(beta, D, x1, 0.0),
                        *static_rows(scale, offset, D, x1)],
                       [y.view(-1, D), x_out.view(-1, D)], [float(eps), 1.0 / D], align=32)
    return y, x_out
