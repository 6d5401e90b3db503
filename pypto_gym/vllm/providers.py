"""pypto-gym's ops as vLLM's own: IR op providers and out-of-tree custom ops, each taking exactly vLLM's semantics.

What is replaced, and which of pypto-gym's cast modes is bit-identical to vLLM's reference (tests/test_vllm.py
proves each against vLLM's own code in its venv):
- `vllm.ir.ops.rms_norm` -> `rms_norm`, cast mode `hf`: vLLM rounds the normalised fp32 x to the weight's dtype
  and multiplies there (`x.to(weight.dtype) * weight`), which for a weight of x's dtype is HF's two roundings.
- `vllm.ir.ops.fused_add_rms_norm` -> `add_rms_norm`, cast mode `hf`, `norm_input="fp32_sum"`: vLLM adds in fp32,
  rounds the residual once (torch's own add of two 16-bit tensors rounds the same fp32 sum) and normalises the
  *unrounded* fp32 sum, which is what that norm input reads (HF's layer, the op's default, normalises the
  rounded residual).
- `SiluAndMul` -> `silu_and_mul` (swiglu on the two halves of x, made by the kernel), cast mode `hf`:
  `F.silu(x[:d]) * x[d:]`.
- `RotaryEmbedding` -> `rotary_embedding` (vLLM's own form: cos/sin read from its `cos_sin_cache` at each
  token's position), cast mode `fp32`: what vLLM runs on the CPU is its C++ `rotary_embedding`, which computes in
  fp32 and rounds each output once (bit-identical to the op's fp32 mode; its `forward_native`, the arithmetic of
  its CUDA kernel, rounds every product to the model dtype instead and differs from the CPU op in about a third of
  bf16 outputs). q and k in one call, a partial `rotary_dim`, written over query and key in place, as vLLM's CPU
  kernel does (no gathered table, no new tensors). GPT-J's interleaved rotation is declined (not a layout the op
  has).
- `MRotaryEmbedding` -> `rotary_embedding` with Qwen2.5-VL's `mrope_section` (positions [3, T]), or Qwen3-VL's
  interleaved sections (`mrope_interleaved`: vLLM's `apply_interleaved_rope`), cast mode `hf`: vLLM has no CPU kernel
  for it and runs `forward_native`, which rounds cos/sin and every product to the model dtype.

So each provider computes what vLLM computes without it on the same CPU, bit for bit (in fp32 the C++ rotary
contracts x*cos - y*sin into an FMA, which the op's kernels never do: there the provider is forward_native's
arithmetic, 1 ulp from the C++ op's in some outputs).

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
_bound: dict = {}  # op -> its BoundCall on BACKEND: a provider runs hundreds of times a step


def bound(name: str, op: str, **constants):
    """`op` bound to this process's backend, the vLLM op's counters and its constant arguments, made once: the
    bound fast path costs about a microsecond where the entry point's costs several. (Each call site passes its
    constants in one order, so their values key the cache; a layer keeps its own at construction, which saves
    building the key per call.)"""
    key = (name, op, BACKEND, *constants.values())
    if key not in _bound:
        _bound[key] = ops.OPS[op].bind(BACKEND, COUNTERS.stats[name], **constants)
    return _bound[key]


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
    return bound("rms_norm", "rms_norm", cast_mode="hf")(x, weight, epsilon)


def fused_add_rms_norm_supports(x: torch.Tensor, x_residual: torch.Tensor, weight: torch.Tensor | None,
                                epsilon: float, variance_size: int | None = None) -> bool:
    reason = _norm_reason(x, weight, variance_size)
    if reason is None and (x_residual.dtype != x.dtype or x_residual.shape != x.shape):
        reason = "x_residual of another dtype or shape than x"
    if reason:
        COUNTERS.decline("fused_add_rms_norm", reason)
    return reason is None


def fused_add_rms_norm(x: torch.Tensor, x_residual: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
                       variance_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    gamma = weight if weight is not None else torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    return bound("fused_add_rms_norm", "add_rms_norm", cast_mode="hf", norm_input="fp32_sum")(
        x, x_residual, gamma, epsilon)


def chosen_ops(text: str | None) -> tuple:
    """$PYPTO_GYM_VLLM_OPS parsed: comma-separated names of OP_NAMES (None: all); refused naming the variable."""
    if text is None:
        return OP_NAMES
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in OP_NAMES]
    if unknown or not names:
        raise config.SettingError(f"PYPTO_GYM_VLLM_OPS: got {text!r}; expected comma-separated names of "
                                  f"{', '.join(OP_NAMES)}")
    return names


def install_ir_providers(chosen=OP_NAMES) -> list[str]:
    """Register the chosen norm providers with vLLM's IR ops; returns their names."""
    from vllm.ir import ops as ir_ops

    providers = {"rms_norm": (ir_ops.rms_norm, rms_norm_supports, rms_norm),
                 "fused_add_rms_norm": (ir_ops.fused_add_rms_norm, fused_add_rms_norm_supports, fused_add_rms_norm)}
    for name in chosen:
        if name in providers:
            ir_op, supports, impl = providers[name]
            ir_op.register_impl("pypto_gym", supports_args=supports)(impl)
    return [n for n in providers if n in chosen]


