"""add_layer_norm on the pypto backend: the rounded sum x1 + x2 (the next residual, an output), then layer_norm.py's
row statistics in fp32 on it, rounded once."""
from ...ops.defs.add_layer_norm import ADD_LAYER_NORM
from .backend import first_runs_here, rows, vector


def add_layer_norm_kernel(pypto):
    from . import lib as pl

    def add_layer_norm(x1: pypto.Tensor(), x2: pypto.Tensor(), g: pypto.Tensor(), b: pypto.Tensor(),
                       out: pypto.Tensor(), x_out: pypto.Tensor(), eps, inv_d, rows, cols):
        pypto.set_vec_tile_shapes(rows, cols)
        s = pypto.add(x1, x2)  # in the inputs' dtype: torch's rounded add
        sf = pl.f32(s)
        centred = sf - pypto.sum(sf, -1, keepdim=True) * inv_d
        var = pypto.sum(centred * centred, -1, keepdim=True) * inv_d
        out[:] = pl.to(centred * pypto.rsqrt(var + eps) * pl.f32(g) + pl.f32(b), out.dtype)
        x_out[:] = s
    return add_layer_norm


@ADD_LAYER_NORM.impl("pypto", supports=first_runs_here)
def _(backend, x1, x2, gamma, beta, eps):
    y, x_out = ADD_LAYER_NORM.empty_outputs(x1, x2, gamma, beta, eps)
    if x1.numel():
        D = x1.shape[-1]
        backend.launch("add_layer_norm", add_layer_norm_kernel, x1,
                       [rows(x1), rows(x2), vector(gamma, D, x1, 1.0), vector(beta, D, x1, 0.0)],
                       [y.view(-1, D), x_out.view(-1, D)], [float(eps), 1.0 / D])
    return y, x_out
