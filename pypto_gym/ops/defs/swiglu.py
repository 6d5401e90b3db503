"""swiglu (SPEC 10): y = silu(gate) * up, the middle of every SwiGLU MLP (down_proj(act(gate_proj(x)) * up_proj(x))),
and silu_and_mul, the same on the two halves of one merged tensor.

- `hf` (default): rounds exactly as HF eager does, `F.silu(gate) * up`: silu's result rounded to the
  input dtype, then the product rounded. Bit-identical to HF on the `torch` backend, and to vLLM's
  `SiluAndMul.forward_native` (`F.silu(x[..., :d]) * x[..., d:]`: the same two roundings).
- `fp32`: silu(f32(gate)) * f32(up) in fp32, rounded once (torch_npu's npu_swiglu).

gate and up are two tensors of one shape [..., I], not one merged [..., 2I]: that is what HF's MLPs
produce (separate gate_proj and up_proj), so no backend needs a copy to call it; the two halves of a
merged gate_up GEMM are two views, which the kernels take as they are (and the npu mapping passes to
npu_swiglu as the one tensor they view, gate first: vLLM's and npu_swiglu's order).

`silu_and_mul(x)` = swiglu(x[..., :I], x[..., I:]) for x [..., 2I]: the form vLLM's `SiluAndMul` and torch_npu's
`npu_swiglu` take, for a caller that holds the merged gate_up output. It is an op of its own, not swiglu with one
argument, because making the two views is the caller's cost otherwise: in vLLM's plugin two Python slices took
2.5 µs, more than a toy model's whole activation; the kernel makes them in C++.
"""
import torch
import torch.nn.functional as F

from ..args import FLOAT_DTYPES, ArgValueError, Choice, Output, Tensor
from ..backends.pypto_backend import Tiles, UB_BYTES, rows
from ..op import Backward, BenchSpec, Op

CAST_MODES = ("hf", "fp32")
MODES = {"hf": 0, "fp32": 1}


def swiglu(gate, up, cast_mode="hf"):
    """silu(gate) * up; `hf` rounds silu's result to the input dtype first (HF's act_fn(gate) * up), `fp32` once."""
    if cast_mode == "hf":
        return F.silu(gate) * up
    g = gate.to(torch.float32)
    return (F.silu(g) * up.to(torch.float32)).to(gate.dtype)


def _grads(saved, grads):
    """d/dgate = gy * up * silu'(gate), d/dup = gy * silu(gate); silu'(g) = s(g) * (1 + g * (1 - s(g)))."""
    gy = grads[0].float()
    g, u = saved["gate"].float(), saved["up"].float()
    sig = torch.sigmoid(g)
    return {"gate": (gy * u * sig * (1 + g * (1 - sig))).to(saved["gate"].dtype),
            "up": (gy * g * sig).to(saved["up"].dtype)}


def _bench_shapes(quick, dtype):
    """GutenOCR-3B's intermediates: text 11008 wide (decode, prefill), vision 3420 wide."""
    shapes = [("decode", (1, 1, 11008)), ("prefill", (1, 512, 11008))]
    shapes += [] if quick else [("prefill", (1, 4096, 11008))]
    shapes += [("vision", (3744, 3420))]
    gen = torch.Generator().manual_seed(0)
    return [(phase, shape[-2], ((torch.randn(shape, generator=gen) * 2).to(dtype),
                                torch.randn(shape, generator=gen).to(dtype), "hf")) for phase, shape in shapes]


def _hf_kernels(args):
    """HF's MLP middle: act_fn(gate), then * up, each over the whole intermediate."""
    gate, up = (a.reshape(-1, a.shape[-1]) for a in args[:2])
    return [("act_fn(gate)", "silu", [gate], gate.shape, gate.dtype, ()), ("* up", "mul", [gate, up], gate.shape,
                                                                           gate.dtype, ())]


SWIGLU = Op(swiglu, [
    Tensor("gate", "*R I", FLOAT_DTYPES),
    Tensor("up", "*R I", None, like="gate"),
    Choice("cast_mode", CAST_MODES, default="hf", kw_only=True),
], [Output("y")], min_dims={"I": 1}, backward=Backward(("gate", "up"), _grads),
    examples=({"R": (2, 5), "I": 64}, {"R": (3,), "I": 3420, "cast_mode": "fp32"}, {"R": (1, 1), "I": 11008},
              {"R": (7,), "I": 33, "dtype": torch.float16}, {"R": (4,), "I": 40, "dtype": torch.float32}),
    bench=BenchSpec(_bench_shapes, lambda a: (lambda: F.silu(a[0]) * a[1]), lambda a: (lambda: torch.add(a[0], a[1])),
                    "torch.add(gate, up)", {"vs_hf": 2.0, "vs_compile": 1.2, "floor": 1.3, "min_tokens": 512},
                    hf_kernels=_hf_kernels))


@SWIGLU.impl("cpu")
def _(backend, gate, up, cast_mode):
    return backend.ext.swiglu(gate, up, MODES[cast_mode])


# npu_swiglu(input, dim=-1) -> swish(A) * B for A, B the halves of input along dim: 1-8 dims, not empty,
# fp32/fp16/bf16, Atlas A2/A3. It computes in fp32 and rounds once (our fp32 mode; in hf mode it differs
# from HF's two roundings by at most an ulp). Two views of one merged tensor are passed as that tensor;
# separate gate and up are concatenated first (one copy).
def _npu_supports(backend, gate, up, cast_mode):
    if not 1 <= gate.dim() <= 8:
        return f"npu_swiglu: rank {gate.dim()} not in 1-8"
    if not gate.numel():
        return "npu_swiglu: empty tensors are not supported"
    if backend.series_of(gate) != "a2_a3":
        return "npu_swiglu: supported on Atlas A2/A3 chips only"
    return None


