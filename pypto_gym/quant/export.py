"""Save a W8A8-patched model as a compressed-tensors (`format: int-quantized`) or msModelSlim checkpoint.

What llm-compressor writes for W8A8 with per-channel symmetric int8 weights and per-token dynamic
int8 activations, and what transformers (through compressed-tensors), vLLM and vllm-ascend load:
each int8 linear's `weight` as int8 [out, in] and `weight_scale` as fp32 [out, 1] (ours exactly: the
weight the int8 linear runs is the one written, no re-quantisation), every other tensor as the
model holds it, and a `quantization_config` naming the scheme and the linears left float (`ignore`:
a tied lm_head, whose weight is the embedding's, `float_linears`, a tower without producers).

A smoothed model (a calibration file) is written with every smooth scale folded into what writes the
rows it scales (quant/fold.py: norm weights, up_proj's and v_proj's output rows, ln_q), as llm-compressor's
SmoothQuant writes its checkpoints: neither format has a tensor for an activation smooth scale. The int8
weights are still the ones the model runs; a folded int8 linear's weight_scale (and bias) carries the
factor.

lm_head is float by default (in `ignore`, FLOAT in msModelSlim's description): what vLLM and vllm-ascend
load. An int8 lm_head (patch_model's int8_lm_head) is written int8 and said to be so (LM_HEAD_CONSUMERS);
tied to the embedding it is written once, as the embedding's float table, and quantised again on loading.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import stat
import tempfile
import warnings
from pathlib import Path

import torch

from .. import files
from .linear import STORED, STORED_STATIC, quant_linear_of
from .plan import output_embedding

FORMAT = "compressed-tensors"


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


FORMATS = ("compressed-tensors", "msmodelslim")
MSMODELSLIM_JSON = "quant_model_description.json"  # msModelSlim's names (its save/ascendv1.py), as vllm-ascend reads
MSMODELSLIM_WEIGHTS = "quant_model_weights.safetensors"
W8A8_DYNAMIC = "W8A8_DYNAMIC"
W8A8_STATIC = "W8A8"  # msModelSlim's name of the static scheme (vllm-ascend: methods/w8a8_static.py)
MSMODELSLIM_GLOBALS = {"version": "1.0.0", "model_quant_type": W8A8_DYNAMIC, "metadata": {}, "group_size": 0}
STATIC_TENSORS = ("input_scale", "input_offset", "deq_scale", "quant_bias")  # per static int8 linear, beside weight


LM_HEAD_CONSUMERS = {  # who loads an int8 lm_head of each format (read in vLLM 0.32 and vllm-ascend's code)
    "compressed-tensors": "pypto-gym and transformers load it; vLLM refuses it (its ParallelLMHead is never "
                          "quantised: 'no module or parameter named lm_head.weight_scale')",
    "msmodelslim": "pypto-gym loads it; vllm-ascend quantises an lm_head its description types W8A8_DYNAMIC "
                   "(modelslim_config.py: AscendEmbeddingMethod)",
}


def save(model, out_dir, processor=None, format: str = "compressed-tensors") -> dict:
    """Write the W8A8-patched `model` (and its processor/tokenizer) to `out_dir` as a compressed-tensors or an
    msModelSlim W8A8_DYNAMIC checkpoint; returns {"int8": [paths], "ignore": [paths], "lm_head": "float" | "int8"}.
    Refused, before anything is written, for a model that is not patched in W8A8 mode or a scale that cannot
    fold. Smoothing is folded (module docstring). Everything is written into a temporary folder beside
    `out_dir`, renamed to it at the end: an interrupted or failed export leaves nothing (no config.json
    without its quantization_config, which transformers would load as a float model of int8 codes).

    msModelSlim: every tensor in `quant_model_weights.safetensors`; per int8 linear `weight` int8,
    `weight_scale` fp32 [out, 1], `weight_offset` zeros fp32 [out, 1] (symmetric) and its bias fp32;
    `quant_model_description.json` naming each tensor's type (`W8A8_DYNAMIC`, `FLOAT` for the rest) with
    the global keys version, model_quant_type, metadata, group_size; config.json without quantization_config.
    A model patched with quant="w8a8_static" is written as msModelSlim's W8A8 (static): per int8 linear also
    `input_scale` and `input_offset` [1] in the model dtype, `deq_scale` [out] (fp32; int64 holding the fp32 bits
    for an fp16 model, as msModelSlim stores it for npu_quant_matmul's fp16 output) and `quant_bias` int32 [out],
    the tensors the linear runs; model_quant_type `W8A8`."""
    from ..patching.api import _STATE_ATTR

    if format not in FORMATS:
        raise ValueError(f"format: got {format!r}; expected one of {', '.join(map(repr, FORMATS))}")
    state = model.__dict__.get(_STATE_ATTR)
    plan = None if state is None else state.quant
    if plan is None:
        raise ValueError("export: the model is not patched with quant='w8a8'; patch it first (its int8 weights "
                         "are what is written)")
    out = check_out_dir(out_dir)
    static = plan.scheme == "static"
    factors = _smoothing_factors(model, plan)  # refused here, before anything is written, if one cannot fold
    tensors = {}
    int8, ignore, tied = [], [], []
    for ql in plan.linears:
        if ql.float_weight_shared:  # a tied lm_head: the embedding's table, written once, float
            if ql.inv_smooth is not None:
                raise ValueError(f"export: {ql.path} shares its weight with another module and is smoothed: no "
                                 f"checkpoint tensor can hold both")
            ignore.append(ql.path)
            tied.append(ql.path)
            continue
        int8.append(ql.path)
        scale = ql.w_scale.reshape(-1, 1).to(torch.float32).contiguous()
        tensors[f"{ql.path}.weight"] = ql.w_q.contiguous()
        tensors[f"{ql.path}.weight_scale"] = scale
        if format == "msmodelslim":
            tensors[f"{ql.path}.weight_offset"] = torch.zeros_like(scale)
            if ql.module.bias is not None:
                tensors[f"{ql.path}.bias"] = ql.module.bias.detach().to(torch.float32)
        if static and format == "msmodelslim":
            dtype = ql.module.weight.dtype
            tensors[f"{ql.path}.input_scale"] = ql.static[0].reshape(1).to(dtype).clone()
            tensors[f"{ql.path}.input_offset"] = ql.static[1].reshape(1).to(dtype).clone()
            tensors[f"{ql.path}.deq_scale"] = ql.deq_base.to(torch.float32).clone()  # folded below, as it runs
            tensors[f"{ql.path}.quant_bias"] = ql.quant_bias.clone()
        elif static:  # compressed-tensors: the scale in the model dtype, the zero point int8
            tensors[f"{ql.path}.input_scale"] = ql.static[0].reshape(1).to(ql.module.weight.dtype).clone()
            tensors[f"{ql.path}.input_zero_point"] = ql.static[1].reshape(1).to(torch.int8).clone()
    ignore += [r["path"] for r in plan.float_linears]
    state_dict = {k: v for k, v in model.state_dict().items() if not v.is_meta}
    state_dict.update(tensors)
    missing = [k for k, v in model.state_dict().items() if v.is_meta and k not in state_dict]
    if missing:
        raise ValueError(f"export: {missing[0]} has no data (released and not an int8 weight)")
    for name, f in factors.items():  # each output channel (dim 0) times its folded 1/s, rounded once
        if name.endswith(".deq_scale") and name not in state_dict:  # compressed-tensors has none: weight_scale
            continue
        t = state_dict[name]
        state_dict[name] = (t.float() * f.to(t.device).view(-1, *[1] * (t.dim() - 1))).to(t.dtype)
    if static:
        for ql in plan.linears:  # msModelSlim's fp16 deq_scale: the fp32 bits as int64 (after any fold above)
            name = f"{ql.path}.deq_scale"
            if name in state_dict and ql.module.weight.dtype == torch.float16:
                state_dict[name] = deq_scale_to_int64(state_dict[name])
    head = output_embedding(model)
    lm_head = "int8" if head is not None and quant_linear_of(head[1]) is not None else "float"
    with _staging(out) as tmp:
        model.save_pretrained(tmp, state_dict=state_dict, max_shard_size="1000GB")  # one weights file
        (tmp / SIDECAR).write_text(json.dumps({"format": "pypto_gym-export-1", "quantised_from_float": tied},
                                              indent=2) + "\n")
        if format == "compressed-tensors":
            config_path = tmp / "config.json"
            config = json.loads(config_path.read_text())
            config["quantization_config"] = quantization_config(ignore, static)
            config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        else:
            from safetensors import safe_open

            (tmp / "model.safetensors").rename(tmp / MSMODELSLIM_WEIGHTS)
            with safe_open(str(tmp / MSMODELSLIM_WEIGHTS), framework="pt") as f:
                names = list(f.keys())
            kind = W8A8_STATIC if static else W8A8_DYNAMIC
            int8_keys = {f"{p}.{n}" for p in int8 for n in ("weight", "weight_scale", "weight_offset",
                                                             *(STATIC_TENSORS if static else ()))}
            description = {k: kind if k in int8_keys else "FLOAT" for k in sorted(names)}
            (tmp / MSMODELSLIM_JSON).write_text(json.dumps({**description, **MSMODELSLIM_GLOBALS,
                                                            "model_quant_type": kind}, indent=2) + "\n")
        if processor is not None:
            processor.save_pretrained(tmp)
    return {"int8": int8, "ignore": sorted(ignore), "lm_head": lm_head}


def deq_scale_to_int64(deq: torch.Tensor) -> torch.Tensor:
    """msModelSlim's int64 deq_scale (fp16 models): each fp32 value's bit pattern, as an integer."""
    return deq.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)


def deq_scale_from_int64(deq: torch.Tensor) -> torch.Tensor:
    """The fp32 deq_scale an int64 one holds (the inverse of deq_scale_to_int64; values are int32 bit patterns)."""
    return deq.to(torch.int32).view(torch.float32)


def check_out_dir(out_dir) -> Path:
    """The export's folder, refused in one line before any work: not empty, a file, a missing parent (not created,
    as `cp` does not), an unwritable parent (the export is staged beside it). A symlink is followed: the export
    goes into the directory it names, staged beside that one (the link stays a link; staging beside the link and
    renaming over it failed with "Not a directory" after the whole export)."""
    out = Path(out_dir)
    if out.is_symlink():
        target = Path(os.path.realpath(out))
        if not target.exists():
            raise FileNotFoundError(f"export: {out} is a symlink to {target}, which does not exist; expected a new or "
                                    f"empty directory")
        out = target
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"export: {out} is a file; expected a new or empty directory")
    if out.is_dir() and any(out.iterdir()):
        raise FileExistsError(f"export: {out} exists and is not empty; expected a new or empty directory")
    parent = out.absolute().parent
    if not parent.is_dir():
        raise FileNotFoundError(f"export: directory {parent} does not exist (create it first)")
    if not os.access(parent, os.W_OK | os.X_OK) or (out.is_dir() and not os.access(out, os.W_OK | os.X_OK)):
        raise PermissionError(f"export: cannot write in {parent if not out.is_dir() else out}")
    return out


@contextlib.contextmanager
def _staging(out: Path):
    """A temporary folder beside `out`, renamed to `out` once everything was written into it (the files get the
    mode a plain open() would give them: save_pretrained writes some 0600); removed if anything fails."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.absolute().parent))
    try:
        yield tmp
        mode = files.new_file_mode()
        for f in tmp.rglob("*"):
            if f.is_file():
                os.chmod(f, mode)
        os.chmod(tmp, 0o777 & ~files.umask())
        if out.is_dir():
            out.rmdir()  # the empty folder the user made: the staged one takes its place
        os.rename(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and not isinstance(e, (OSError, ValueError)):  # safetensors' own errors
            raise OSError(f"export: writing {out} failed ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
                          f"nothing written") from e
        raise


def _smoothing_factors(model, plan) -> dict:
    """{state-dict name: fp32 factor per output channel}: every smooth scale of the plan folded into what writes
    the rows it scales (quant/fold.py); an int8 linear's factor goes to its weight_scale, a float one's to its
    weight rows, with its bias either way."""
    from .fold import folds, source_factor

    factors = {}

    def times(name, f):
        factors[name] = f if name not in factors else factors[name] * f

    def rows_of(path, f):  # a module's output channels: a norm's weight, a linear's rows
        module = model.get_submodule(path)
        ql = quant_linear_of(module) if isinstance(module, torch.nn.Linear) else None
        times(f"{path}.weight_scale" if ql is not None else f"{path}.weight", f)
        if ql is not None and ql.static is not None:  # a static linear's output is scaled by deq_scale
            times(f"{path}.deq_scale", f)
        if getattr(module, "bias", None) is not None:
            times(f"{path}.bias", f)

    for path, norm in plan.norms.items():
        if norm.inv_smooth is not None:
            rows_of(path, norm.inv_smooth.detach().float().cpu())
    for path, mlp in plan.mlps.items():
        if mlp.inv_smooth is not None:
            rows_of(f"{path}.up_proj", mlp.inv_smooth.detach().float().cpu())
    sources = folds(model)
    for ql in plan.linears:
        if ql.source is None and ql.inv_smooth is not None:
            if ql.path not in sources:
                raise ValueError(f"export: {ql.path} is smoothed but its family table gives it nothing to fold its "
                                 f"scale into; calibrate again (pypto-gym calibrate does not smooth it)")
            fold = sources[ql.path]
            rows_of(fold.source_path, source_factor(ql.inv_smooth, fold))
    return factors


# ---- loading a compressed-tensors W8A8 checkpoint onto the fused kernels ----------------------------------
SIDECAR = "pypto_gym_export.json"  # what export wrote beyond the format: the tied linears quantised from a float table


_INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "block_structure": None}
_SCHEME = {  # every field of a config group the kernels depend on, and the one value they run
    "weights": {**_INT8, "strategy": "channel", "dynamic": False, "actorder": None},
    "input_activations": {**_INT8, "strategy": "token", "dynamic": True, "actorder": None},
}
# the static scheme's input activations: per tensor, static, symmetric (no zero point) or not
_STATIC_INPUT = {**_INT8, "strategy": "tensor", "dynamic": False, "actorder": None}
_FREE = {"observer", "observer_kwargs", "scale_dtype", "zp_dtype"}  # how it was calibrated or stored: not ours to run
_EMPTY_OR_NONE = ("kv_cache_scheme", "sparsity_config", "transform_config")


