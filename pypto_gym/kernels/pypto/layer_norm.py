"""layer_norm on the pypto backend: one kernel, the row's mean and biased variance in fp32, rounded once to x's
dtype (torch's arithmetic for a 16-bit row, in the vector unit's order). An absent gamma or beta is its neutral
vector (1, 0): bit-identical results, one kernel."""
from ...ops.defs.layer_norm import LAYER_NORM
from .backend import first_runs_here, rows, vector


def layer_norm_kernel(pypto):
    from . import lib as pl

    def layer_norm(x: pypto.Tensor(), g: pypto.Tensor(), b: pypto.Tensor(), out: pypto.Tensor(), eps, inv_d, rows,
                   cols):
        pypto.set_vec_tile_shapes(rows, cols)
        xf = pl.f32(x)
        centred = xf - pypto.sum(xf, -1, keepdim=True) * inv_d
        var = pypto.sum(centred * centred, -1, keepdim=True) * inv_d
        out[:] = pl.to(centred * pypto.rsqrt(var + eps) * pl.f32(g) + pl.f32(b), out.dtype)
    return layer_norm


@LAYER_NORM.impl("pypto", supports=first_runs_here)
def _(backend, x, gamma, beta, eps):
    y = LAYER_NORM.empty_outputs(x, gamma, beta, eps)
    if x.numel():
        D = x.shape[-1]
        backend.launch("layer_norm", layer_norm_kernel, x, [rows(x), vector(gamma, D, x, 1.0), vector(beta, D, x, 0.0)],
                       [y.view(-1, D)], [float(eps), 1.0 / D])
    return y
