"""Comparison metrics and the pass rule of SPEC 5, shared by tests, the case runner and benchmarks.

MERE/MARE are the mean/max relative error with a 1e-7 floor on the golden; the threshold T
depends on the output dtype. A rotation's outputs (rope, qk_norm_rope: kind "rotation") are relative to
the larger of |g| and the rms of g's head vector instead: an output near zero is a cancellation of two
products (x_i cos - x_j sin), where one ulp of the vector's scale (an fp32 norm summed in another order, as
the cpu qk_norm_rope's fp64 sum of squares is) is a large error relative to the output itself and a
negligible one for the rotated vector; a wrong element still errs by the vector's scale. An attention's
outputs (kind "mixture": softmax-weighted means of value rows) are judged the same way: an output near zero is
a cancellation of many weighted values, where the exps rounded to bf16 before the second product (as torch's
flash attention and the cpu kernel both do, on sums ordered differently) move it by a fraction of the head
vector's scale. Quantised outputs are judged by how many codes differ (at most 0.1%,
and at least one code is always allowed: a tie at .5 flipped by a last-bit difference of the row's
rms is not a defect even in a 100-element tensor) and by how much, and their scales by relative error.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

THRESHOLDS = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -13}
MIN_COSINE = 0.9999
QUANT_MAX_DIFF = 1
QUANT_MAX_FRACTION = 1e-3
SCALE_MAX_REL = 1e-5


@dataclass
class Comparison:
    name: str
    max_abs: float
    cosine: float
    mere: float
    mare: float
    passed: bool
    reason: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def _cosine(a: torch.Tensor, g: torch.Tensor) -> float:
    na, ng = a.norm(), g.norm()
    if na == 0 and ng == 0:
        return 1.0
    if na == 0 or ng == 0:
        return 0.0
    return float((a * g).sum() / (na * ng))


def compare(actual: torch.Tensor, golden: torch.Tensor, name: str = "output", kind: str | None = None) -> Comparison:
    """Compare one output against its golden under the rule for its kind: "codes" (integer outputs),
    "scale" (quantisation scales), "float" (the relative rule for its dtype), "rotation" (the same, relative
    to the head vector's scale near zero), "exact" (integer sums); by default the kind
    follows the dtype, and a name starting with "scale"."""
    if actual.shape != golden.shape:
        return Comparison(name, float("inf"), 0.0, float("inf"), float("inf"), False,
                          f"shape {tuple(actual.shape)} != golden {tuple(golden.shape)}")
    if actual.dtype != golden.dtype:
        return Comparison(name, float("inf"), 0.0, float("inf"), float("inf"), False,
                          f"dtype {actual.dtype} != golden {golden.dtype}")
    if golden.numel() == 0:
        return Comparison(name, 0.0, 1.0, 0.0, 0.0, True)
    a, g = actual.double(), golden.double()
    finite = torch.isfinite(g)
    bad_nan = bool((torch.isnan(a) & ~torch.isnan(g)).any())
    mismatch_nonfinite = bool((~finite & (a != g) & ~(torch.isnan(a) & torch.isnan(g))).any())
    a_f, g_f = a[finite], g[finite]
    diff = (a_f - g_f).abs()
    rel = diff / (g_f.abs() + 1e-7)
    if kind in ("rotation", "mixture"):  # relative to the larger of |g| and its vector's rms (module docstring)
        rms = g.nan_to_num(0, 0, 0).pow(2).mean(-1, keepdim=True).sqrt().expand_as(g)[finite]
        rel = diff / (torch.maximum(g_f.abs(), rms) + 1e-7)
    max_abs = float(diff.max()) if diff.numel() else 0.0
    mare = float(rel.max()) if rel.numel() else 0.0
    mere = float(rel.mean()) if rel.numel() else 0.0
    cos = _cosine(torch.nan_to_num(a_f), g_f)
    kind = kind or ("codes" if not golden.is_floating_point() else "scale" if name.startswith("scale") else "float")
    if kind == "exact":  # an integer accumulator: exact arithmetic has one answer
        n_diff = int((diff > 0).sum())
        ok = n_diff == 0 and a_f.numel() == a.numel()
        return Comparison(name, max_abs, cos, mere, mare, ok, "" if ok else f"{n_diff} sums differ, max |diff| {max_abs:g}")
    if kind == "codes":
        n_diff = int((diff > 0).sum())
        frac = n_diff / max(1, diff.numel())
        # at most 0.1% of the codes, and always one: a single rounding tie in a small tensor is not a defect
        ok = max_abs <= QUANT_MAX_DIFF and n_diff <= max(1, int(QUANT_MAX_FRACTION * diff.numel()))
        why = "" if ok else f"{n_diff} codes differ ({frac:.3%}), max |diff| {max_abs:g}"
        return Comparison(name, max_abs, cos, mere, mare, ok, why)
    if kind == "scale":
        ok = mare <= SCALE_MAX_REL and not bad_nan and not mismatch_nonfinite
        return Comparison(name, max_abs, cos, mere, mare, ok, "" if ok else f"scale rel err {mare:.2e}")
    T = THRESHOLDS[golden.dtype]
    reasons = []
    if mere >= T:
        reasons.append(f"MERE {mere:.2e} >= {T:.2e}")
    if mare >= 10 * T:
        reasons.append(f"MARE {mare:.2e} >= {10 * T:.2e}")
    if cos < MIN_COSINE:
        reasons.append(f"cosine {cos:.6f} < {MIN_COSINE}")
    if bad_nan:
        reasons.append("NaN where the golden has none")
    if mismatch_nonfinite:
        reasons.append("Inf/NaN pattern differs from the golden")
    return Comparison(name, max_abs, cos, mere, mare, not reasons, "; ".join(reasons))


def compare_outputs(actual, golden, outputs) -> list[Comparison]:
    """Compare matching tuples of outputs, skipping positions where both are None. `outputs` are names,
    or an op's output declarations (with their kinds)."""
    if isinstance(golden, torch.Tensor):
        actual, golden = (actual,), (golden,)
    out = []
    for spec, a, g in zip(outputs, actual, golden):
        name, kind = (spec, None) if isinstance(spec, str) else (spec.name, spec.kind)
        if a is None and g is None:
            continue
        if a is None or g is None:
            out.append(Comparison(name, float("inf"), 0.0, float("inf"), float("inf"), False,
                                  "one side is None"))
            continue
        out.append(compare(a, g, name, kind))
    return out