def _check_scheme(where: str, qc) -> bool:
    """The schemes the fused kernels run: int8 symmetric per-channel weights, int8 activations either symmetric
    dynamic per token or static per tensor (symmetric or not: returns True for static), `int-quantized`, Linear
    targets, no output activations, KV-cache scheme, sparsity or transform. Every field is checked: one the loader
    does not know, or a value other than these schemes', is refused naming the field (a field silently ignored would
    run another scheme as this one)."""
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        raise ValueError(f"{where}: quantization_config.quant_method "
                         f"{None if not isinstance(qc, dict) else qc.get('quant_method')!r}; expected 'compressed-tensors'")
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


def _check_description(where: str, description: dict, tensors: dict) -> str:
    """msModelSlim's quant_model_description.json against its weights: W8A8_DYNAMIC or W8A8 (static), every tensor
    named and every name a tensor, symmetric (zero) weight offsets; the offsets are then dropped (the kernels are
    symmetric). Returns the scheme's type."""
    got = description.get("model_quant_type")
    if got not in (W8A8_DYNAMIC, W8A8_STATIC):
        raise ValueError(f"{where}: {MSMODELSLIM_JSON} model_quant_type {got!r}; expected {W8A8_DYNAMIC!r} or "
                         f"{W8A8_STATIC!r}")
    named = {k: v for k, v in description.items() if k not in MSMODELSLIM_GLOBALS}
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
    return got


