"""PyPTO JIT kernels for the op family (SPEC 2), one shape-agnostic kernel per op and mode.

Every kernel sees 2-D row tensors [R, D] (the backend flattens leading dims: a 4-D q/k-norm
input would otherwise fail PyPTO's broadcast) and per-channel vectors as [1, D]. Optional vectors
are passed as neutral values (gamma 1, beta 0, smooth 1), which leaves results bit-identical and
keeps one kernel per op. The math is fp32 throughout, as in reference.py; outputs are written
last so no tensor is read after it has been assigned to an output (an fp32 cast is a no-op in
PyPTO, and writing a live tensor to an output can crash it). Quantised values are rounded in
fp32 before the integer cast (via fp16, exact for |q| <= 128).
"""
import pypto

FP32 = pypto.DT_FP32


def _f32(t):
    return pypto.cast(t, FP32)


def _to(t, dtype):
    return t if dtype == FP32 else pypto.cast(t, dtype)


def _inv_rms(xf, eps, inv_d):
    return pypto.rsqrt(pypto.sum(xf * xf * inv_d, -1, keepdim=True) + eps)


def _norm_hf(x, g, out, eps, inv_d):
    """y = g * T(x * rsqrt(mean(x^2) + eps)); T = x's dtype, product in out's dtype (HF)."""
    xf = _f32(x)
    n = xf * _inv_rms(xf, eps, inv_d)
    nc = _f32(pypto.cast(n, x.dtype)) if x.dtype != FP32 else n
    return _to(nc * _f32(g), out.dtype)


def _norm_fp32(x, g, out, eps, inv_d):
    xf = _f32(x)
    return _to(xf * _inv_rms(xf, eps, inv_d) * _f32(g), out.dtype)


def _norm(x, g, out, eps, inv_d, hf):
    """The cast mode is a compile-time constant: the branch is taken while tracing, not in the kernel."""
    return _norm_hf(x, g, out, eps, inv_d) if hf else _norm_fp32(x, g, out, eps, inv_d)


def _quantise(n, qmax, qmin, y, scale):
    """Per-row scale = max|n| / qmax (0 for a zero row); y = clip(round(n / scale))."""
    s = pypto.amax(pypto.abs(n), -1, keepdim=True) * (1.0 / qmax)
    safe = pypto.where(pypto.eq(s, 0.0), 1.0, s)
    q = pypto.clip(pypto.round(n / safe), qmin, qmax)
    y[:] = pypto.cast(pypto.cast(q, pypto.DT_FP16), pypto.DT_INT8)
    scale[:] = s


def _quant_input(x, g, beta, eps, inv_d):
    xf = _f32(x)
    rms = pypto.sqrt(pypto.sum(xf * xf * inv_d, -1, keepdim=True) + eps)
    return xf / rms * _f32(g) + _f32(beta)


def make_kernels(run_mode):
    """The kernels for one run mode (RunMode.NPU for NPU tensors, SIM + pass-verify for CPU)."""
    opts = {"runtime_options": {"run_mode": run_mode}}
    if run_mode == pypto.RunMode.SIM:
        opts["verify_options"] = {"enable_pass_verify": True, "pass_verify_pass_filter": []}
    jit = pypto.frontend.jit(**opts)

    @jit
    def rms_norm(x: pypto.Tensor(), g: pypto.Tensor(), out: pypto.Tensor(), eps, inv_d, hf, rows, cols):
        pypto.set_vec_tile_shapes(rows, cols)
        out[:] = _norm(x, g, out, eps, inv_d, hf)

    @jit
    def add_rms_norm(x1: pypto.Tensor(), x2: pypto.Tensor(), g: pypto.Tensor(), out: pypto.Tensor(),
                     x_out: pypto.Tensor(), eps, inv_d, hf, rows, cols):
        pypto.set_vec_tile_shapes(rows, cols)
        s = pypto.add(x1, x2)
        out[:] = _norm(s, g, out, eps, inv_d, hf)
        x_out[:] = s

    @jit
    def residual_add(x1: pypto.Tensor(), x2: pypto.Tensor(), out: pypto.Tensor(), rows, cols):
        """Not an op of the family: the unfused baseline the benchmark compares add_rms_norm with."""
        pypto.set_vec_tile_shapes(rows, cols)
        out[:] = pypto.add(x1, x2)

    @jit
    def rms_norm_dynamic_quant(x: pypto.Tensor(), g: pypto.Tensor(), smooth: pypto.Tensor(), beta: pypto.Tensor(),
                               y: pypto.Tensor(), scale: pypto.Tensor(), eps, inv_d, qmax, qmin, rows, cols):
        pypto.set_vec_tile_shapes(rows, cols)
        _quantise(_quant_input(x, g, beta, eps, inv_d) * _f32(smooth), qmax, qmin, y, scale)

    @jit
    def add_rms_norm_dynamic_quant(x1: pypto.Tensor(), x2: pypto.Tensor(), g: pypto.Tensor(), smooth: pypto.Tensor(),
                                   beta: pypto.Tensor(), y: pypto.Tensor(), x_out: pypto.Tensor(),
                                   scale: pypto.Tensor(), eps, inv_d, qmax, qmin, rows, cols):
        pypto.set_vec_tile_shapes(rows, cols)
        s = pypto.add(x1, x2)
        _quantise(_quant_input(s, g, beta, eps, inv_d) * _f32(smooth), qmax, qmin, y, scale)
        x_out[:] = s

    @jit
    def add_rms_norm_dynamic_quant2(x1: pypto.Tensor(), x2: pypto.Tensor(), g: pypto.Tensor(),
                                    smooth1: pypto.Tensor(), smooth2: pypto.Tensor(), beta: pypto.Tensor(),
                                    y1: pypto.Tensor(), y2: pypto.Tensor(), x_out: pypto.Tensor(),
                                    scale1: pypto.Tensor(), scale2: pypto.Tensor(), eps, inv_d, qmax, qmin, rows,
                                    cols):
        pypto.set_vec_tile_shapes(rows, cols)
        s = pypto.add(x1, x2)
        n = _quant_input(s, g, beta, eps, inv_d)
        _quantise(n * _f32(smooth1), qmax, qmin, y1, scale1)
        _quantise(n * _f32(smooth2), qmax, qmin, y2, scale2)
        x_out[:] = s

    return {f.__name__ if hasattr(f, "__name__") else name: f for name, f in locals().items()
            if name not in ("opts", "jit", "run_mode")}
