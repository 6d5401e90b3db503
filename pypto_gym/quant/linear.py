"""QuantLinear: an nn.Linear whose forward runs the int8 GEMM (`ops.quant_matmul`) on int8 weights.

In the static scheme (msModelSlim's W8A8) its input is int8 under one static scale s_x and offset o (its
producer's, or its own for a linear that quantises its input: `ops.static_quant`) and it runs
`ops.quant_matmul_static` with deq_scale = s_x * w_scale and quant_bias = rint(bias / deq_scale) - o * sum_k w_q:
the tensors the format stores (`static_epilogue`), so what runs in memory is what an export holds.

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
from ..kinds import kind
from ..patching.site import SwappedForward
from . import activations

_SLOT = "_pypto_gym_quant_linear"
STORED = "_pypto_gym_stored_int8"  # (w_q, w_scale[, deq_scale, quant_bias]) of a linear loaded from an int8 checkpoint
#                                    (export.load; the static scheme's epilogue as stored)
STORED_STATIC = "_pypto_gym_stored_static"  # (input_scale [1], input_offset [1]) of a loaded static int8 linear
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


INT32 = (-2 ** 31, 2 ** 31 - 1)


def static_epilogue(w_q, w_scale, scale, offset, bias, path: str):
    """(deq_scale fp32 [N], quant_bias int32 [N]) of a static int8 linear, as msModelSlim derives them: deq_scale =
    f32(scale) * w_scale; quant_bias = rint(f32(bias) / deq_scale) - offset * sum_k w_q[n, k] (the offset's
    correction and the bias in the integer domain). A quant_bias outside int32 is refused, naming the linear."""
    deq = scale.reshape(()).to(torch.float32).cpu() * w_scale.to(torch.float32).cpu()
    correction = offset.reshape(()).to(torch.float64).cpu() * w_q.to(torch.float64).sum(1).cpu()
    qb = -correction
    if bias is not None:
        safe = torch.where(deq == 0, torch.ones_like(deq), deq)
        qb = qb + torch.where(deq == 0, torch.zeros_like(deq), torch.round(bias.detach().float().cpu() / safe))
    if qb.numel() and (qb.min() < INT32[0] or qb.max() > INT32[1]):
        j = int(((qb < INT32[0]) | (qb > INT32[1])).nonzero()[0, 0])
        raise ValueError(f"{path}: quant_bias channel {j} is {float(qb[j]):.4g}, outside int32 (bias "
                         f"{float(bias[j]) if bias is not None else 0.0:.4g} over deq_scale {float(deq[j]):.4g})")
    return deq.to(w_q.device), qb.to(torch.int32).to(w_q.device)


def linear_kind(path: str) -> str:
    """`text.q_proj`, `vision.qkv`, `text.lm_head`, `vision.mlp.0`: where an int8 linear is, for reports and cases."""
    parts = path.split(".")
    name = ".".join(parts[-2:]) if parts[-1].isdigit() else parts[-1]
    return kind(path, name)


class QuantLinear(SwappedForward):
    """One int8 linear: where it is, whose int8 rows it reads (`source`, an activations.Producer, or None: it
    quantises its input itself, smoothed by its own `inv_smooth`), counters."""

    SLOT = _SLOT

    def __init__(self, path: str, module: torch.nn.Linear, source, backend: str, why: str, inv_smooth=None,
                 static=None):
        super().__init__(module)
        # the static scheme: (scale [1], offset [1]) its int8 input stands under: its producer's, or its own
        self.static = source.static if source is not None else static
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
        self.w_q, self.w_scale = stored[:2] if stored is not None else quantize_weight(module.weight, smooth)
        if self.stored:
            self.keep_meta_weight_on_apply()
        self._quantised_from = self._float_weight_now()
        self.deq_base = self.quant_bias = None  # static: deq_scale before any fold, and the int32 bias
        self.out_fold = None  # static: a consumer's smoothing folded into this linear's output (fold_output)
        self.smooth_folded = False  # static: its own input's smoothing is folded into its source's output
        if self.static is not None and stored is not None and len(stored) == 4:
            self.deq_base, self.quant_bias = stored[2:]
        elif self.static is not None:
            self.deq_base, self.quant_bias = static_epilogue(self.w_q, self.w_scale, *self.static, module.bias, path)
        self.deq_scale = self.deq_base
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
        `.data`, as peft's LoRA merge does, bumps no version counter). The sample is a view of the detached weight:
        a view of the Parameter itself is an autograd node, which copy.deepcopy of the model refuses."""
        w = self.module._parameters["weight"]
        sample = None if w.is_meta or w.dim() != 2 else \
            w.detach()[::max(1, w.shape[0] // 4), ::max(1, w.shape[1] // 4)]
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
        if self.static is not None:
            self.deq_base, self.quant_bias = static_epilogue(self.w_q, self.w_scale, *self.static, self.module.bias,
                                                             self.path)
            self.fold_output(None)
        self._quantised_from = self._float_weight_now()
        self.requantised += 1
        if self.merged_into is not None:
            self.merged_into.remerge()

    def fold_output(self, factor) -> None:
        """Static scheme: multiply this linear's output channels by `factor` (fp32 [N], a consumer's 1/s) through its
        deq_scale, as an export folds it (deq_scale * factor, one fp32 multiply): what runs in memory is then what
        the checkpoint holds. None re-applies the factors so far (after `refresh`)."""
        if factor is not None:
            f = factor.to(torch.float32).cpu()
            self.out_fold = f if self.out_fold is None else self.out_fold * f
        if self.out_fold is not None:
            self.deq_scale = (self.deq_base.float() * self.out_fold.to(self.deq_base.device)).to(torch.float32)
        else:  # no fold: the scale is deq_base itself (after `refresh`, the new one: the old left new codes mis-scaled)
            self.deq_scale = self.deq_base

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
                "int8_weight_bytes": self.w_q.numel() + 4 * self.w_scale.numel(),
                **({"scheme": "static"} if self.static is not None else {})}


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
        if ql.static is not None:
            smooth = None if ql.smooth_folded else ql.inv_smooth
            q, scale = ops.static_quant(x, *ql.static, smooth, backend=ql.backend, stats=ql.stats), None
        else:
            q, scale = ops.dynamic_quant(x, ql.inv_smooth, backend=ql.backend, stats=ql.stats)
        if counted:
            ql.quantized_here += 1
    else:
        q, scale = got
        if counted:
            ql.handed_over += 1
    if ql.static is not None:
        return ops.quant_matmul_static(q, ql.w_q, ql.deq_scale, ql.quant_bias, out_dtype=x.dtype, backend=ql.backend,
                                       stats=ql.stats)
    return ops.quant_matmul(q, ql.w_q, scale, ql.w_scale, module.bias, out_dtype=x.dtype, backend=ql.backend,
                            stats=ql.stats)


QuantLinear.FORWARD = quant_linear_forward


def _apply_without_float_weight(module, fn, recurse=True):
    """nn.Module._apply of an int8 linear without a float weight (QuantLinear.keep_meta_weight_on_apply)."""
    return module.__dict__[_SLOT].apply_without_float_weight(fn, recurse)


def quant_linear_of(module) -> QuantLinear | None:
    return module.__dict__.get(_SLOT)
