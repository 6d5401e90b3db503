"""compressed-tensors' W8A8 (`format: int-quantized`): what llm-compressor writes and transformers (through
compressed-tensors) and vLLM load. Per int8 linear `weight` int8 [out, in] and `weight_scale` fp32 [out, 1]; a static
scheme adds `input_scale` (model dtype) and `input_zero_point` (int8) [1]; config.json's `quantization_config` names
the scheme and the linears left float (`ignore`)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .checkpoint import module_names, read_json

NAME = "compressed-tensors"
LM_HEAD_CONSUMER = ("pypto-gym and transformers load it; vLLM refuses it (its ParallelLMHead is never quantised: "
                    "'no module or parameter named lm_head.weight_scale')")


def quantization_config(ignore: list[str], static: bool = False) -> dict:
    """The `quantization_config` of config.json: one group, every nn.Linear not in `ignore`; input activations
    int8 per token and dynamic, or (`static`) per tensor, static and asymmetric (`input_scale` and
    `input_zero_point` per linear: what llm-compressor writes for a static int8 recipe, vLLM's
    CompressedTensorsW8A8Int8 with a static, asymmetric input)."""
    int8 = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "block_structure": None,
            "actorder": None, "observer": None, "observer_kwargs": {}}
    activations = ({**int8, "symmetric": False, "strategy": "tensor", "dynamic": False, "observer": "minmax"}
                   if static else {**int8, "strategy": "token", "dynamic": True})
    return {
        "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"], "format": "int-quantized", "output_activations": None,
            "weights": {**int8, "strategy": "channel", "dynamic": False, "observer": "minmax"},
            "input_activations": activations,
        }},
        "ignore": sorted(ignore), "kv_cache_scheme": None, "global_compression_ratio": None,
    }


# ---- writing ---------------------------------------------------------------------------------------------------
def linear_tensors(ql, static: bool) -> dict:
    """An int8 linear's tensors beyond `weight` and `weight_scale`: a static one's input scale (the model dtype) and
    zero point (int8)."""
    if not static:
        return {}
    return {f"{ql.path}.input_scale": ql.static[0].reshape(1).to(ql.module.weight.dtype).clone(),
            f"{ql.path}.input_zero_point": ql.static[1].reshape(1).to(torch.int8).clone()}


def stored_forms(state_dict: dict, plan) -> None:
    """Nothing to convert: every tensor is stored as the model holds it."""


def write(folder: Path, int8: list[str], ignore: list[str], static: bool) -> None:
    """config.json's quantization_config, beside save_pretrained's files."""
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = quantization_config(ignore, static)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# ---- reading ---------------------------------------------------------------------------------------------------
def is_checkpoint(path: Path) -> bool:
    """config.json names compressed-tensors (one that cannot be read says nothing here: loading it refuses it)."""
    try:
        qc = read_json(path / "config.json", str(path)).get("quantization_config")
    except (OSError, ValueError):
        return False
    return isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors"


def is_static(path: Path) -> bool:
    """Its input activations are static per tensor (a config that cannot be read: dynamic; loading refuses it)."""
    try:
        groups = read_json(path / "config.json", str(path))["quantization_config"]["config_groups"]
        return any(g["input_activations"]["dynamic"] is False and g["input_activations"]["strategy"] == "tensor"
                   for g in groups.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


_INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "block_structure": None}
_SCHEME = {  # every field of a config group the kernels depend on, and the one value they run
    "weights": {**_INT8, "strategy": "channel", "dynamic": False, "actorder": None},
    "input_activations": {**_INT8, "strategy": "token", "dynamic": True, "actorder": None},
}
# the static scheme's input activations: per tensor, static, symmetric (no zero point) or not
_STATIC_INPUT = {**_INT8, "strategy": "tensor", "dynamic": False, "actorder": None}
_FREE = {"observer", "observer_kwargs", "scale_dtype", "zp_dtype"}  # how it was calibrated or stored: not ours to run
_EMPTY_OR_NONE = ("kv_cache_scheme", "sparsity_config", "transform_config")


def check(where: str, path: Path, config_json: dict, tensors: dict) -> bool:
    """The schemes the fused kernels run: int8 symmetric per-channel weights, int8 activations either symmetric
    dynamic per token or static per tensor (symmetric or not: returns True for static), `int-quantized`, Linear
    targets, no output activations, KV-cache scheme, sparsity or transform. Every field is checked: one the loader
    does not know, or a value other than these schemes', is refused naming the field (a field silently ignored would
    run another scheme as this one)."""
    qc = config_json.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        method = qc.get("quant_method") if isinstance(qc, dict) else None
        raise ValueError(f"{where}: quantization_config.quant_method {method!r}; expected 'compressed-tensors'")
    if qc.get("format") not in ("int-quantized", "naive-quantized"):
        raise ValueError(f"{where}: quantization_config.format {qc.get('format')!r}; expected 'int-quantized'")
    for key in _EMPTY_OR_NONE:
        if qc.get(key):
            raise ValueError(f"{where}: quantization_config.{key} is {qc[key]!r}; the int8 kernels run none")
    if not isinstance(qc.get("ignore", []), list):
        raise ValueError(f"{where}: quantization_config.ignore is {qc.get('ignore')!r}; expected a list of names")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or len(groups) != 1:
        raise ValueError(f"{where}: quantization_config.config_groups has {len(groups)} groups; expected one")
    (name, group), = groups.items()
    if not isinstance(group, dict):
        raise ValueError(f"{where}: config_groups.{name} is {group!r}; expected an object")
    if group.get("format") not in (None, qc.get("format")):
        raise ValueError(f"{where}: config_groups.{name}.format {group.get('format')!r} contradicts "
                         f"quantization_config.format {qc.get('format')!r}")
    if group.get("targets") != ["Linear"]:
        raise ValueError(f"{where}: config_groups.{name}.targets is {group.get('targets')!r}; expected ['Linear']")
    if group.get("output_activations") is not None:
        raise ValueError(f"{where}: config_groups.{name}.output_activations is set; the int8 kernels quantise no "
                         f"outputs")
    unknown = sorted(set(group) - {"format", "targets", "output_activations", *_SCHEME})
    if unknown:
        raise ValueError(f"{where}: config_groups.{name}.{unknown[0]} is a field the loader does not know")
    activations = group.get("input_activations")
    static = isinstance(activations, dict) and activations.get("dynamic") is False
    for label, fields in _SCHEME.items():
        got = group.get(label)
        if not isinstance(got, dict):
            raise ValueError(f"{where}: config_groups.{name}.{label} is {got!r}; expected an object")
        if label == "input_activations" and static:
            fields = {**_STATIC_INPUT, "symmetric": got.get("symmetric")} if got.get("symmetric") in (True, False) \
                else _STATIC_INPUT
        for key in sorted(set(got) - set(fields) - _FREE):
            raise ValueError(f"{where}: config_groups.{name}.{label}.{key} is a field the loader does not know")
        for key, value in fields.items():
            if got.get(key, None if value is None else "absent") != value:
                raise ValueError(f"{where}: config_groups.{name}.{label}.{key} is {got.get(key, 'absent')!r}; expected "
                                 f"{value!r} (W8A8: int8 per-channel weights, int8 activations dynamic per token or "
                                 f"static per tensor)")
    return static


def static_inputs(where: str, tensors: dict) -> dict:
    """{linear: (input_scale [1], input_zero_point [1])} of a checkpoint with static per-tensor input activations,
    popped and checked (a missing scale, one that is not finite and > 0, a zero point that is not an int8 value)
    naming the tensor; a symmetric scheme's missing zero point is 0. The int8 epilogue is derived from these, the
    weight scales and the bias."""
    out = {}
    for lin in sorted(k[:-len(".weight_scale")] for k in tensors if k.endswith(".weight_scale")):
        scale, zp = tensors.pop(f"{lin}.input_scale", None), tensors.pop(f"{lin}.input_zero_point", None)
        name = f"{where}: tensor '{lin}."
        if scale is None:
            raise ValueError(f"{name}input_scale' is missing (static input activations: one scale per linear)")
        if not scale.is_floating_point() or scale.numel() != 1 or not (torch.isfinite(scale).all() and
                                                                       float(scale) > 0):
            raise ValueError(f"{name}input_scale' is {str(scale.dtype).replace('torch.', '')} {list(scale.shape)}; "
                             f"expected one finite float value > 0")
        zp = torch.zeros(1, dtype=torch.int8) if zp is None else zp
        if zp.numel() != 1 or zp.is_floating_point() or not -128 <= int(zp) <= 127:
            raise ValueError(f"{name}input_zero_point' is {str(zp.dtype).replace('torch.', '')} {list(zp.shape)}; "
                             f"expected one int8 value")
        out[lin] = (scale.reshape(1), zp.reshape(1))
    return out


def check_float_linears(where: str, config_json: dict, family, stored: dict, tied: set, linears: set) -> None:
    """quantization_config's `ignore` against the weights: a linear it keeps float has no int8 weight, and every
    other linear (its config group targets every Linear) has one, or is a tied one quantised from its table."""
    ignore = config_json["quantization_config"].get("ignore", [])
    names = set(module_names({f"{n}.weight": None for n in ignore if isinstance(n, str)}, family))
    ignored = {n[:-len(".weight")] for n in names}
    both = sorted(ignored & set(stored))
    if both:
        raise ValueError(f"{where}: quantization_config.ignore keeps {both[0]} float, but its weight is int8")
    missing = sorted(linears - ignored - set(stored) - tied)
    if missing:
        raise ValueError(f"{where}: {missing[0]} is not in quantization_config.ignore (the config group targets every "
                         f"Linear) but has no int8 weight")
