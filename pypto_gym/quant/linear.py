"""QuantLinear: an nn.Linear whose forward runs the int8 GEMM (`ops.quant_matmul`) on int8 weights.

As with a patched norm, only the module's instance `forward` changes (patching/swap.py): its float
weight stays the registered Parameter (state_dict, save_pretrained and unpatching see the model as it was), and
the int8 copy lives here. The switch (USE_PTO_RMS_NORM / config.set_enabled) turns the float
path back on without unpatching.
"""
from __future__ import annotations

import functools

import torch

from .. import config, ops
from ..ops import Stats
from ..ops.quantize import quantize_rows
from ..patching.site import SwappedForward, part
from . import activations

_SLOT = "_pypto_gym_quant_linear"
STORED = "_pypto_gym_stored_int8"  # (w_q, w_scale) of a linear loaded from an int8 checkpoint (export.load)
_STATE = config.STATE
WEIGHT_CHUNK_ROWS = 4096  # quantise weights a slice at a time: lm_head's fp32 copy would be ~1.2 GB at once


def quantize_weight(weight: torch.Tensor, smooth: torch.Tensor | None = None):
    """Per-output-channel symmetric int8 of weight * smooth (smooth scales the input channels):
    (w_q [N, K] int8, w_scale [N] fp32), the same per-row rule the activations use."""
    N, K = weight.shape
    w_q = torch.empty(N, K, dtype=torch.int8, device=weight.device)
    w_scale = torch.empty(N, dtype=torch.float32, device=weight.device)
    for i in range(0, N, WEIGHT_CHUNK_ROWS):
        w = weight[i:i + WEIGHT_CHUNK_ROWS].detach().to(torch.float32)
        w_q[i:i + WEIGHT_CHUNK_ROWS], w_scale[i:i + WEIGHT_CHUNK_ROWS] = quantize_rows(
            w if smooth is None else w * smooth, "int8")
    return w_q, w_scale


def linear_kind(path: str) -> str:
    """`text.q_proj`, `vision.qkv`, `text.lm_head`, `vision.mlp.0`: where an int8 linear is, for reports and cases."""
    parts = path.split(".")
    name = ".".join(parts[-2:]) if parts[-1].isdigit() else parts[-1]
    return f"{part(path)}.{name}"