def merged_halves(gate, up):
    """The [..., 2I] tensor whose two halves gate and up are (views of one contiguous buffer), else None."""
    shape = (*gate.shape[:-1], 2 * gate.shape[-1])
    strides = [1]
    for d in reversed(shape[1:]):
        strides.insert(0, strides[0] * d)
    if (gate.stride() != tuple(strides) or up.stride() != gate.stride()
            or up.data_ptr() != gate.data_ptr() + gate.shape[-1] * gate.element_size()):
        return None
    return gate.as_strided(shape, strides)


@SWIGLU.impl("npu", supports=_npu_supports)
def _(backend, gate, up, cast_mode):
    merged = merged_halves(gate, up)
    if merged is None:
        merged = torch.cat([gate, up], dim=-1)
    return backend.torch_npu().npu_swiglu(merged, dim=-1)


# ---- pypto: gate * sigmoid(gate) * up (PyPTO 0.2.0 has sigmoid, not silu). Tiles hold whole rows: a tile
# that cuts a row gives results PyPTO's own compiled-level check rejects (every split of [64, 11008] and of
# [256, 3420] tried), so rows wider than the unified buffer holds are not taken.
LIVE_FP32 = 4  # gate, its sigmoid, their product, up


def swiglu_tiles(R: int, I: int) -> Tiles | None:
    """Whole rows, as many as fit the unified buffer (up to 4); None when one row does not fit."""
    cols = -(-I // 16) * 16
    per_row = 4 * LIVE_FP32 * cols
    if per_row > UB_BYTES:
        return None
    rows_ = 1
    while rows_ < 4 and rows_ < R and 2 * rows_ * per_row <= UB_BYTES:
        rows_ *= 2
    return Tiles(rows_, cols)


def _pypto_supports(backend, gate, *rest):
    if swiglu_tiles(1, gate.shape[-1]) is None:
        return f"a row of {gate.shape[-1]} does not fit PyPTO's unified buffer (whole-row tiles only)"
    return backend.runs_on(gate)


def swiglu_kernel(pypto):
    from ..backends import pypto_lib as pl

    def swiglu(gate: pypto.Tensor(), up: pypto.Tensor(), out: pypto.Tensor(), hf, rows, cols):
        pypto.set_vec_tile_shapes(rows, cols)
        g = pl.f32(gate)
        s = g * pypto.sigmoid(g)
        if hf == 1 and gate.dtype != pl.FP32:  # HF rounds silu's result to the input dtype before the multiply
            s = pl.f32(pypto.cast(s, gate.dtype))
        out[:] = pl.to(s * pl.f32(up), out.dtype)
    return swiglu


@SWIGLU.impl("pypto", supports=_pypto_supports)
def _(backend, gate, up, cast_mode):
    y = SWIGLU.empty_outputs(gate, up, cast_mode)
    if gate.numel():
        I = gate.shape[-1]
        backend.launch("swiglu", swiglu_kernel, gate, [rows(gate), rows(up)], [y.view(-1, I)],
                       [int(cast_mode == "hf")], tiles=swiglu_tiles(gate.numel() // I, I))
    return y



# ---- silu_and_mul: the merged form ---------------------------------------------------------------------------
def silu_and_mul(x, cast_mode="hf"):
    """silu(x[..., :I]) * x[..., I:] for x [..., 2I] (vLLM's SiluAndMul, torch_npu's npu_swiglu); cast modes as
    swiglu's."""
    gate, up = x.chunk(2, dim=-1)
    return swiglu(gate, up, cast_mode)


def _even(ctx, x, cast_mode):
    if x.shape[-1] % 2:
        raise ArgValueError("x", f"last dim {x.shape[-1]} is odd; expected [..., 2I]: gate and up halves")


def _merged_grads(saved, grads):
    gate, up = saved["x"].chunk(2, dim=-1)
    got = _grads({"gate": gate, "up": up}, grads)
    return {"x": torch.cat((got["gate"], got["up"]), dim=-1)}


SILU_AND_MUL = Op(silu_and_mul, [
    Tensor("x", "*R I"),
    Choice("cast_mode", CAST_MODES, default="hf", kw_only=True),
], [Output("y")], check=_even, min_dims={"I": 2}, backward=Backward(("x",), _merged_grads),
    examples=({"R": (2, 5), "I": 128}, {"R": (1,), "I": 512}, {"R": (3,), "I": 2 * 3420, "cast_mode": "fp32"},
              {"R": (7,), "I": 66, "dtype": torch.float16}, {"R": (4,), "I": 80, "dtype": torch.float32}))


@SILU_AND_MUL.impl("cpu")
def _(backend, x, cast_mode):
    return backend.ext.silu_and_mul(x, MODES[cast_mode])


@SILU_AND_MUL.impl("npu", supports=lambda backend, x, cast_mode: _npu_supports(backend, x, x, cast_mode))
def _(backend, x, cast_mode):
    return backend.torch_npu().npu_swiglu(x, dim=-1)


@SILU_AND_MUL.impl("pypto", supports=lambda backend, x, cast_mode: _pypto_supports(backend, x.chunk(2, dim=-1)[0]))
def _(backend, x, cast_mode):
    return SWIGLU.impls["pypto"].fn(backend, *x.chunk(2, dim=-1), cast_mode)
