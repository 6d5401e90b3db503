"""rms_norm and add_rms_norm on the cpu backend: the fused C++ of rms_norm.cpp, one pass per row."""
from ...ops.defs.rms_norm import ADD_RMS_NORM, MODES, RMS_NORM, gamma_not_float


@RMS_NORM.impl("cpu", supports=lambda backend, x, gamma, *rest: gamma_not_float(gamma))
def _(backend, x, gamma, eps, cast_mode):
    return backend.ext.rms_norm(x, gamma, eps, MODES[cast_mode])


@ADD_RMS_NORM.impl("cpu", supports=lambda backend, x1, x2, gamma, *rest: gamma_not_float(gamma))
def _(backend, x1, x2, gamma, eps, cast_mode, norm_input):
    return backend.ext.add_rms_norm(x1, x2, gamma, eps, MODES[cast_mode], norm_input == "fp32_sum")
