"""Apply a W8A8 plan (plan.py's `decide`) to a patched model, and undo it: the producers of int8 rows, the int8
linears and their hand-over, the merged gate/up GEMM, the static scheme's folds, the released float weights; the
result (`QuantPlan`) is what the patch report shows and what unpatch undoes.
"""
from __future__ import annotations

import warnings

import torch

from .. import hardware
from ..kernels.cpu import quant_matmul
from ..patching.rules.layer_norm import LayerNormSite
from ..patching.rules.mlp import MlpSite
from ..patching.rules.norm import NormSite
from ..patching.site import SLOT
from .gelu_mlp import QuantGeluMlp
from .linear import QuantLinear, quant_linear_of
from .mlp import QuantMlp
from .plan import Plan, decide


class QuantPlan:
    """What W8A8 did to a patched model: quant norms, int8 linears, and every linear left in float."""

    def __init__(self, plan: Plan):
        self.calibration = plan.calibration
        self.sites = plan.sites
        self.norms: dict = {}  # site path -> QuantNorm
        self.mlps: dict = {}  # site path -> QuantMlp
        self.gelu_mlps: dict = {}  # site path -> QuantGeluMlp
        self.linears: list[QuantLinear] = []
        self.folded_norms: list = []  # float norm sites holding a static consumer's smooth scale (weight_fold)
        self.float_linears: list[dict] = []
        self.skipped_producers: list[dict] = plan.skipped_producers
        self.calibration_ignored: list[str] = plan.calibration_ignored  # the file's entries not quantised here
        self.float_reasons: dict = plan.float_reasons  # linear path -> why it stays in the model dtype
        self.speed_note: str | None = None  # said once at patch time where the int8 GEMM has no fast path
        self.int8_gemm: str | None = None  # which exact int32 GEMM the CPU's int8 linears run (ops.int32_gemm)
        self.scheme = plan.scheme  # "dynamic" or "static"
        self.recipe: dict | None = plan.recipe  # the tuned recipe the calibration file held (quant/tune.py)

    def unpatch_refusal(self) -> str | None:
        """Why unpatch_model cannot restore the float model (its weights were released), else None."""
        released = [ql.path for ql in self.linears if ql.released_bytes]
        stored = [ql.path for ql in self.linears if ql.stored]
        if stored:
            return (f"{len(stored)} int8 linears (e.g. {stored[0]}) were loaded from an int8 checkpoint: there are no "
                    f"float weights to restore")
        if not released:
            return None
        return (f"the float weights of {len(released)} int8 linears (e.g. {released[0]}) were released "
                f"(release_float_weights=True): the float model cannot be restored; load it again instead")

    def uninstall(self) -> None:
        for ql in self.linears:
            ql.uninstall()
        for site in self.sites:
            site.quant = None
        for site in self.folded_norms:
            site.weight_fold = None

    def to_json(self) -> dict:
        rows = [ql.row() for ql in self.linears] + [dict(r) for r in self.float_linears]
        q = [r for r in rows if r["became"] == "w8a8"]
        return {"mode": "w8a8" if self.scheme == "dynamic" else "w8a8_static", "scheme": self.scheme,
                "calibration": self.calibration, "recipe": self.recipe, "smoothing": self.calibration is not None,
                "summary": {"linears": len(rows), "int8": len(q), "float": len(rows) - len(q),
                            "quant_norms": len(self.norms), "quant_mlps": len(self.mlps) + len(self.gelu_mlps),
                            "handed_over": sum(r["handed_over"] for r in q),
                            "quantized_here": sum(r["quantized_here"] for r in q),
                            "fallbacks": sum(sum(r["fallbacks"].values()) for r in q),
                            "float_weight_bytes": sum(r["float_weight_bytes"] for r in q),
                            "releasable_float_bytes": sum(r["float_weight_bytes"] for r in q
                                                          if not r["float_weight_shared"]),
                            "released_float_bytes": sum(ql.released_bytes for ql in self.linears),
                            "loaded_int8": sum(ql.stored for ql in self.linears),
                            "int8_weight_bytes": sum(r["int8_weight_bytes"] for r in q)},
                "speed_note": self.speed_note, "int8_gemm": self.int8_gemm, "skipped_producers": [dict(r) for r in self.skipped_producers],
                "calibration_ignored": list(self.calibration_ignored), "linears": rows}


_said: list = []  # the no-fast-path note, once per process


def install(model, state, scheme: str = "dynamic") -> QuantPlan:
    """The "w8a8" and "w8a8_static" quantisation modes of patch_model: decide (plan.py), then apply."""
    return apply(model, decide(model, state, scheme))


