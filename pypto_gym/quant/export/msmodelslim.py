"""msModelSlim's W8A8 checkpoint (its save/ascendv1.py), as vllm-ascend `--quantization ascend` loads it: every tensor
in `quant_model_weights.safetensors`, and `quant_model_description.json` typing each (`W8A8_DYNAMIC` or `W8A8`,
`FLOAT` for the rest) with the global keys; config.json without quantization_config.

Per int8 linear: `weight` int8, `weight_scale` fp32 [out, 1], `weight_offset` zeros fp32 [out, 1] (symmetric) and
its bias fp32; the static scheme (`W8A8`) adds `input_scale` and `input_offset` [1] in the model dtype, `deq_scale`
[out] (fp32; int64 holding the fp32 bits for an fp16 model, as msModelSlim stores it for npu_quant_matmul's fp16
output) and `quant_bias` int32 [out], the tensors the linear runs."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from .checkpoint import read_json

NAME = "msmodelslim"
LM_HEAD_CONSUMER = ("pypto-gym loads it; vllm-ascend quantises an lm_head its description types W8A8_DYNAMIC "
                    "(modelslim_config.py: AscendEmbeddingMethod)")
MSMODELSLIM_JSON = "quant_model_description.json"  # msModelSlim's names (its save/ascendv1.py), as vllm-ascend reads
MSMODELSLIM_WEIGHTS = "quant_model_weights.safetensors"
W8A8_DYNAMIC = "W8A8_DYNAMIC"
W8A8_STATIC = "W8A8"  # msModelSlim's name of the static scheme (vllm-ascend: methods/w8a8_static.py)
GLOBALS = {"version": "1.0.0", "model_quant_type": W8A8_DYNAMIC, "metadata": {}, "group_size": 0}
STATIC_TENSORS = ("input_scale", "input_offset", "deq_scale", "quant_bias")  # per static int8 linear, beside weight


def deq_scale_to_int64(deq: torch.Tensor) -> torch.Tensor:
    """msModelSlim's int64 deq_scale (fp16 models): each fp32 value's bit pattern, as an integer."""
    return deq.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)


def deq_scale_from_int64(deq: torch.Tensor) -> torch.Tensor:
    """The fp32 deq_scale an int64 one holds (the inverse of deq_scale_to_int64; values are int32 bit patterns)."""
    return deq.to(torch.int32).view(torch.float32)


# ---- writing ---------------------------------------------------------------------------------------------------
def linear_tensors(ql, static: bool) -> dict:
    """An int8 linear's tensors beyond `weight` and `weight_scale`: the zero weight offset and the fp32 bias; a
    static one's input scale and offset, deq_scale (folded later, as it runs) and quant_bias."""
    out = {f"{ql.path}.weight_offset": torch.zeros(ql.w_scale.numel(), 1, dtype=torch.float32,
                                                               device=ql.w_scale.device)}
    if ql.module.bias is not None:
        out[f"{ql.path}.bias"] = ql.module.bias.detach().to(torch.float32)
    if static:
        dtype = ql.module.weight.dtype
        out.update({f"{ql.path}.input_scale": ql.static[0].reshape(1).to(dtype).clone(),
                    f"{ql.path}.input_offset": ql.static[1].reshape(1).to(dtype).clone(),
                    f"{ql.path}.deq_scale": ql.deq_base.to(torch.float32).clone(),
                    f"{ql.path}.quant_bias": ql.quant_bias.clone()})
    return out


def stored_forms(state_dict: dict, plan) -> None:
    """An fp16 model's deq_scale as msModelSlim stores it: the fp32 bits as int64 (after every fold)."""
    for ql in plan.linears:
        name = f"{ql.path}.deq_scale"
        if name in state_dict and ql.module.weight.dtype == torch.float16:
            state_dict[name] = deq_scale_to_int64(state_dict[name])


def write(folder: Path, int8: list[str], ignore: list[str], static: bool) -> None:
    """The weights file under msModelSlim's name and the description typing every tensor in it."""
    from safetensors import safe_open

    (folder / "model.safetensors").rename(folder / MSMODELSLIM_WEIGHTS)
    with safe_open(str(folder / MSMODELSLIM_WEIGHTS), framework="pt") as f:
        names = list(f.keys())
    kind = W8A8_STATIC if static else W8A8_DYNAMIC
    int8_keys = {f"{p}.{n}" for p in int8 for n in ("weight", "weight_scale", "weight_offset",
                                                     *(STATIC_TENSORS if static else ()))}
    description = {k: kind if k in int8_keys else "FLOAT" for k in sorted(names)}
    (folder / MSMODELSLIM_JSON).write_text(json.dumps({**description, **GLOBALS, "model_quant_type": kind},
                                                      indent=2) + "\n")


# ---- reading ---------------------------------------------------------------------------------------------------
def is_checkpoint(path: Path) -> bool:
    return (path / MSMODELSLIM_JSON).is_file()


def is_static(path: Path) -> bool:
    """The description types the static scheme (one that cannot be read: dynamic; loading refuses it)."""
    try:
        return read_json(path / MSMODELSLIM_JSON, str(path)).get("model_quant_type") == W8A8_STATIC
    except (OSError, ValueError):
        return False


