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
from ..op import Backward, Op

CAST_MODES = ("hf", "fp32")
MODES = {"hf": 0, "fp32": 1}  # the codes the cpu kernels take for a cast mode


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


SWIGLU = Op(swiglu, [
    Tensor("gate", "*R I", FLOAT_DTYPES),
    Tensor("up", "*R I", None, like="gate"),
    Choice("cast_mode", CAST_MODES, default="hf", kw_only=True),
], [Output("y")], min_dims={"I": 1}, backward=Backward(("gate", "up"), _grads),
    examples=({"R": (2, 5), "I": 64}, {"R": (3,), "I": 3420, "cast_mode": "fp32"}, {"R": (1, 1), "I": 11008},
              {"R": (7,), "I": 33, "dtype": torch.float16}, {"R": (4,), "I": 40, "dtype": torch.float32}))


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
