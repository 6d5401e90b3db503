"""Writing a W8A8-patched model as a checkpoint of one format (compressed_tensors.py, msmodelslim.py)."""
from __future__ import annotations

import json

import torch

from ..linear import quant_linear_of
from ..plan import output_embedding
from . import compressed_tensors, msmodelslim
from .checkpoint import SIDECAR, check_out_dir, staging

_WRITERS = {m.NAME: m for m in (compressed_tensors, msmodelslim)}
FORMATS = tuple(_WRITERS)
LM_HEAD_CONSUMERS = {name: m.LM_HEAD_CONSUMER for name, m in _WRITERS.items()}  # who loads an int8 lm_head of each


def save(model, out_dir, processor=None, format: str = "compressed-tensors", text_only: bool = False) -> dict:
    """Write the W8A8-patched `model` (and its processor/tokenizer) to `out_dir` as a compressed-tensors or an
    msModelSlim checkpoint (W8A8_DYNAMIC, or W8A8 for a model patched with quant="w8a8_static"); returns
    {"int8": [paths], "ignore": [paths], "lm_head": "float" | "int8"}. Refused, before anything is written, for a
    model that is not patched in W8A8 mode or a scale that cannot fold. Smoothing is folded (the package's
    docstring). Everything is written into a temporary folder beside `out_dir`, renamed to it at the end: an
    interrupted or failed export leaves nothing (no config.json without its quantization_config, which transformers
    would load as a float model of int8 codes).

    `text_only`: a vision-language model's decoder alone, as the text-only model its family names
    (Family.text_only_config: Qwen3-VL's is Qwen3ForCausalLM), its tensors renamed from `model.language_model.*` to
    `model.*`, the vision tower left out, the tokenizer without the image processor: what vLLM's text engines
    serve, computing what the model computes on a text-only prompt."""
    from ... import models
    from ...patching.api import _STATE_ATTR

    if format not in FORMATS:
        raise ValueError(f"format: got {format!r}; expected one of {', '.join(map(repr, FORMATS))}")
    fmt = _WRITERS[format]
    family = models.family_of(model)
    if text_only and text_only_refusal(family):
        raise ValueError(f"text_only: {text_only_refusal(family)}")
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
        tensors[f"{ql.path}.weight"] = ql.w_q.contiguous()
        tensors[f"{ql.path}.weight_scale"] = ql.w_scale.reshape(-1, 1).to(torch.float32).contiguous()
        tensors.update(fmt.linear_tensors(ql, static))
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
    fmt.stored_forms(state_dict, plan)
    head = output_embedding(model)
    lm_head = "int8" if head is not None and quant_linear_of(head[1]) is not None else "float"
    writer = model
    if text_only:
        writer = _text_model(model, family.text_only_config(model.config))
        state_dict = {_decoder_name(k): v for k, v in state_dict.items() if _decoder_name(k) is not None}
        int8, ignore, tied = ([_decoder_name(p) for p in paths if _decoder_name(p) is not None]
                              for paths in (int8, ignore, tied))
        processor = getattr(processor, "tokenizer", processor)
    with staging(out) as tmp:
        writer.save_pretrained(tmp, state_dict=state_dict, max_shard_size="1000GB")  # one weights file
        (tmp / SIDECAR).write_text(json.dumps({"format": "pypto_gym-export-1", "quantised_from_float": tied},
                                              indent=2) + "\n")
        fmt.write(tmp, int8, ignore, static)
        if processor is not None:
            processor.save_pretrained(tmp)
    return {"int8": int8, "ignore": sorted(ignore), "lm_head": lm_head}


def text_only_refusal(family) -> str | None:
    """Why `family` (a models.Family, or None: unknown) has no text-only export, or None when it has one."""
    from ... import models

    if family is not None and family.text_only_config is not None:
        return None
    having = [f.name for f in models.FAMILIES.values() if f.text_only_config is not None]
    return (f"the {family.name if family else 'unknown'} family has no text-only export (families with one: "
            f"{', '.join(having)})")


LANGUAGE_MODEL = "model.language_model."  # where a vision-language model's decoder is (transformers 5.x's layout)


def _decoder_name(name: str) -> str | None:
    """A tensor or module name of a vision-language model in its text-only model (`model.language_model.x` ->
    `model.x`, `lm_head` as it is), or None: not part of the decoder (the vision tower)."""
    if name.startswith(LANGUAGE_MODEL):
        return "model." + name[len(LANGUAGE_MODEL):]
    return name if name == "lm_head" or name.startswith("lm_head.") else None


def _text_model(model, config):
    """The text-only model of `config` without weights (meta tensors): what writes its config, its generation config
    (the model's) and, from the state dict given, its weights file."""
    import copy

    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        text = AutoModelForCausalLM.from_config(config)
    text.generation_config = copy.deepcopy(model.generation_config)
    return text


def _smoothing_factors(model, plan) -> dict:
    """{state-dict name: fp32 factor per output channel}: every smooth scale of the plan folded into what writes
    the rows it scales (quant/fold.py); an int8 linear's factor goes to its weight_scale, a float one's to its
    weight rows, with its bias either way."""
    from ..fold import folds, source_factor

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
