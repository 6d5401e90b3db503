"""dynamic_quant (SPEC 11): per-token symmetric int8/int4 of a linear's input that no fused op produced.

n = f32(x) * f32(smooth_scales) (SmoothQuant's 1/s for the linear's input channels, optional, any
float dtype: x's for torch_npu's npu_dynamic_quant, fp32 where rows escaped a producer with an fp32
one); (y, scale) = the per-row rule every quantised op shares (ops/quantize.py): scale = row_max|n| /
qmax (fp32, shape x.shape[:-1]), y = clamp(round(n / scale)), half to even. What an int8 o_proj, the
vision attn.proj and the merger's linears run on their float input; no gradient.
"""
import torch

from ..args import Choice, Output, Tensor, dtype_name
from ..backends.npu import as_rows, quant_limits
from ..backends.pypto_backend import first_runs_here, rows, vector
from ..op import Op
from ..quantize import DST_TYPES, QUANT_RANGES, quantize_rows, unpack_int4_from_int32


def dynamic_quant(x, smooth_scales=None, dst_type="int8"):
    """f32(x) * smooth_scales, per-row symmetric int8/int4 -> (y, scale). No gradient."""
    n = x.to(torch.float32)
    if smooth_scales is not None:
        n = n * smooth_scales.reshape(x.shape[-1]).to(torch.float32)
    return quantize_rows(n, dst_type)


DYNAMIC_QUANT = Op(dynamic_quant, [
    Tensor("x", "*R D"),
    Tensor("smooth_scales", "D", None, floats=True, optional=True, flat=True, gen="smooth"),
    Choice("dst_type", DST_TYPES, default="int8", kw_only=True),
], [Output("y", "codes"), Output("scale", "scale")], min_dims={"D": 1},
    examples=({"R": (2, 5), "D": 2048}, {"R": (3,), "D": 1280, "smooth_scales": None},
              {"R": (7,), "D": 40, "dtype": torch.float16, "dst_type": "int4"}, {"R": (4,), "D": 33,
                                                                                  "dtype": torch.float32}))


@DYNAMIC_QUANT.impl("cpu")
def _(backend, x, smooth_scales, dst_type):
    return tuple(backend.ext.dynamic_quant(x, smooth_scales, *QUANT_RANGES[dst_type]))


# npu_dynamic_quant(x, *, smooth_scales, group_index, dst_type) -> (y, scale), Atlas A2/A3: x fp16/bf16, more than one
# dim, smooth_scales of x's dtype [D]; int4 (dst_type=torch.quint4x2) packs eight codes per int32 and needs
# D % 8 == 0; scale = row_max / 127 (or / 7), fp32, x's shape without the last dim: ours.
def _npu_supports(backend, x, smooth_scales, dst_type):
    name = "npu_dynamic_quant"
    if x.dim() < 2:
        return f"{name}: x must have more than one dim, got {x.dim()}"
    reason = quant_limits(name, x, dst_type, backend)
    if reason:
        return reason
    if smooth_scales is not None and smooth_scales.dtype != x.dtype:
        return f"{name}: smooth_scales {dtype_name(smooth_scales.dtype)} with x {dtype_name(x.dtype)} (one dtype)"
    return None


@DYNAMIC_QUANT.impl("npu", supports=_npu_supports)
def _(backend, x, smooth_scales, dst_type):
    smooth = None if smooth_scales is None else smooth_scales.reshape(x.shape[-1])
    y, scale = backend.torch_npu().npu_dynamic_quant(as_rows(x), smooth_scales=smooth,
                                                     dst_type=torch.quint4x2 if dst_type == "int4" else torch.int8)
    if dst_type == "int4":
        y = unpack_int4_from_int32(y)
    return y.reshape(x.shape), scale.reshape(x.shape[:-1])


# ---- pypto: one kernel, whole-row tiles (the row max needs the row) ----------------------------------------
def dynamic_quant_kernel(pypto):
    from ..backends import pypto_lib as pl

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