# ---- out-of-tree custom ops ---------------------------------------------------------------------------------
def _silu_and_mul_class():
    from vllm.model_executor.layers.activation import SiluAndMul

    class PyptoGymSiluAndMul(SiluAndMul):
        """silu(x[..., :d]) * x[..., d:] by pypto-gym's silu_and_mul."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.__dict__["_pypto_gym"] = bound("SiluAndMul", "silu_and_mul", cast_mode="hf")  # not a submodule

        def forward_cpu(self, x):
            return self._pypto_gym(x) if self._takes(x) else super().forward_cpu(x)

        def forward_oot(self, x):
            return self._pypto_gym(x) if self._takes(x) else super().forward_oot(x)

        @staticmethod
        def _takes(x) -> bool:
            reason = None if x.dtype in _FLOATS else f"x dtype {x.dtype}"
            if reason is None and x.shape[-1] % 2:
                reason = f"odd last dim {x.shape[-1]}"
            if reason:
                COUNTERS.decline("SiluAndMul", reason)
            return reason is None

    return PyptoGymSiluAndMul


def _layer_reason(layer) -> str | None:
    """Why pypto-gym's rotary op cannot take any call of this layer (its own constants), else None."""
    if not layer.is_neox_style:
        return "GPT-J interleaved rotation: not a layout pypto-gym's rotary ops have (half rotation only)"
    if layer.rotary_dim % 2:
        return f"odd rotary_dim {layer.rotary_dim}"
    return None


def _call_reason(query, key) -> str | None:
    """Why it cannot take this call's q and k."""
    if key is None:
        return "no key (cross-layer KV sharing)"
    if query.dtype not in _FLOATS or key.dtype != query.dtype:
        return f"query {query.dtype} / key {key.dtype}"
    return None


def _rotate_in_place(layer, call, positions, query, key):
    """q and k rotated by the layer's bound `rotary_embedding` from its cache (in the query's dtype, as vLLM
    matches it), written over query and key as vLLM's CPU kernel does. The cache buffer is read from the
    layer's buffers directly when it already matches (vLLM's `_match_cos_sin_cache_dtype` returns it as is
    then, at 1.5 µs a call, through nn.Module's attribute lookup twice); vLLM's method converts it otherwise."""
    cache = layer._buffers["cos_sin_cache"]
    if cache.dtype != query.dtype or cache.device != query.device:
        cache = layer._match_cos_sin_cache_dtype(query)
    return call.into((query, key), positions, query, key, cache)


