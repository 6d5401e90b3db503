"""Reading a W8A8 checkpoint of either format onto the fused kernels: the int8 weights and scales run as stored."""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from ..linear import STORED, STORED_STATIC, quant_linear_of
from ..plan import output_embedding
from . import compressed_tensors, msmodelslim
from .checkpoint import SIDECAR, module_names, read_json, read_tensors, tied_keys

DETECTION_ORDER = (msmodelslim, compressed_tensors)  # msModelSlim's description file decides first


def _format_of(path: Path):
    return next((m for m in DETECTION_ORDER if m.is_checkpoint(path)), None)


def int8_format(path) -> str | None:
    """'msmodelslim' or 'compressed-tensors' when `path` is a W8A8 checkpoint directory of that format, else None
    (a config.json that cannot be read says nothing here: loading it refuses it, naming the problem)."""
    fmt = _format_of(Path(path))
    return None if fmt is None else fmt.NAME


def quant_mode_of(path) -> str:
    """The patch_model quant mode an int8 checkpoint runs in: "w8a8_static" for a static scheme, else "w8a8"."""
    fmt = _format_of(Path(path))
    return "w8a8_static" if fmt is not None and fmt.is_static(Path(path)) else "w8a8"


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
    llm-compressor) or an msModelSlim W8A8_DYNAMIC or W8A8 one (quant_model_description.json) as a model patched in
    W8A8 mode whose int8 linears run the stored int8 weights and scales as they are (no re-quantisation) on the
    fused kernels. Every int8 linear's tensors are checked (dtype, shape, a scale per output channel) and a problem
    is refused naming the tensor, before the model is built. `patch_options` (sites, fuse_residual, cast_mode,
    strict) go to patch_model; which linears are int8 is the checkpoint's."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.initialization import no_init_weights

    from ... import models
    from ...patching.api import patch_model

    path = Path(path)
    where = f"checkpoint {path}"
    config_json = read_json(path / "config.json", where)
    tensors = read_tensors(path, where)
    # a description file that is not a regular file is msModelSlim's and refused by its check, naming it
    fmt = msmodelslim if (path / msmodelslim.MSMODELSLIM_JSON).exists() else compressed_tensors
    is_static = fmt.check(where, path, config_json, tensors)
    family = models.family(config_json.get("model_type"))
    torch_dtype = _model_dtype(where, config_json, dtype)
    tensors = module_names(tensors, family)
    sidecar = read_json(path / SIDECAR, where) if (path / SIDECAR).exists() else {}
    static = fmt.static_inputs(where, tensors) if is_static else {}
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
                                 f"{', '.join(msmodelslim.STATIC_TENSORS)})")
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
    cls = AutoModelForImageTextToText if family.multimodal else AutoModelForCausalLM
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
    missing = sorted(set(expected) - set(tensors) - tied_keys(model))
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
    fmt.check_float_linears(where, config_json, family, stored, tied, linears)
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
    from ...models.common import TextProcessor
    from ...models.qwen2_5_vl import Processor

    return model, (Processor if family.multimodal else TextProcessor)(path), family, report


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
        raise ValueError(f"{name}: a dequantised weight of up to {largest:.3g} overflows "
                         f"{str(dtype).replace('torch.', '')} in a product with the activations (expected "
                         f"|127 * scale| <= {limit:.3g})")
    if not w_q.any() or not w_scale.any():
        warnings.warn(f"{where}: int8 linear {lin} is all zeros (its weight or every scale): it outputs its bias only",
                      RuntimeWarning, stacklevel=3)
