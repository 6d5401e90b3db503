"""pypto-gym's ops as vLLM's own: IR op providers and out-of-tree custom ops, each taking exactly vLLM's semantics.

What is replaced, and which of pypto-gym's cast modes is bit-identical to vLLM's reference (tests/test_vllm.py
proves each against vLLM's own code in its venv):
- `vllm.ir.ops.rms_norm` -> `rms_norm`, cast mode `hf`: vLLM rounds the normalised fp32 x to the weight's dtype
  and multiplies there (`x.to(weight.dtype) * weight`), which for a weight of x's dtype is HF's two roundings.
- `vllm.ir.ops.fused_add_rms_norm` -> `add_rms_norm`, cast mode `hf`: vLLM adds in fp32 and rounds the residual
  once (torch's own add of two 16-bit tensors rounds the same fp32 sum), but normalises the *unrounded* fp32 sum;
  `add_rms_norm` normalises the rounded residual (SPEC 2.2). They agree exactly where the sum is exact in the
  model dtype (fp32 models), and within an ulp elsewhere: 16-bit calls are declined with that reason, so what
  vLLM serves stays bit-identical to its native path.
- `SiluAndMul` -> `swiglu` on the two halves of x (views, no copy), cast mode `hf`: `F.silu(x[:d]) * x[d:]`.
- `RotaryEmbedding` -> `rope`, cast mode `hf` (vLLM rounds every product in the model dtype, the half rotation
  `x1*cos - x2*sin, x2*cos + x1*sin` is HF's `x*cos + rotate_half(x)*sin` term by term): cos/sin gathered from
  `cos_sin_cache` by `positions`, q and k in one call, a partial `rotary_dim`, written back into query and key
  in place as vLLM's CPU kernel does. GPT-J's interleaved rotation is declined (not a layout the op has).
- `MRotaryEmbedding` -> `rope` with Qwen2.5-VL's `mrope_section` (positions [3, T]); interleaved sections are
  declined.

Declined calls go to vLLM's native code (IR ops: `supports_args`; custom ops: the parent's forward), counted
per op with the reason; in strict mode (PYPTO_GYM_STRICT=1) a declined call raises. The backend follows
`patch_model`'s rule (PYPTO_GYM_BACKEND, else auto: cpu for CPU tensors, npu with torch_npu).
"""
from __future__ import annotations

import torch

from .. import config, ops
from ..ops import registry
from ..ops.dispatch import BackendFallbackError, Stats

OP_NAMES = ("rms_norm", "fused_add_rms_norm", "SiluAndMul", "RotaryEmbedding", "MRotaryEmbedding")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


class Counters:
    """Per vLLM op: pypto-gym's Stats (results per backend, fallbacks inside pypto-gym) and the calls declined to
    vLLM's native code, by reason."""

    def __init__(self):
        self.stats = {name: Stats(site=f"vllm.{name}") for name in OP_NAMES}
        self.declined = {name: {} for name in OP_NAMES}

    def decline(self, op: str, reason: str) -> None:
        if config.is_strict():
            raise BackendFallbackError(f"pypto-gym in vLLM: {op}: {reason}; would run vLLM's native code (strict "
                                       f"mode)")
        self.declined[op][reason] = self.declined[op].get(reason, 0) + 1

    def to_json(self) -> dict:
        return {name: {"calls": self.stats[name].calls, "ran_on": dict(self.stats[name].ran),
                       "fallbacks": dict(self.stats[name].fallbacks), "declined": dict(self.declined[name])}
                for name in OP_NAMES}


COUNTERS = Counters()
BACKEND = registry.default_backend()  # $PYPTO_GYM_BACKEND, read once in this process


def _norm_reason(x, weight, variance_size) -> str | None:
    if x.dtype not in _FLOATS:
        return f"x dtype {x.dtype} is not float16, bfloat16 or float32"
    if variance_size is not None:
        return "variance_size (a variance over part of the row) is not an argument rms_norm has"
    if weight is not None and weight.dtype != x.dtype:
        return f"weight {weight.dtype} with x {x.dtype}: vLLM rounds to the weight's dtype, the op to x's"
    return None


# ---- IR op providers --------------------------------------------------------------------------------------
def rms_norm_supports(x: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
                      variance_size: int | None = None) -> bool:
    reason = _norm_reason(x, weight, variance_size)
    if reason:
        COUNTERS.decline("rms_norm", reason)
    return reason is None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
             variance_size: int | None = None) -> torch.Tensor:
    return ops.rms_norm(x, weight, epsilon, cast_mode="hf", backend=BACKEND, stats=COUNTERS.stats["rms_norm"])


def fused_add_rms_norm_supports(x: torch.Tensor, x_residual: torch.Tensor, weight: torch.Tensor | None,
                                epsilon: float, variance_size: int | None = None) -> bool:
    reason = _norm_reason(x, weight, variance_size)
    if reason is None and x.dtype != torch.float32:
        reason = (f"{str(x.dtype).replace('torch.', '')}: vLLM normalises the unrounded fp32 sum, add_rms_norm the "
                  f"rounded residual (equal in fp32, an ulp apart in 16-bit dtypes)")
    if reason is None and (x_residual.dtype != x.dtype or x_residual.shape != x.shape):
        reason = "x_residual of another dtype or shape than x"
    if reason:
        COUNTERS.decline("fused_add_rms_norm", reason)
    return reason is None


