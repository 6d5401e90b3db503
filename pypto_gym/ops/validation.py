"""Input checks of SPEC 2.5, done once before dispatch so every backend sees the same contract.

Every refusal names the argument, what was seen and what was expected.
"""
from __future__ import annotations

import math

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CAST_MODES = ("hf", "fp32", "none")
DST_TYPES = ("int8", "int4")
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _same_device(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.is_cpu and b.is_cpu) or a.device == b.device  # two CPU tensors: no device objects built


def _check_x(name: str, x) -> int:
    if type(x) in _PLAIN and x.dtype in FLOAT_DTYPES and x.dim():  # the common case, cheaply
        D = x.shape[-1]
        if D:
            return D
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: dtype {_name(x.dtype)} not supported; expected float16, bfloat16 or float32")
    if x.dim() == 0:
        raise ValueError(f"{name}: rank-0 tensor (shape ()); expected shape [..., D] with rank >= 1")
    if x.shape[-1] == 0:
        raise ValueError(f"{name}: last dim D is 0 (shape {tuple(x.shape)}); expected D >= 1")
    return x.shape[-1]


def _check_vector(name: str, t, D: int, x: torch.Tensor, same_dtype: bool) -> None:
    """A per-channel parameter: shape [D] (singleton dims allowed, e.g. (1, D, 1, 1)), on x's device."""
    if t is None:
        return
    if type(t) in _PLAIN and t.dim() == 1 and t.shape[0] == D and _same_device(t, x) and (
            t.dtype is x.dtype or (not same_dtype and t.dtype in FLOAT_DTYPES)):
        return  # the common case, checked cheaply: this runs on every norm call of a model
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(t).__name__}")
    if same_dtype and t.dtype != x.dtype:
        raise TypeError(f"{name}: dtype {_name(t.dtype)} must match x's dtype {_name(x.dtype)}")
    if not same_dtype and not t.is_floating_point():
        raise TypeError(f"{name}: dtype {_name(t.dtype)} not supported; expected a floating dtype")
    non_singleton = [s for s in t.shape if s != 1]
    if t.numel() != D or len(non_singleton) > 1:
        raise ValueError(f"{name}: shape {tuple(t.shape)} does not match x's last dim; expected ({D},)")
    if t.device != x.device:
        raise ValueError(f"{name}: on device {t.device}, expected x's device {x.device}")


def _check_eps(eps, strictly_positive: bool) -> None:
    if type(eps) is float and (0 < eps < math.inf or (eps == 0 and not strictly_positive)):
        return
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps: expected a float, got {type(eps).__name__}")
    expected = "a finite eps > 0" if strictly_positive else "a finite eps >= 0"
    try:
        value = float(eps)
    except OverflowError:
        raise ValueError(f"eps: got an integer with {len(str(abs(eps)))} digits; expected {expected}") from None
    if not math.isfinite(value) or value < 0 or (strictly_positive and value == 0):
        raise ValueError(f"eps: got {eps}; expected {expected}")


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}: got {value!r}; expected one of {', '.join(map(repr, choices))}")


def _check_pair(x1: torch.Tensor, x2) -> None:
    """x2 like x1 (already checked): same shape, dtype and device."""
    if type(x2) in _PLAIN and x2.dtype is x1.dtype and x2.shape == x1.shape and _same_device(x2, x1):
        return
    _check_x("x2", x2)
    if x2.shape != x1.shape:
        raise ValueError(f"x2: shape {tuple(x2.shape)} does not match x1; expected {tuple(x1.shape)}")
    if x2.dtype != x1.dtype:
        raise TypeError(f"x2: dtype {_name(x2.dtype)} must match x1's dtype {_name(x1.dtype)}")
    if x2.device != x1.device:
        raise ValueError(f"x2: on device {x2.device}, expected x1's device {x1.device}")


def _plain_norm_call(x, gamma, eps, cast_mode) -> bool:
    """The common, valid call in one expression (no helper calls: this runs on every norm call of a
    model). False sends the call through the full checks below, which name what is wrong."""
    if not (type(x) in _PLAIN and x.dtype in FLOAT_DTYPES and x.dim() > 0):
        return False
    D = x.shape[-1]  # a torch.Size is built per `.shape`: once
    return (D > 0 and (gamma is None or (type(gamma) in _PLAIN and gamma.dim() == 1 and gamma.numel() == D
                                         and gamma.dtype in FLOAT_DTYPES and _same_device(gamma, x)))
            and type(eps) is float and 0 <= eps < math.inf and cast_mode in CAST_MODES)