def _regular(path: Path) -> bool:
    """A regular file (os.stat): a FIFO or a device named like a checkpoint file is never opened (it would hang)."""
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except OSError:
        return False


def read_json(path: Path, where: str) -> dict:
    """A checkpoint's JSON file as a dict, or one line naming the file and what is wrong with it."""
    if not _regular(path):
        raise FileNotFoundError(f"{where}: {path.name} is missing or not a regular file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{where}: {path.name} is not valid JSON ({str(e).splitlines()[0][:100]})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: {path.name} holds a JSON {type(data).__name__}; expected an object")
    return data


def _read_tensors(path: Path, where: str) -> dict:
    """Every tensor of the checkpoint's *.safetensors files (regular files only), a damaged one named."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(f for f in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{where}: no *.safetensors file")
    out = {}
    for f in files:
        if not _regular(f):
            raise ValueError(f"{where}: {f.name} is not a regular file")
        try:
            out.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ValueError(f"{where}: {f.name} is not a readable safetensors file (truncated or damaged: "
                             f"{str(e).splitlines()[0][:100]})") from None
    return out


def int8_format(path) -> str | None:
    """'msmodelslim' or 'compressed-tensors' when `path` is a W8A8 checkpoint directory of that format, else None
    (a config.json that cannot be read says nothing here: loading it refuses it, naming the problem)."""
    path = Path(path)
    if (path / MSMODELSLIM_JSON).is_file():
        return "msmodelslim"
    try:
        qc = read_json(path / "config.json", str(path)).get("quantization_config")
    except (OSError, ValueError):
        return None
    if isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors":
        return "compressed-tensors"
    return None


def quant_mode_of(path) -> str:
    """The patch_model quant mode an int8 checkpoint runs in: "w8a8_static" for msModelSlim's W8A8, else "w8a8"."""
    path = Path(path)
    try:
        if (path / MSMODELSLIM_JSON).is_file():
            return "w8a8_static" if read_json(path / MSMODELSLIM_JSON, str(path)).get("model_quant_type") == \
                W8A8_STATIC else "w8a8"
        groups = read_json(path / "config.json", str(path))["quantization_config"]["config_groups"]
        static = any(g["input_activations"]["dynamic"] is False and g["input_activations"]["strategy"] == "tensor"
                     for g in groups.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "w8a8"
    return "w8a8_static" if static else "w8a8"


def _model_dtype(where: str, config: dict, dtype: str):
    """The dtype to build the model in: `dtype`, else config.json's (`dtype`, or 4.x's `torch_dtype`), which is
    checked either way (a damaged config is refused, not overridden)."""
    name = config.get("dtype", config.get("torch_dtype"))
    got = torch.float32 if name is None else getattr(torch, name.replace("torch.", ""), None) \
        if isinstance(name, str) else None
    if got not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{where}: config.json dtype {name!r}; expected 'float32', 'bfloat16' or 'float16'")
    return got if dtype == "auto" else getattr(torch, dtype)


def load(path, backend: str = "auto", dtype: str = "auto", device: str = "cpu", **patch_options):
    """(model, processor, family, report): a compressed-tensors W8A8 checkpoint (written by `save` or by
    llm-compressor) or an msModelSlim W8A8_DYNAMIC one (quant_model_description.json) as a model patched in W8A8 mode whose int8 linears run the stored int8 weights and scales
    as they are (no re-quantisation) on the fused kernels. Every int8 linear's tensors are checked (dtype,
    shape, a scale per output channel) and a problem is refused naming the tensor, before the model is built.
    `patch_options` (sites, fuse_residual, cast_mode, strict) go to patch_model; which linears are int8 is the
    checkpoint's."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.initialization import no_init_weights

    from .. import models
    from ..patching.api import patch_model

    path = Path(path)
    where = f"checkpoint {path}"
    config_json = read_json(path / "config.json", where)
    tensors = _read_tensors(path, where)
    kind, ct_static = W8A8_DYNAMIC, False
    if (path / MSMODELSLIM_JSON).exists():
        kind = _check_description(where, read_json(path / MSMODELSLIM_JSON, where), tensors)
    else:
        ct_static = _check_scheme(where, config_json.get("quantization_config"))
    family = models.family(config_json.get("model_type"))
    torch_dtype = _model_dtype(where, config_json, dtype)
    tensors = _module_names(tensors, family)
    sidecar = read_json(path / SIDECAR, where) if (path / SIDECAR).exists() else {}
    static = _static_tensors(where, tensors) if kind == W8A8_STATIC else \
        _input_scales(where, tensors) if ct_static else {}
    scales = {k[:-len(".weight_scale")] for k in tensors if k.endswith(".weight_scale")}
    stored = {}
    for lin in sorted(scales):
        w, s = tensors.get(f"{lin}.weight"), tensors[f"{lin}.weight_scale"]
        if w is None:
            raise ValueError(f"{where}: tensor '{lin}.weight_scale' has no '{lin}.weight'")
        if w.dtype != torch.int8 or w.dim() != 2:
            raise ValueError(f"{where}: tensor '{lin}.weight' is {str(w.dtype).replace('torch.', '')} "
                             f"{list(w.shape)}; expected int8 [out, in]")
        if not s.is_floating_point() or tuple(s.shape) not in ((w.shape[0], 1), (w.shape[0],)):
            raise ValueError(f"{where}: tensor '{lin}.weight_scale' is {str(s.dtype).replace('torch.', '')} "
                             f"{list(s.shape)}; expected a float [{w.shape[0]}, 1] (one scale per output channel)")
        stored[lin] = (tensors.pop(f"{lin}.weight"), tensors.pop(f"{lin}.weight_scale").reshape(-1).to(torch.float32))
        _check_weight_scale(where, lin, *stored[lin], torch_dtype)
        if static:
            if lin not in static:
                raise ValueError(f"{where}: tensor '{lin}.deq_scale' is missing (a W8A8 static int8 linear has "
                                 f"{', '.join(STATIC_TENSORS)})")
            if len(static[lin]) == 2:  # compressed-tensors: the epilogue is derived from the scales and the bias
                continue
            deq, qb = static[lin][2:]
            for n, t in (("deq_scale", deq), ("quant_bias", qb)):
                if tuple(t.shape) != (w.shape[0],):
                    raise ValueError(f"{where}: tensor '{lin}.{n}' is {list(t.shape)}; expected [{w.shape[0]}] (one "
                                     f"per output channel of '{lin}.weight')")
            stored[lin] = (*stored[lin], deq, qb)
    for lin in sorted(set(static) - set(stored)):
        raise ValueError(f"{where}: tensor '{lin}.deq_scale' has no int8 '{lin}.weight' with its weight_scale")
    for name, t in tensors.items():
        if t.dtype == torch.int8:
            raise ValueError(f"{where}: tensor {name!r} is int8 but has no '{name.rpartition('.')[0]}.weight_scale'")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{where}: config.json is not a config transformers reads ({str(e).splitlines()[0][:120]})") \
            from None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    cls = AutoModelForImageTextToText if family.MULTIMODAL else AutoModelForCausalLM
    with no_init_weights():
        model = cls.from_config(config, dtype=torch_dtype)
    model.tie_weights()  # a tied lm_head is the embedding's tensor, written once
    expected = model.state_dict()
    for lin, (w_q, *_) in stored.items():
        if f"{lin}.weight" not in expected:
            raise ValueError(f"{where}: tensor '{lin}.weight' names no linear of this {config.model_type} model")
        if tuple(expected[f"{lin}.weight"].shape) != tuple(w_q.shape):
            raise ValueError(f"{where}: tensor '{lin}.weight' is {list(w_q.shape)}; the model's {lin} is "
                             f"{list(expected[f'{lin}.weight'].shape)}")
        tensors[f"{lin}.weight"] = w_q
    missing = sorted(set(expected) - set(tensors) - _tied_keys(model))
    if missing:
        raise ValueError(f"{where}: no tensor {missing[0]!r} ({len(missing)} of the model's tensors missing)")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise ValueError(f"{where}: tensor {extra[0]!r} names nothing in this {config.model_type} model")
    for name, t in tensors.items():  # msModelSlim writes biases in fp32: the model's own dtype, as before export
        if name in expected and t.is_floating_point() and t.dtype != expected[name].dtype:
            tensors[name] = t.to(expected[name].dtype)
    for lin in stored:  # placeholders of the model's dtype, so the state dict loads; replaced below
        tensors[f"{lin}.weight"] = torch.zeros(tensors[f"{lin}.weight"].shape, dtype=torch_dtype)
    model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()
    model = model.to(device).eval()
    for lin, (w_q, w_scale, *epilogue) in stored.items():  # the float weight is absent: only the int8 one exists
        module = model.get_submodule(lin)
        module._parameters["weight"] = torch.nn.Parameter(torch.empty(w_q.shape, dtype=torch_dtype, device="meta"),
                                                          requires_grad=False)
        module.__dict__[STORED] = tuple(t.to(device) for t in (w_q, w_scale, *epilogue))
        if lin in static:
            module.__dict__[STORED_STATIC] = tuple(t.to(device=device, dtype=torch_dtype) for t in static[lin][:2])
    tied = set(sidecar.get("quantised_from_float", ()))
    linears = {p for p, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    for p in sorted(tied):
        if p not in linears or p in stored:
            raise ValueError(f"{where}: {SIDECAR} names {p!r} as a linear quantised from its float table; the "
                             f"model has {'its int8 weight' if p in stored else 'no such linear'}")
    if not (path / MSMODELSLIM_JSON).exists():  # msModelSlim types every tensor (checked above); this, its ignore
        _check_ignore(where, config_json["quantization_config"].get("ignore", []), family, stored, tied, linears)
    float_paths = [p for p, m in model.named_modules() if isinstance(m, torch.nn.Linear) and p not in stored
                   and p not in tied]
    head = output_embedding(model)
    int8_head = head is not None and (head[0] in stored or head[0] in tied)
    report = patch_model(model, backend=backend, quant="w8a8_static" if static else "w8a8",
                         float_linears=float_paths or None,
                         int8_lm_head=int8_head, **patch_options)
    lost = [lin for lin in stored if quant_linear_of(model.get_submodule(lin)) is None]
    if lost:
        skipped = report.to_json()["w8a8"]["skipped_producers"]
        why = (f"its producer stays float: {skipped[0]['path']}: {skipped[0]['reason']}" if skipped else
               "no patched norm or MLP produces its rows: a `sites` selection that leaves them out?")
        raise ValueError(f"{where}: int8 linear {lost[0]} could not run int8 here ({why})")
    from ..models.common import TextProcessor
    from ..models.qwen2_5_vl import Processor

    return model, (Processor if family.MULTIMODAL else TextProcessor)(path), family, report


def _static_tensors(where: str, tensors: dict) -> dict:
    """{linear: (input_scale [1], input_offset [1], deq_scale fp32 [N], quant_bias int32 [N])} of an msModelSlim W8A8
    (static) checkpoint, popped from `tensors` and checked, a problem refused naming the tensor: every tensor of
    the four present, input_scale finite and > 0, input_offset an integer in int8's range, deq_scale fp32 (or
    int64 holding fp32 bits: fp16 models) finite and >= 0, quant_bias int32. A weight_scale the format does not
    require is derived as deq_scale / input_scale (msModelSlim's own inverse) where absent."""
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


def _input_scales(where: str, tensors: dict) -> dict:
    """{linear: (input_scale [1], input_zero_point [1])} of a compressed-tensors checkpoint with static per-tensor
    input activations, popped and checked (a missing scale, one that is not finite and > 0, a zero point that is
    not an int8 value) naming the tensor; a symmetric scheme's missing zero point is 0."""
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


def _check_weight_scale(where: str, lin: str, w_q, w_scale, dtype) -> None:
    """Scales the int8 kernels can run in `dtype`: finite, >= 0, normal (a subnormal scale is a damaged file), and
    small enough that a dequantised weight times an activation of the model's range stays finite (a finite but
    absurd 3e38 gave NaN logits); an all-zero linear loads, said once (a checkpoint with a linear zeroed out)."""
    name = f"{where}: tensor '{lin}.weight_scale'"
    if not torch.isfinite(w_scale).all() or (w_scale < 0).any():
        raise ValueError(f"{name} has values that are not finite and >= 0")
    tiny = torch.finfo(torch.float32).tiny
    if ((w_scale > 0) & (w_scale < tiny)).any():
        raise ValueError(f"{name} has subnormal values (below {tiny:.3g}): not a scale an int8 weight is written with")
    limit = torch.finfo(dtype).max ** 0.5  # weight x activation: each may take half of the dtype's range
    largest = float(w_scale.max()) * 127 if w_scale.numel() else 0.0
    if largest > limit:
        raise ValueError(f"{name}: a dequantised weight of up to {largest:.3g} overflows {str(dtype).replace('torch.', '')} "
                         f"in a product with the activations (expected |127 * scale| <= {limit:.3g})")
    if not w_q.any() or not w_scale.any():
        warnings.warn(f"{where}: int8 linear {lin} is all zeros (its weight or every scale): it outputs its bias only",
                      RuntimeWarning, stacklevel=3)


def _check_ignore(where: str, ignore: list, family, stored: dict, tied: set, linears: set) -> None:
    """quantization_config's `ignore` against the weights: a linear it keeps float has no int8 weight, and every
    other linear (its config group targets every Linear) has one, or is a tied one quantised from its table."""
    names = set(_module_names({f"{n}.weight": None for n in ignore if isinstance(n, str)}, family))
    ignored = {n[:-len(".weight")] for n in names}
    both = sorted(ignored & set(stored))
    if both:
        raise ValueError(f"{where}: quantization_config.ignore keeps {both[0]} float, but its weight is int8")
    missing = sorted(linears - ignored - set(stored) - tied)
    if missing:
        raise ValueError(f"{where}: {missing[0]} is not in quantization_config.ignore (the config group targets every "
                         f"Linear) but has no int8 weight")


def _module_names(tensors: dict, family) -> dict:
    """The tensors named by the module paths of the model transformers 5.x builds: a checkpoint in an older layout
    (family.LEGACY_NAMES: Qwen2.5-VL's `model.layers.*` and `visual.*`, which 5.x's save_pretrained writes and
    llm-compressor writes back as it read them), none of whose names is in the current one, is renamed whole."""
    current = tuple(replacement for _, replacement in family.LEGACY_NAMES)
    if not current or any(k.startswith(current) for k in tensors):
        return tensors
    renamed = {}
    for name, t in tensors.items():
        for pattern, replacement in family.LEGACY_NAMES:
            name = re.sub(pattern, replacement, name, count=1)
        renamed[name] = t
    return renamed


def _tied_keys(model) -> set:
    """State-dict keys of parameters tied to another (a tied lm_head): save_pretrained writes them once."""
    seen, tied = {}, set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(name)
        seen.setdefault(id(p), name)
    return tied