class QuantLinear(SwappedForward):
    """One int8 linear: where it is, whose int8 rows it reads (`source`, an activations.Producer, or None: it
    quantises its input itself, smoothed by its own `inv_smooth`), counters."""

    SLOT = _SLOT

    def __init__(self, path: str, module: torch.nn.Linear, source, backend: str, why: str, inv_smooth=None):
        super().__init__(module)
        self.path, self.source, self.why = path, source, why
        self.backend = backend
        # what a float input is multiplied by before it is quantised here: the producer's 1/s (rows that
        # escaped) or this linear's own; the weight is quantised from W * s with s = exactly 1 / inv_smooth
        self.inv_smooth = source.inv_smooth if source is not None else inv_smooth
        smooth = None if self.inv_smooth is None else 1.0 / self.inv_smooth.float()
        stored = module.__dict__.get(STORED)  # loaded from an int8 checkpoint: used as it is
        if stored is not None and smooth is not None:
            raise ValueError(f"{path}: its int8 weight was loaded from a checkpoint (smoothing, if any, is folded "
                             f"into it); a calibration file cannot apply")
        self.stored = stored is not None
        self.w_q, self.w_scale = stored if stored is not None else quantize_weight(module.weight, smooth)
        if self.stored:
            self.keep_meta_weight_on_apply()
        self._quantised_from = self._float_weight_now()
        self.merged_into = None  # the QuantMlp whose one gate/up GEMM holds this weight (quant/mlp.py)
        self.requantised = 0  # times the float weight changed after patching and was quantised again
        self.stats = Stats(site=linear_kind(path))  # a recorder files its quant_matmul calls under it
        self.float_weight_shared = False  # the float weight is also another module's (tied embeddings)
        self.handed_over = 0  # calls that took the norm's int8 rows as they were
        self.quantized_here = 0  # calls that quantised their float input per row
        self.released_bytes = 0  # the float weight's bytes, once release() dropped it

    def _float_weight_now(self):
        """What says the float weight is the one quantised: the Parameter, its version counter (in-place edits:
        load_state_dict, no_grad updates), its storage, and a strided sample of its values (an edit through
        `.data`, as peft's LoRA merge does, bumps no version counter)."""
        w = self.module._parameters["weight"]
        sample = None if w.is_meta or w.dim() != 2 else w[::max(1, w.shape[0] // 4), ::max(1, w.shape[1] // 4)]
        return w, w._version, w.data_ptr(), sample, None if sample is None else sample.clone()

    def refresh(self) -> None:
        """Quantise the weight again if the float one changed since (a load_state_dict, a LoRA merge, a new
        Parameter): the int8 copy is not a snapshot of the weight at patch time. Eager calls only (a version
        counter is not traceable; a compiled graph is compiled against the weights it saw). An edit through
        `.data` is seen where it changes the sampled values (any dense update does; a single element off the
        sample is not)."""
        w = self.module._parameters["weight"]
        was, version, ptr, sample, values = self._quantised_from
        if w is was and w._version == version and w.data_ptr() == ptr and (sample is None or
                                                                              torch.equal(sample, values)):
            return
        if self.stored or self.released_bytes:
            raise RuntimeError(f"{self.path}: its float weight was replaced after patching, but this int8 linear "
                               f"{'was loaded from an int8 checkpoint' if self.stored else 'released its float weight'}"
                               f": there is nothing to quantise it from; load or patch the model again")
        smooth = None if self.inv_smooth is None else 1.0 / self.inv_smooth.float()
        self.w_q, self.w_scale = quantize_weight(w, smooth)
        self._quantised_from = self._float_weight_now()
        self.requantised += 1
        if self.merged_into is not None:
            self.merged_into.remerge()

    def release(self) -> None:
        """Drop the float weight (a deployment): the module's `weight` becomes a meta tensor of its shape and
        dtype, so nothing holds the float data; the float forward (unpatch, the switch) is then impossible."""
        w = self.module._parameters["weight"]
        self.released_bytes = w.numel() * w.element_size()
        self.module._parameters["weight"] = torch.nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"),
                                                               requires_grad=False)
        self._quantised_from = self._float_weight_now()
        self.keep_meta_weight_on_apply()

    def keep_meta_weight_on_apply(self) -> None:
        """`model.cpu()`, `.to("cpu")`, `.float()` work on a model whose int8 linears have no float weight (the meta
        tensor standing for it cannot be copied): this module's `_apply` leaves it out and makes a new one of the
        target dtype; a move to another device than the int8 weight's is refused, saying so."""
        self.module.__dict__["_apply"] = functools.partial(_apply_without_float_weight, self.module)

    def apply_without_float_weight(self, fn, recurse: bool):
        module = self.module
        w = module._parameters["weight"]
        target = fn(torch.empty(0, dtype=w.dtype, device=self.w_q.device))
        if target.device != self.w_q.device:
            raise RuntimeError(f"{self.path}: this int8 linear has no float weight and its int8 one is on "
                               f"{self.w_q.device}; moving it to {target.device} is not supported (load or patch the "
                               f"model there)")
        module._parameters["weight"] = None
        try:
            type(module)._apply(module, fn, recurse)  # the bias, buffers, children
        finally:
            module._parameters["weight"] = torch.nn.Parameter(
                torch.empty(w.shape, dtype=target.dtype, device="meta"), requires_grad=False)
            self._quantised_from = self._float_weight_now()
        return module

    def row(self) -> dict:
        m, stats = self.module, self.stats
        return {"path": self.path, "in_features": m.in_features, "out_features": m.out_features, "became": "w8a8",
                "input": self.why, "smoothed": self.inv_smooth is not None,
                "backend": stats.backend or self.backend, "calls": self.handed_over + self.quantized_here,
                "ran_on": dict(stats.ran),  # op calls: quant_matmul, and dynamic_quant where quantised here
                "fallbacks": dict(stats.fallbacks), "handed_over": self.handed_over,
                "quantized_here": self.quantized_here, "requantised": self.requantised,
                "float_weight_bytes": m.weight.numel() * m.weight.element_size(),
                "float_weight_shared": self.float_weight_shared, "float_weight_released": self.released_bytes > 0,
                "int8_weight_bytes": self.w_q.numel() + 4 * self.w_scale.numel()}


def quant_linear_forward(module, x):
    """The forward of every QuantLinear: the producer's int8 rows if they were handed over, else x quantised here."""
    ql = module.__dict__[_SLOT]
    if not _STATE.enabled:
        if ql.released_bytes or ql.stored:
            why = ("was never loaded (an int8 checkpoint)" if ql.stored
                   else "was released (release_float_weights=True)")
            raise RuntimeError(f"{ql.path}: pypto-gym is switched off (USE_PTO_RMS_NORM=0 / set_enabled(False)) but "
                               f"this int8 linear's float weight {why}: there is no float path to run; switch it "
                               f"on, or load the float model")
        return ql.original(x)
    counted = not torch.compiler.is_compiling()  # a counter read inside a graph is a guard: eager calls only
    if counted:
        ql.refresh()
    got = None if ql.source is None else activations.handed_over(x, ql.source)
    if got is None:
        if isinstance(x, (activations.QuantRows, activations.TracedRows)):
            x = x.value()  # escaped, or another norm's rows: quantise the float values they stand for
        q, scale = ops.dynamic_quant(x, ql.inv_smooth, backend=ql.backend, stats=ql.stats)
        if counted:
            ql.quantized_here += 1
    else:
        q, scale = got
        if counted:
            ql.handed_over += 1
    return ops.quant_matmul(q, ql.w_q, scale, ql.w_scale, module.bias, out_dtype=x.dtype, backend=ql.backend,
                            stats=ql.stats)


QuantLinear.FORWARD = quant_linear_forward


def _apply_without_float_weight(module, fn, recurse=True):
    """nn.Module._apply of an int8 linear without a float weight (QuantLinear.keep_meta_weight_on_apply)."""
    return module.__dict__[_SLOT].apply_without_float_weight(fn, recurse)


def quant_linear_of(module) -> QuantLinear | None:
    return module.__dict__.get(_SLOT)