def apply(model, plan: Plan) -> QuantPlan:
    """Install `plan` on the model; returns what was done (its uninstall undoes it). A failure half-way undoes what
    was installed before it raises."""
    done = QuantPlan(plan)
    backend, scheme = plan.backend, plan.scheme
    try:
        for p in plan.producers:
            producer = p.kind(p.inv_smooth, p.static)
            p.site.quant = producer
            kinds = {QuantMlp: done.mlps, QuantGeluMlp: done.gelu_mlps}
            kinds.get(p.kind, done.norms)[p.site.path] = producer
            for path, linear in p.linears:
                _add(done, path, linear, producer, backend, p.why)
        for p in plan.producers:  # an MLP whose gate and up read one norm's rows: one int32 GEMM over both weights
            site = p.site
            if isinstance(site, MlpSite) and scheme == "dynamic":
                gate, up = quant_linear_of(site.module.gate_proj), quant_linear_of(site.module.up_proj)
                if gate is not None and up is not None and gate.source is not None and gate.source is up.source \
                        and (gate.module.bias is None) == (up.module.bias is None):
                    site.quant.merge(gate, up)
        for o in plan.own:
            _add(done, o.path, o.linear, None, backend, o.why, o.inv_smooth, o.static)
        if scheme == "static":
            _fold_static_smoothing(model, done)
    except BaseException:
        done.uninstall()
        raise
    still_needed = {p.data_ptr() for m in model.modules() if quant_linear_of(m) is None
                    for p in m.parameters(recurse=False)}
    for ql in done.linears:  # a tied weight (lm_head = embed_tokens) stays in memory for its other user
        ql.float_weight_shared = ql.module.weight.data_ptr() in still_needed
    if plan.release_float_weights:
        for ql in done.linears:
            if not ql.float_weight_shared:
                ql.release()
    on_cpu = any(ql.module.weight.device.type in ("cpu", "meta") for ql in done.linears)
    if on_cpu and backend in ("auto", "cpu"):
        done.int8_gemm = quant_matmul.which_int32_gemm()  # decided here, by a self-test of torch._int_mm where it could run
    if on_cpu and backend in ("auto", "cpu") and not quant_matmul.int_mm_is_exact() and hardware.best_isa() == "generic":
        done.speed_note = (f"this CPU ({hardware.cpu_model()}) has neither int8 dot-product instructions (VNNI, AMX) "
                           f"nor AVX2: its int8 GEMM has no fast path, so the int8 linears are exact but slower than "
                           f"the float model's")
        if not _said:
            _said.append(done.speed_note)
            warnings.warn(f"pypto-gym W8A8: {done.speed_note}", RuntimeWarning, stacklevel=3)
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and quant_linear_of(module) is None:
            done.float_linears.append({
                "path": path, "in_features": module.in_features, "out_features": module.out_features,
                "became": str(module.weight.dtype).replace("torch.", ""),
                "input": done.float_reasons.get(path, "not the rows of a patched norm or MLP"),
                "smoothed": False, "backend": None, "calls": 0, "ran_on": {}, "fallbacks": {}, "handed_over": 0,
                "quantized_here": 0, "float_weight_bytes": module.weight.numel() * module.weight.element_size(),
                "float_weight_shared": False, "float_weight_released": False, "int8_weight_bytes": 0})
    return done




def _fold_static_smoothing(model, plan) -> None:
    """Static scheme: fold each smooth scale into the int8 linear that writes the rows it scales, as an export does
    (quant/fold.py): an MLP's into up_proj's deq_scale, an own-input linear's into its source linear's (v_proj, the
    vision qkv), or a float norm's weight and bias (the merger's ln_q, Qwen3-VL's vision LayerNorms: weight_fold); so
    what runs is what the checkpoint holds. Where that writer is neither (a float linear) the smooth scale stays in
    static_quant (the NPU's npu_quantize takes none: such a linear is declined there)."""
    from .fold import folds, source_factor

    for path, mlp in plan.mlps.items():
        up = quant_linear_of(model.get_submodule(path).up_proj)
        if mlp.inv_smooth is not None and up is not None and up.static is not None:
            up.fold_output(mlp.inv_smooth.detach().float())
            mlp.smooth_folded = True
    sources = folds(model)
    for ql in plan.linears:
        fold = sources.get(ql.path)
        if ql.source is not None or ql.inv_smooth is None or fold is None:
            continue
        src = quant_linear_of(fold.source)
        site = fold.source.__dict__.get(SLOT)
        if src is not None and src.static is not None:
            src.fold_output(source_factor(ql.inv_smooth, fold))
            ql.smooth_folded = True
        elif isinstance(site, (NormSite, LayerNormSite)) and getattr(site, "quant", None) is None:
            # a float norm (ln_q, Qwen3-VL's vision LayerNorms): its weight (and bias), per call
            site.weight_fold = source_factor(ql.inv_smooth, fold).to(fold.source.weight.device)
            plan.folded_norms.append(site)
            ql.smooth_folded = True


def _add(plan, path, linear, source, backend, why, inv_smooth=None, static=None) -> None:
    if quant_linear_of(linear) is not None:  # one module reachable twice (a shared or tied linear)
        return
    ql = QuantLinear(path, linear, source, backend, why, inv_smooth, static)
    ql.install()
    plan.linears.append(ql)
    if source is not None:
        source.consumers.append(path)
        source.consumer_modules.append(linear)
