"""layer_norm and add_layer_norm on the cpu backend: layer_norm.cpp, one row at a time (add_layer_norm's rounded sum
written first, the row then normalised from L1)."""
from ...ops.defs.add_layer_norm import ADD_LAYER_NORM
from ...ops.defs.layer_norm import LAYER_NORM


@LAYER_NORM.impl("cpu")
def _(backend, x, gamma, beta, eps):
    return backend.ext.layer_norm(x, gamma, beta, eps)


@ADD_LAYER_NORM.impl("cpu")
def _(backend, x1, x2, gamma, beta, eps):
    y, x_out = backend.ext.add_layer_norm(x1, x2, gamma, beta, eps)
    return y, x_out
