"""rms_norm and add_rms_norm on the pypto backend: one shape-agnostic JIT kernel per op (the norm itself in lib.norm)."""
from ...ops.defs.rms_norm import ADD_RMS_NORM, MODES, RMS_NORM, gamma_not_float
from .backend import rows, vector


def rms_norm_kernel(pypto):
    from . import lib as pl

    def rms_norm(x: pypto.Tensor(), g: pypto.Tensor(), out: pypto.Tensor(), eps, inv_d, mode, rows, cols):
        pypto.set_vec_tile_shapes(rows, cols)
        out[:] = pl.norm(x, g, out.dtype, eps, inv_d, mode, x.dtype)
    return rms_norm


def add_rms_norm_kernel(pypto):
    from . import lib as pl

    def add_rms_norm(x1: pypto.Tensor(), x2: pypto.Tensor(), g: pypto.Tensor(), out: pypto.Tensor(),
                     x_out: pypto.Tensor(), eps, inv_d, mode, fp32_sum, rows, cols):
        pypto.set_vec_tile_shapes(rows, cols)
        if fp32_sum == 1:  # the norm reads the fp32 sum, the residual is its rounding (vLLM's)
            s = pypto.add(pl.f32(x1), pl.f32(x2))
            y = pl.norm(s, g, out.dtype, eps, inv_d, mode, x1.dtype)
            out[:] = y
            x_out[:] = pl.to(s, x1.dtype)
        else:
            s = pypto.add(x1, x2)
            y = pl.norm(s, g, out.dtype, eps, inv_d, mode, x1.dtype)
            out[:] = y
            x_out[:] = s
    return add_rms_norm


def _pypto_gamma(gamma, x, cast_mode):
    g = vector(gamma, x.shape[-1], x, 1.0)
    return g.to(x.dtype) if cast_mode == "none" else g  # no-cast: everything in x's dtype


@RMS_NORM.impl("pypto", supports=lambda backend, x, gamma, *rest: backend.runs_on(x) or gamma_not_float(gamma))
def _(backend, x, gamma, eps, cast_mode):
    y = RMS_NORM.empty_outputs(x, gamma, eps, cast_mode)
    if x.numel():
        D = x.shape[-1]
        backend.launch("rms_norm", rms_norm_kernel, x, [rows(x), _pypto_gamma(gamma, x, cast_mode)],
                       [y.view(-1, D)], [float(eps), 1.0 / D, MODES[cast_mode]])
    return y


@ADD_RMS_NORM.impl("pypto", supports=lambda backend, x1, x2, gamma, *rest: backend.runs_on(x1) or gamma_not_float(gamma))
def _(backend, x1, x2, gamma, eps, cast_mode, norm_input):
    y, x_out = ADD_RMS_NORM.empty_outputs(x1, x2, gamma, eps, cast_mode, norm_input)
    if x1.numel():
        D = x1.shape[-1]
        backend.launch("add_rms_norm", add_rms_norm_kernel, x1,
                       [rows(x1), rows(x2), _pypto_gamma(gamma, x1, cast_mode)], [y.view(-1, D), x_out.view(-1, D)],
                       [float(eps), 1.0 / D, MODES[cast_mode], int(norm_input == "fp32_sum")])
    return y, x_out