def fused_add_rms_norm(x: torch.Tensor, x_residual: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
                       variance_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    gamma = weight if weight is not None else torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    return ops.add_rms_norm(x, x_residual, gamma, epsilon, cast_mode="hf", backend=BACKEND,
                            stats=COUNTERS.stats["fused_add_rms_norm"])


def install_ir_providers() -> list[str]:
    """Register the two norm providers with vLLM's IR ops; returns the op names."""
    from vllm.ir import ops as ir_ops

    ir_ops.rms_norm.register_impl("pypto_gym", supports_args=rms_norm_supports)(rms_norm)
    ir_ops.fused_add_rms_norm.register_impl("pypto_gym", supports_args=fused_add_rms_norm_supports)(
        fused_add_rms_norm)
    return ["rms_norm", "fused_add_rms_norm"]


# ---- out-of-tree custom ops ---------------------------------------------------------------------------------
def _silu_and_mul_class():
    from vllm.model_executor.layers.activation import SiluAndMul

    class PyptoGymSiluAndMul(SiluAndMul):
        """silu(x[..., :d]) * x[..., d:] by pypto-gym's swiglu on the two halves (views of x)."""

        def forward_cpu(self, x):
            return self._fused(x) if self._takes(x) else super().forward_cpu(x)

        def forward_oot(self, x):
            return self._fused(x) if self._takes(x) else super().forward_oot(x)

        @staticmethod
        def _takes(x) -> bool:
            reason = None if x.dtype in _FLOATS else f"x dtype {x.dtype}"
            if reason is None and x.shape[-1] % 2:
                reason = f"odd last dim {x.shape[-1]}"
            if reason:
                COUNTERS.decline("SiluAndMul", reason)
            return reason is None

        @staticmethod
        def _fused(x):
            d = x.shape[-1] // 2
            return ops.swiglu(x[..., :d], x[..., d:], cast_mode="hf", backend=BACKEND,
                              stats=COUNTERS.stats["SiluAndMul"])

    return PyptoGymSiluAndMul


def _rope_reason(layer, query, key, positions) -> str | None:
    if not layer.is_neox_style:
        return "GPT-J interleaved rotation: not a layout the rope op has (half rotation only)"
    if key is None:
        return "no key (cross-layer KV sharing)"
    if query.dtype not in _FLOATS or key.dtype != query.dtype:
        return f"query {query.dtype} / key {key.dtype}"
    if layer.rotary_dim % 2:
        return f"odd rotary_dim {layer.rotary_dim}"
    return None


def _rotate_in_place(layer, positions, query, key, op_name, section=()):
    """q and k rotated by `rope` (hf mode) with cos/sin gathered by positions, written back in place."""
    cache = layer._match_cos_sin_cache_dtype(query)
    cos_sin = cache[positions]  # [T, rot] or [3, T, rot]
    cos, sin = cos_sin.chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)  # neox: both halves share an angle
    T = positions.shape[-1]
    q = query.view(T, -1, layer.head_size)
    k = key.view(T, -1, layer.head_size)
    if section:
        q_embed, k_embed = ops.rope(q, k, cos, sin, list(section), unsqueeze_dim=-2, cast_mode="hf",
                                    backend=BACKEND, stats=COUNTERS.stats[op_name])
    else:
        q_embed, k_embed = ops.rope(q, k, cos, sin, unsqueeze_dim=-2, cast_mode="hf", backend=BACKEND,
                                    stats=COUNTERS.stats[op_name])
    q.copy_(q_embed)
    k.copy_(k_embed)
    return query, key


def _rotary_class():
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    class PyptoGymRotaryEmbedding(RotaryEmbedding):
        """vLLM's rotary embedding by pypto-gym's rope: q and k in one call, in place."""

        def forward_cpu(self, positions, query, key=None):
            return self._run(positions, query, key, super().forward_cpu)

        def forward_oot(self, positions, query, key=None):
            return self._run(positions, query, key, super().forward_oot)

        def _run(self, positions, query, key, native):
            reason = _rope_reason(self, query, key, positions)
            if reason is None:
                return _rotate_in_place(self, positions.flatten(), query, key, "RotaryEmbedding")
            COUNTERS.decline("RotaryEmbedding", reason)
            return native(positions, query, key)

    return PyptoGymRotaryEmbedding


def _mrotary_class():
    from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding

    class PyptoGymMRotaryEmbedding(MRotaryEmbedding):
        """Qwen2.5-VL's multimodal rotary embedding by pypto-gym's rope with its mrope sections."""

        def forward_cpu(self, positions, query, key=None, offsets=None):
            return self._run(positions, query, key, offsets, super().forward_cpu)

        def forward_oot(self, positions, query, key=None, offsets=None):
            return self._run(positions, query, key, offsets, super().forward_oot)

        def _run(self, positions, query, key, offsets, native):
            reason = _rope_reason(self, query, key, positions)
            if reason is None and offsets is not None:
                reason = "per-token position offsets"
            if reason is None and positions.ndim == 2 and self.mrope_interleaved:
                reason = "interleaved mrope sections"
            if reason is None:
                section = self.mrope_section if positions.ndim == 2 else ()
                return _rotate_in_place(self, positions, query, key, "MRotaryEmbedding", section)
            COUNTERS.decline("MRotaryEmbedding", reason)
            return native(positions, query, key, offsets)

    return PyptoGymMRotaryEmbedding


def install_custom_ops() -> list[str]:
    """Register the out-of-tree custom ops (vLLM builds its layers with them from now on); returns their names."""
    from vllm.model_executor.custom_op import CustomOp

    classes = {"SiluAndMul": _silu_and_mul_class(), "RotaryEmbedding": _rotary_class(),
               "MRotaryEmbedding": _mrotary_class()}
    for name, cls in classes.items():
        CustomOp.register_oot(name=name)(cls)
    return list(classes)