def _rotary_class():
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    class PyptoGymRotaryEmbedding(RotaryEmbedding):
        """vLLM's rotary embedding by pypto-gym's rotary_embedding in fp32 mode (vLLM's CPU op's arithmetic): q
        and k in one call, in place."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.__dict__["_pypto_gym"] = (_layer_reason(self), bound(
                "RotaryEmbedding", "rotary_embedding", head_size=self.head_size, mrope_section=(), cast_mode="fp32",
                mrope_interleaved=False))

        def forward_cpu(self, positions, query, key=None):
            return self._run(positions, query, key, super().forward_cpu)

        def forward_oot(self, positions, query, key=None):
            return self._run(positions, query, key, super().forward_oot)

        def _run(self, positions, query, key, native):
            reason, call = self._pypto_gym
            cache = self._buffers["cos_sin_cache"]
            if reason is None and key is not None and query.dtype is cache.dtype is key.dtype and query.is_cpu \
                    and cache.is_cpu:  # vLLM's CPU call, its checks in the fewest steps: the op takes ~7 us at a
                # toy model's shapes, where the general path below cost 0.6 us more (tuple lookups, device objects)
                flat = positions if positions.ndim == 1 else positions.flatten()  # flatten() costs 0.8 us
                return call.into((query, key), flat, query, key, cache)
            reason = reason or _call_reason(query, key)
            if reason is None:
                flat = positions if positions.ndim == 1 else positions.flatten()
                return _rotate_in_place(self, call, flat, query, key)
            COUNTERS.decline("RotaryEmbedding", reason)
            return native(positions, query, key)

    return PyptoGymRotaryEmbedding


def _mrotary_class():
    from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding

    class PyptoGymMRotaryEmbedding(MRotaryEmbedding):
        """Qwen2.5-VL's and Qwen3-VL's multimodal rotary embedding by pypto-gym's rope with its mrope sections
        (chunked, or interleaved)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            constants = {"head_size": self.head_size, "cast_mode": "hf"}
            self.__dict__["_pypto_gym"] = (_layer_reason(self), {  # text positions [T] or multimodal [3, T]
                1: bound("MRotaryEmbedding", "rotary_embedding", mrope_section=(), mrope_interleaved=False,
                         **constants),
                2: bound("MRotaryEmbedding", "rotary_embedding", mrope_section=tuple(self.mrope_section or ()),
                         mrope_interleaved=bool(self.mrope_interleaved and self.mrope_section), **constants)})

        def forward_cpu(self, positions, query, key=None, offsets=None):
            return self._run(positions, query, key, offsets, super().forward_cpu)

        def forward_oot(self, positions, query, key=None, offsets=None):
            return self._run(positions, query, key, offsets, super().forward_oot)

        def _run(self, positions, query, key, offsets, native):
            reason, calls = self._pypto_gym
            reason = reason or _call_reason(query, key)
            if reason is None and offsets is not None:
                reason = "per-token position offsets"
            if reason is None and positions.ndim == 2 and not self.mrope_section:
                reason = "[3, T] positions without sections"
            if reason is None:
                return _rotate_in_place(self, calls[positions.ndim], positions, query, key)
            COUNTERS.decline("MRotaryEmbedding", reason)
            return native(positions, query, key, offsets)

    return PyptoGymMRotaryEmbedding


def ensure_installed() -> None:
    """The providers registered in this process (once: vLLM refuses a second registration of a name)."""
    from vllm.ir import ops as ir_ops
    from vllm.model_executor.custom_op import op_registry_oot

    if "pypto_gym" not in ir_ops.rms_norm.impls:
        install_ir_providers()
    if "SiluAndMul" not in op_registry_oot:
        install_custom_ops()


def install_custom_ops(chosen=OP_NAMES) -> list[str]:
    """Register the chosen out-of-tree custom ops (vLLM builds its layers with them from now on); their names."""
    from vllm.model_executor.custom_op import CustomOp, op_registry_oot

    classes = {"SiluAndMul": _silu_and_mul_class, "RotaryEmbedding": _rotary_class,
               "MRotaryEmbedding": _mrotary_class}
    taken = []
    for name in chosen:
        if name not in classes:
            continue
        if name in op_registry_oot:  # another platform's (vllm-ascend's register_ascend_customop): it serves it
            COUNTERS.declined[name][f"{op_registry_oot[name].__module__} serves it (registered first)"] = 0
            continue
        CustomOp.register_oot(name=name)(classes[name]())
        taken.append(name)
    return taken