def check(where: str, path: Path, config_json: dict, tensors: dict) -> bool:
    """The description against the weights: W8A8_DYNAMIC or W8A8 (static: returns True), every tensor named and every
    name a tensor, symmetric (zero) weight offsets; the offsets are then dropped (the kernels are symmetric)."""
    description = read_json(path / MSMODELSLIM_JSON, where)
    got = description.get("model_quant_type")
    if got not in (W8A8_DYNAMIC, W8A8_STATIC):
        raise ValueError(f"{where}: {MSMODELSLIM_JSON} model_quant_type {got!r}; expected {W8A8_DYNAMIC!r} or "
                         f"{W8A8_STATIC!r}")
    named = {k: v for k, v in description.items() if k not in GLOBALS}
    for name, kind in sorted(named.items()):
        if name not in tensors:
            raise ValueError(f"{where}: {MSMODELSLIM_JSON} names tensor {name!r}, which the weights do not hold")
        if kind not in (got, "FLOAT"):
            raise ValueError(f"{where}: {MSMODELSLIM_JSON} gives {name!r} type {kind!r}; expected "
                             f"{got!r} or 'FLOAT'")
    unnamed = sorted(set(tensors) - set(named))
    if unnamed:
        raise ValueError(f"{where}: tensor {unnamed[0]!r} is not named in {MSMODELSLIM_JSON}")
    for name in sorted(k for k in tensors if k.endswith(".weight_offset")):
        if named[name] != got or tensors[name].any():
            raise ValueError(f"{where}: tensor {name!r} is not zero: an asymmetric weight, which the int8 kernels "
                             f"(symmetric) do not run")
        del tensors[name]
    for name, t in tensors.items():
        if t.dtype == torch.int8 and named[name] != got:
            raise ValueError(f"{where}: tensor {name!r} is int8 but {MSMODELSLIM_JSON} types it {named[name]!r}")
    return got == W8A8_STATIC


def static_inputs(where: str, tensors: dict) -> dict:
    """{linear: (input_scale [1], input_offset [1], deq_scale fp32 [N], quant_bias int32 [N])}, popped from `tensors`
    and checked, a problem refused naming the tensor: every tensor of the four present, input_scale finite and > 0,
    input_offset an integer in int8's range, deq_scale fp32 (or int64 holding fp32 bits: fp16 models) finite and
    >= 0, quant_bias int32. A weight_scale the format does not require is derived as deq_scale / input_scale
    (msModelSlim's own inverse) where absent."""
    out = {}
    for lin in sorted({k.rpartition(".")[0] for k in tensors if k.endswith(tuple(f".{n}" for n in STATIC_TENSORS))}):
        got = {}
        for n in STATIC_TENSORS:
            t = tensors.pop(f"{lin}.{n}", None)
            if t is None:
                raise ValueError(f"{where}: tensor '{lin}.{n}' is missing (a W8A8 static int8 linear has "
                                 f"{', '.join(STATIC_TENSORS)})")
            got[n] = t
        name = f"{where}: tensor '{lin}."
        scale, offset, deq, qb = (got[n] for n in STATIC_TENSORS)
        for n, t in (("input_scale", scale), ("input_offset", offset)):
            if not t.is_floating_point() and t.dtype != torch.int8 or t.numel() != 1:
                raise ValueError(f"{name}{n}' is {str(t.dtype).replace('torch.', '')} {list(t.shape)}; expected one "
                                 f"float value ([1])")
        if not (torch.isfinite(scale).all() and float(scale) > 0):
            raise ValueError(f"{name}input_scale' is {float(scale)!r}; expected a finite value > 0")
        o = float(offset)
        if not (math.isfinite(o) and o == round(o) and -128 <= o <= 127):  # round(NaN) raised its own error
            raise ValueError(f"{name}input_offset' is {o!r}; expected an integer in int8's range [-128, 127]")
        if deq.dtype == torch.int64:
            if deq.numel() and (deq.min() < -2 ** 31 or deq.max() >= 2 ** 31):
                raise ValueError(f"{name}deq_scale' is int64 but holds values that are not fp32 bit patterns")
            deq = deq_scale_from_int64(deq)
        if deq.dtype != torch.float32 or deq.dim() != 1:
            raise ValueError(f"{name}deq_scale' is {str(deq.dtype).replace('torch.', '')} {list(deq.shape)}; "
                             f"expected float32 [out] (or int64 holding fp32 bits)")
        if not torch.isfinite(deq).all() or (deq < 0).any():
            raise ValueError(f"{name}deq_scale' has values that are not finite and >= 0")
        if qb.dtype != torch.int32 or qb.dim() != 1:
            raise ValueError(f"{name}quant_bias' is {str(qb.dtype).replace('torch.', '')} {list(qb.shape)}; "
                             f"expected int32 [out]")
        if f"{lin}.weight_scale" not in tensors and f"{lin}.weight" in tensors:
            tensors[f"{lin}.weight_scale"] = deq / scale.to(torch.float32).reshape(())
        out[lin] = (scale.reshape(1), offset.reshape(1), deq, qb)
    return out


def check_float_linears(where: str, config_json: dict, family, stored: dict, tied: set, linears: set) -> None:
    """Nothing beyond `check`: the description types every tensor, int8 or FLOAT."""