def check_rms_norm(x, gamma, eps, cast_mode) -> None:
    if _plain_norm_call(x, gamma, eps, cast_mode):
        return
    D = _check_x("x", x)
    _check_vector("gamma", gamma, D, x, same_dtype=False)
    _check_eps(eps, strictly_positive=False)
    _check_choice("cast_mode", cast_mode, CAST_MODES)


def check_add_rms_norm(x1, x2, gamma, eps, cast_mode) -> None:
    if (_plain_norm_call(x1, gamma, eps, cast_mode) and type(x2) in _PLAIN and x2.dtype is x1.dtype
            and x2.shape == x1.shape and _same_device(x2, x1)):
        return
    D = _check_x("x1", x1)
    _check_pair(x1, x2)
    _check_vector("gamma", gamma, D, x1, same_dtype=False)
    _check_eps(eps, strictly_positive=False)
    _check_choice("cast_mode", cast_mode, CAST_MODES)


def check_quant(x, gamma, smooth_scale1, smooth_scale2, beta, eps, dst_type, x2=None, x_name="x",
                smooth_names=("smooth_scale1", "smooth_scale2")) -> None:
    D = _check_x(x_name, x)
    if x2 is not None:
        _check_pair(x, x2)
    if gamma is None:
        raise ValueError("gamma: got None; the quant ops need a weight of shape (D,)")
    for name, t in (("gamma", gamma), (smooth_names[0], smooth_scale1), (smooth_names[1], smooth_scale2),
                    ("beta", beta)):
        _check_vector(name, t, D, x, same_dtype=True)
    if smooth_scale2 is not None and smooth_scale1 is None:
        raise ValueError("smooth_scale2: given without smooth_scale1; expected smooth_scale1 too (or neither)")
    _check_eps(eps, strictly_positive=True)
    _check_choice("dst_type", dst_type, DST_TYPES)


MAX_QUANT_K = 2 ** 17 - 1  # K * 128 * 128 must fit the int32 accumulator


def check_quant_matmul(x_q, w_q, x_scale, w_scale, bias, out_dtype) -> None:
    for name, t, dtype in (("x_q", x_q, torch.int8), ("w_q", w_q, torch.int8), ("x_scale", x_scale, torch.float32),
                           ("w_scale", w_scale, torch.float32)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dtype:
            raise TypeError(f"{name}: dtype {_name(t.dtype)} not supported; expected {_name(dtype)}")
        if t.device != x_q.device:
            raise ValueError(f"{name}: on device {t.device}, expected x_q's device {x_q.device}")
    if x_q.dim() == 0 or w_q.dim() != 2 or x_q.shape[-1] != w_q.shape[1]:
        raise ValueError(f"w_q: shape {tuple(w_q.shape)} does not fit x_q {tuple(x_q.shape)}; expected (N, "
                         f"{x_q.shape[-1] if x_q.dim() else 'K'})")
    if not 0 < x_q.shape[-1] <= MAX_QUANT_K:
        raise ValueError(f"x_q: last dim K={x_q.shape[-1]}; expected 1 <= K <= {MAX_QUANT_K} (int32 accumulation)")
    if tuple(x_scale.shape) != tuple(x_q.shape[:-1]):
        raise ValueError(f"x_scale: shape {tuple(x_scale.shape)}; expected {tuple(x_q.shape[:-1])} (one per row of x_q)")
    N = w_q.shape[0]
    if tuple(w_scale.shape) != (N,):
        raise ValueError(f"w_scale: shape {tuple(w_scale.shape)}; expected ({N},) (one per output channel)")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dtype not in FLOAT_DTYPES or tuple(bias.shape) != (N,):
            got = f"{_name(bias.dtype)} {tuple(bias.shape)}" if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(f"bias: got {got}; expected None or a float tensor of shape ({N},)")
        if bias.device != x_q.device:
            raise ValueError(f"bias: on device {bias.device}, expected x_q's device {x_q.device}")
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype: got {out_dtype}; expected float16, bfloat16 or float32")
