"""`bench gemm` and `bench w8a8`: which int8 GEMM the cpu backend uses, and what W8A8 costs in accuracy.

gemm: every int8 GEMM torch ships for CPU, against bf16 `F.linear`, at decode (M=1) and prefill
(M=512) for K=2048 and N in {2048, 11008} (GutenOCR-3B's q/o and gate/up), interleaved.
Candidates: `ops.quant_matmul` on the cpu backend (its int32 GEMM is the cpu `int32_gemm`'s pick for
this CPU), the two int32 GEMMs it picks between with its epilogue (`torch._int_mm`; the cpu
kernels' int16 multiply-add GEMM, for CPUs without VNNI), each checked against the exact integer
product (a count of wrong sums, not only a time), oneDNN's `onednn.qlinear_pointwise` (inductor's int8 linear;
it wants uint8 activations with a zero point, so our int8 rows are shifted by 128 first, which is
timed), fbgemm's `quantized.linear_dynamic` (quantises fp32 input itself, per tensor: not the
per-row math of this toolkit) and `_weight_int8pack_mm` (int8 weights, bf16 activations: W8A16).

w8a8 (--llmcompressor PYTHON adds llm-compressor's recipe on the same models and calibration inputs, and
ours in its scope): logits of the same model in its float dtype vs W8A8 without and with SmoothQuant
smoothing, on the embedded checkpoint and at GutenOCR-3B's dimensions (random weights), each
also as an "outlier" variant whose norms have a few gamma channels scaled 30-100x (as real LLMs'
activations have). Calibration and evaluation use different prompts. With a recipe
(`float_linears`), a fourth column: SmoothQuant at alpha 0.5 with those linears kept in the model
dtype. With `sensitivity`, each outlier model again once per kind of linear kept float (the linears
reading one producer's rows go together): how much of the error each kind carries. Every calibrated row
also runs the static scheme (quant="w8a8_static", msModelSlim's W8A8: per-tensor activation scales and
offsets from the same calibration run) beside the dynamic one: its cosine and top-1 in the row's "static".
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from .. import hardware, ops
from ..quant import tune
from .timing import goal_line, header, interleaved_medians, save_plot, write_json

LLMC_LABEL = "llm-compressor SmoothQuant 0.5"  # its recipe on the bench's model and calibration inputs
LLMC_FIXTURE_LABEL = "llm-compressor (SmoothQuant 0.5)"  # tests/fixtures/llmcompressor_w8a8, text calibration
DECODER_ONLY = "alpha 0.5, decoder only"  # ours in llm-compressor's scope: the vision tower and lm_head float
DECODER_ONLY_FLOAT = "vision.*,text.lm_head"
CPU_BACKEND = "cpu backend quant_matmul"  # the cpu int32_gemm's pick for this CPU + the fused epilogue
GEMM_SHAPES = [(1, 2048, 2048), (1, 2048, 11008), (512, 2048, 2048), (512, 2048, 11008)]
# The MLP's gate and up projections (M, K, I): decode, text prefill, a vision tower's worth of patches.
GATE_UP_SHAPES = [(1, 2048, 11008), (512, 2048, 11008), (1024, 1280, 3420)]


def _gate_up_candidates(M, K, I):
    """gate_proj and up_proj as HF runs them (two GEMMs) vs one GEMM over the merged [2I, K] weight (vLLM's
    MergedColumnParallelLinear), whose halves feed swiglu as two views. The merged weight is a second copy
    here; a patch would have to make the module's two Parameters views of it."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=gen).bfloat16()
    wg, wu = (torch.randn(I, K, generator=gen) * 0.02).bfloat16(), (torch.randn(I, K, generator=gen) * 0.02).bfloat16()
    merged = torch.cat([wg, wu])
    F = torch.nn.functional
    return {"gate + up (two F.linear)": lambda: ops.swiglu(F.linear(x, wg), F.linear(x, wu), backend="cpu"),
            "merged gate_up (one F.linear)": lambda: ops.swiglu(*F.linear(x, merged).chunk(2, -1), backend="cpu")}


def _gemm_candidates(M, K, N):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=gen)
    w = torch.randn(N, K, generator=gen) * 0.02
    xb, wb = x.bfloat16(), w.bfloat16()
    x_q, x_s = ops.quantize.quantize_rows(x, "int8")
    w_q, w_s = ops.quantize.quantize_rows(w, "int8")
    fns = {"bf16 F.linear": lambda: torch.nn.functional.linear(xb, wb),
           "fp32 F.linear": lambda: torch.nn.functional.linear(x, w),
           CPU_BACKEND: lambda: ops.quant_matmul(x_q, w_q, x_s, w_s, out_dtype=torch.bfloat16, backend="cpu")}
    notes = {}
    from ..ops.registry import get

    ext = get("cpu").ext
    gemms = {CPU_BACKEND: lambda: ops.int32_gemm(x_q, w_q, backend="cpu"), "_int_mm + epilogue": lambda: torch._int_mm(x_q, w_q.t())}
    if ext is not None:  # the two int32 GEMMs the cpu int32_gemm picks between, with the same epilogue
        gemms["int16 madd GEMM + epilogue"] = lambda: ext.int8_gemm(x_q, w_q)
        fns["_int_mm + epilogue"] = lambda: ext.dequant(torch._int_mm(x_q, w_q.t()), x_s, w_s, None, torch.bfloat16)
        fns["int16 madd GEMM + epilogue"] = lambda: ext.dequant(ext.int8_gemm(x_q, w_q), x_s, w_s, None, torch.bfloat16)
    from ..ops.defs.quant_matmul import exact_product

    gold = exact_product(x_q, w_q).long()
    wrong = {name: int((gemm().long() != gold).sum()) for name, gemm in gemms.items()}  # entries off the exact sum
    try:
        packed = torch.ops.onednn.qlinear_prepack(w_q, [M, K])
        zp = torch.zeros(N, dtype=torch.int64)

        def onednn():
            xu = (x_q.to(torch.int16) + 128).to(torch.uint8)
            y = torch.ops.onednn.qlinear_pointwise.default(xu, 1.0, 128, packed, w_s, zp, None, 1.0, 0,
                                                           torch.float32, "none", [], "")
            return (y * x_s.unsqueeze(-1)).bfloat16()
        onednn()
        fns["onednn qlinear (u8 shift)"] = onednn
    except (RuntimeError, AttributeError) as e:
        notes["onednn qlinear (u8 shift)"] = str(e).splitlines()[0][:100]
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.backends.quantized.engine = "fbgemm"
            qw = torch.quantize_per_channel(w, w_s, torch.zeros(N, dtype=torch.long), 0, torch.qint8)
            prepacked = torch.ops.quantized.linear_prepack(qw, None)
        fns["fbgemm linear_dynamic (per tensor)"] = lambda: torch.ops.quantized.linear_dynamic(x, prepacked, True)
    except (RuntimeError, AttributeError) as e:
        notes["fbgemm linear_dynamic (per tensor)"] = str(e).splitlines()[0][:100]
    wb_scale = w_s.bfloat16()
    fns["_weight_int8pack_mm (W8A16)"] = lambda: torch._weight_int8pack_mm(xb, w_q, wb_scale)
    return fns, notes, wrong


def run_gemm(rounds: int, json_path, png_path) -> int:
    print(header("bench gemm"))
    results = []
    for M, K, N in GEMM_SHAPES:
        fns, notes, wrong = _gemm_candidates(M, K, N)
        med = interleaved_medians(fns, rounds=rounds, min_seconds=0.005)
        base = med["bf16 F.linear"]
        print(f"\nM={M} K={K} N={N}")
        for name, s in sorted(med.items(), key=lambda kv: kv[1]):
            check = "" if name not in wrong else "  exact" if not wrong[name] else f"  WRONG: {wrong[name]} of {M * N} sums"
            print(f"  {name:<36} {s * 1e6:10.1f} us   {base / s:6.2f}x bf16 F.linear{check}")
        for name, why in notes.items():
            print(f"  {name:<36} not run: {why}")
        results.append({"M": M, "K": K, "N": N, "us": {k: v * 1e6 for k, v in med.items()}, "not_run": notes,
                        "wrong_sums": wrong})
    merged = []
    print("\nbf16 gate_proj + up_proj + swiglu: HF's two GEMMs vs one merged GEMM")
    for M, K, I in GATE_UP_SHAPES:
        med = interleaved_medians(_gate_up_candidates(M, K, I), rounds=rounds, min_seconds=0.005)
        two, one = med["gate + up (two F.linear)"], med["merged gate_up (one F.linear)"]
        print(f"  M={M:<5} K={K} I={I}: two {two * 1e6:9.1f} us, merged {one * 1e6:9.1f} us ({two / one:.2f}x)")
        merged.append({"M": M, "K": K, "I": I, "us": {k: v * 1e6 for k, v in med.items()}})
    floats = "bf16 F.linear" if hardware.native_bf16() else "fp32 F.linear"  # the float model's dtype here
    ours = [r["us"][floats] / r["us"][CPU_BACKEND] for r in results]
    goals = [goal_line(min(ours) >= 1.0, f"cpu backend's int8 GEMM vs {floats}: {min(ours):.2f}x to "
                                         f"{max(ours):.2f}x (goal: no slower at any shape)"),
             goal_line(not any(r["wrong_sums"][CPU_BACKEND] for r in results),
                       "cpu backend's int32 GEMM equal to the exact integer product at every shape")]
    print("\n" + "\n".join(goals))
    write_json(json_path, {"bench": "gemm", "machine": hardware.capability(), "threads": torch.get_num_threads(),
                           "rounds": rounds, "results": results, "gate_up": merged, "goals": goals})
    print(f"JSON written to {json_path}")
    print(save_plot(png_path, lambda plt: _plot_gemm(plt, results)))
    return 0 if all(g.startswith("PASS") for g in goals) else 1


def _plot_gemm(plt, results):
    names = list(results[0]["us"])
    fig, ax = plt.subplots(figsize=(11, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar([j + i * width for j in range(len(results))],
               [r["us"]["bf16 F.linear"] / r["us"].get(name, float("nan")) for r in results], width, label=name)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(results))])
    ax.set_xticklabels([f"M={r['M']} K={r['K']} N={r['N']}" for r in results])
    ax.set_ylabel("speed vs bf16 F.linear (x, higher is faster)")
    ax.legend(fontsize=7)
    ax.set_title(f"int8 GEMMs on {hardware.cpu_model()}")
    return fig


# ---- accuracy -----------------------------------------------------------------------------------
EVAL_PROMPTS = list(tune.HELD_OUT_PROMPTS)
OUTLIER_FACTORS = (30.0, 50.0, 70.0, 100.0)
SMOOTHING = (None, 0.5, 0.75)  # no smoothing, SmoothQuant's default alpha, a stronger migration
KEEP_POSITIONS = tune.KEEP_POSITIONS


def inject_outliers(model) -> int:
    """Scale 4 gamma channels of every norm that feeds linears by 30-100x (fixed channels); returns how many norms."""
    from ..models import family_of
    from ..patching.rules.norm import NORMS

    n = 0
    with torch.no_grad():
        for cand in NORMS.candidates(model, None):
            if not cand.reason and cand.kind in family_of(model).w8a8_linears:
                D = cand.module.weight.shape[0]
                for j, f in zip((D // 7, D // 3, D // 2 + 1, D - 5), OUTLIER_FACTORS):
                    cand.module.weight[j] *= f
                n += 1
    return n


def _eval_logits(model, processor, inputs) -> list:
    from ..inference import open_image

    out = []
    with torch.inference_mode():
        for prompt, image in inputs:
            batch = processor([prompt], [open_image(image)], model)
            out.append(model(**batch, logits_to_keep=KEEP_POSITIONS).logits[0].float())
    return out


def compare(ref: list, got: list) -> dict:
    cos = torch.cat([torch.nn.functional.cosine_similarity(r, g, dim=-1) for r, g in zip(ref, got)])
    top1 = torch.cat([(r.argmax(-1) == g.argmax(-1)).float() for r, g in zip(ref, got)])
    return {"cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()), "top1_agreement": float(top1.mean()),
            "positions": int(cos.numel())}


def run_accuracy(quick: bool, json_path, png_path, recipe=None, sensitivity: bool = False, llmcompressor=None) -> int:
    from ..inference import default_dtype, generate, open_image
    from ..models.qwen2_5_vl import (
        CALIBRATION_PROMPTS,
        DOCUMENT_IMAGE,
        GUTENOCR_CONFIG,
        SAMPLE_IMAGE,
        TINY_DIR,
        load,
        random_model,
    )
    from ..patching import patched
    from ..quant import calibration

    print(header("bench w8a8"))
    dtype = default_dtype("cpu")
    images = [SAMPLE_IMAGE] if quick else [SAMPLE_IMAGE, DOCUMENT_IMAGE]
    eval_inputs = [(p, im) for p in EVAL_PROMPTS for im in images]
    calib_inputs = [(p, im) for p in CALIBRATION_PROMPTS[:2 if quick else 4] for im in images]
    processor = load(TINY_DIR, dtype)[1]
    builders = {"embedded checkpoint": lambda: load(TINY_DIR, dtype)[0]}
    layers = 1 if quick else 2
    builders[f"GutenOCR-3B dims ({layers} layers, {layers} blocks, random)"] = lambda: random_model(
        GUTENOCR_CONFIG, layers, layers, dtype)[0]
    rows = []
    for model_name, build in builders.items():
        for variant in ("plain", "outliers"):
            model = build()
            if variant == "outliers":
                inject_outliers(model)
            ref = _eval_logits(model, processor, eval_inputs)
            with calibration.Calibrator(model) as rec:
                for prompt, image in calib_inputs:
                    generate(model, processor, [prompt], [open_image(image)], 2)
            names = [f"{p} | {Path(i).name}" for p, i in calib_inputs]
            runs = [(_label(alpha), alpha, None) for alpha in SMOOTHING]
            runs += [(RECIPE, 0.5, recipe)] if recipe else []
            if sensitivity and variant == "outliers":
                runs += [(f"alpha 0.5, {kind} float", 0.5, kind) for kind in _linear_kinds(model)]
            runs += [(DECODER_ONLY, 0.5, DECODER_ONLY_FLOAT)] if llmcompressor else []
            with tempfile.TemporaryDirectory() as tmp:
                for label, alpha, keep in runs:
                    calib = None
                    if alpha is not None:
                        calib = Path(tmp) / f"smooth_{alpha}.safetensors"
                        if not calib.exists():
                            scales = calibration.smooth_scales(model, rec.absmax, alpha)
                            calibration.save(calib, scales, alpha, model.config.model_type, names, rec.ranges(scales))
                    with patched(model, backend="cpu", quant="w8a8", calibration=calib, float_linears=keep) as report:
                        got = _eval_logits(model, processor, eval_inputs)
                        s = report.to_json()["w8a8"]["summary"]
                    static = None  # the static scheme needs the calibration's ranges
                    if calib is not None:
                        with patched(model, backend="cpu", quant="w8a8_static", calibration=calib,
                                     float_linears=keep):
                            static = compare(ref, _eval_logits(model, processor, eval_inputs))
                    rows.append(_row(model_name, variant, label, dtype, keep, s, compare(ref, got), static))
            if variant == "outliers":  # the recipe found by measurement (quant/tune.py), in each scheme
                for scheme in ("dynamic", "static"):
                    rows.append(_tuned_row(model_name, model, processor, calib_inputs, eval_inputs, ref, dtype,
                                           scheme))
            if llmcompressor:
                s, scores = _llm_compressor_run(llmcompressor, model, processor, calib_inputs, eval_inputs, ref, dtype)
                rows.append(_row(model_name, variant, LLMC_LABEL, dtype, None, s, scores))
    if not llmcompressor:
        rows += _llm_compressor_rows(processor, eval_inputs, dtype)
    goals = []
    for r in rows:
        if r["smoothing"].startswith(TUNED):
            goals.append(goal_line(r["cosine_mean"] >= 0.99, f"{r['model']}, outliers, {r['smoothing']}: cosine "
                                                             f"{r['cosine_mean']:.4f} (goal >= 0.99) with "
                                                             f"{r['decoder_int8_share'] * 100:.1f}% of the decoder's "
                                                             f"linear weight bytes int8"))
    for model_name in builders:
        pick = {(r["variant"], r["smoothing"]): r for r in rows if r["model"] == model_name}
        n = pick[("outliers", _label(None))]
        for label in [_label(a) for a in SMOOTHING[1:]] + ([RECIPE] if recipe else []):
            s = pick[("outliers", label)]
            goals.append(goal_line(s["cosine_mean"] >= 0.99 and s["cosine_mean"] > n["cosine_mean"],
                                   f"{model_name}, outliers, {label}: cosine {s['cosine_mean']:.4f} (goal >= "
                                   f"0.99), without smoothing {n['cosine_mean']:.4f} (goal: smoothing better)"))
    print("\n" + "\n".join(goals))
    write_json(json_path, {"bench": "w8a8", "machine": hardware.capability(), "eval_inputs": len(eval_inputs),
                           "calibration_inputs": len(calib_inputs), "keep_positions": KEEP_POSITIONS,
                           "outlier_factors": OUTLIER_FACTORS, "recipe": recipe, "rows": rows, "goals": goals})
    print(f"JSON written to {json_path}")
    print(save_plot(png_path, lambda plt: _plot_accuracy(plt, rows)))
    return 0 if all(g.startswith("PASS") for g in goals) else 1


RECIPE = "alpha 0.5 + float_linears"
TUNED = "tuned recipe"


def _tuned_row(model_name, model, processor, calib_inputs, eval_inputs, ref, dtype, scheme) -> dict:
    """`pypto-gym tune`'s recipe for this model (target 0.99) in `scheme`, run on the bench's held-out inputs."""
    from ..inference import generate, open_image
    from ..patching import patched

    def calibrate():
        for prompt, image in calib_inputs:
            generate(model, processor, [prompt], [open_image(image)], 2)

    with tempfile.TemporaryDirectory() as tmp:
        recipe = Path(tmp) / "recipe.safetensors"
        found = tune.tune(model, lambda: _eval_logits(model, processor, eval_inputs), calibrate, 0.99, scheme,
                          out=recipe, log=lambda line: None)
        mode = "w8a8_static" if scheme == "static" else "w8a8"
        with patched(model, backend="cpu", quant=mode, calibration=recipe) as report:
            scores = compare(ref, _eval_logits(model, processor, eval_inputs))
            s = report.to_json()["w8a8"]["summary"]
    row = _row(model_name, "outliers", f"{TUNED} ({scheme})", dtype, found["float_groups"] or None, s, scores)
    row["decoder_int8_share"] = found["decoder_int8_share"]
    return row
LLMC_FIXTURE = Path(__file__).resolve().parent.parent.parent / "tests" / "fixtures" / "llmcompressor_w8a8"


def _row(model_name, variant, label, dtype, keep, summary, scores, static=None) -> dict:
    """One row of the accuracy table (the dynamic scheme; `static`: the static scheme's scores), printed as it is
    measured."""
    row = {"model": model_name, "variant": variant, "smoothing": label, "dtype": dtype, "float_linears": keep,
           "int8_linears": f"{summary['int8']}/{summary['linears']}", **scores, "static": static}
    beside = ("static: needs a calibration" if static is None else
              f"static: cosine {static['cosine_mean']:.5f} top-1 {static['top1_agreement'] * 100:5.1f}%")
    print(f"{model_name:<46} {variant:<9} {label:<28} {row['int8_linears']:>5} int8  "
          f"cosine mean {row['cosine_mean']:.5f} min {row['cosine_min']:.5f} "
          f"top-1 {row['top1_agreement'] * 100:5.1f}% ({row['positions']} positions) | {beside}", flush=True)
    return row


def _llm_compressor_run(python, model, processor, calib_inputs, eval_inputs, ref, dtype):
    """(W8A8 summary, scores) of llm-compressor's SmoothQuant 0.5 + W8A8 recipe on this very float model, calibrated
    on the batches pypto-gym's calibration ran (the processor's tensors, images included), in its own environment
    (scripts/make_llmcompressor_fixture.py), and run by pypto-gym from the checkpoint it writes."""
    import subprocess

    from ..inference import open_image
    from ..quant import export

    script = Path(__file__).resolve().parents[2] / "scripts" / "make_llmcompressor_fixture.py"
    if not script.is_file():
        raise FileNotFoundError(f"--llmcompressor: {script} is not here (a source checkout has it)")
    with tempfile.TemporaryDirectory() as tmp:
        src, out, inputs = Path(tmp) / "float", Path(tmp) / "llmc", Path(tmp) / "inputs.pt"
        model.save_pretrained(src)
        processor.save_pretrained(src)
        torch.save([{k: v for k, v in processor([p], [open_image(i)], None).items() if isinstance(v, torch.Tensor)}
                    for p, i in calib_inputs], inputs)
        done = subprocess.run([str(python), str(script), "--source", str(src), "--out", str(out), "--inputs",
                               str(inputs)], capture_output=True, text=True)
        if done.returncode:
            tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"llm-compressor ({python}) failed: {tail}")
        loaded, _, _, report = export.load(out, backend="cpu", dtype=dtype)
        return report.to_json()["w8a8"]["summary"], compare(ref, _eval_logits(loaded, processor, eval_inputs))


def _llm_compressor_rows(processor, eval_inputs, dtype) -> list:
    """The embedded checkpoint as llm-compressor quantised it (its SmoothQuant + W8A8 recipe; the decoder int8,
    the vision tower and lm_head float: tests/fixtures/llmcompressor_w8a8), run by pypto-gym from its stored
    int8 weights, against the float model; absent in an install without the tests folder."""
    from ..models.qwen2_5_vl import TINY_DIR, load
    from ..quant import export

    if not (LLMC_FIXTURE / "config.json").is_file():
        return []
    ref = _eval_logits(load(TINY_DIR, dtype)[0], processor, eval_inputs)
    model, _, _, report = export.load(LLMC_FIXTURE, backend="cpu", dtype=dtype)
    s = report.to_json()["w8a8"]["summary"]
    return [_row("embedded checkpoint", "plain", LLMC_FIXTURE_LABEL, dtype, None, s,
                 compare(ref, _eval_logits(model, processor, eval_inputs)))]


def _label(alpha) -> str:
    return "no smoothing" if alpha is None else f"alpha {alpha}"


def _linear_kinds(model) -> list:
    """Every kind of linear of the model, one per group kept float together (q_proj stands for k_proj and
    v_proj: they read one norm's rows)."""
    from ..quant.linear import linear_kind

    by_kind = {}
    for path, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            by_kind.setdefault(linear_kind(path), []).append(m)
    groups = {}
    for kind in sorted(by_kind):
        producers = frozenset(id(_producer_group(model, m)) for m in by_kind[kind])
        groups.setdefault(producers, kind)
    return list(groups.values())


def _producer_group(model, linear):
    """The module whose rows `linear` reads together with its siblings (a norm or an MLP), else itself."""
    from ..patching.rules.norm import NORMS
    from ..quant.topology import linears_after

    for cand in NORMS.candidates(model, None):
        if not cand.reason and any(m is linear for _, m in linears_after(model, cand)[0]):
            return cand.module
    return linear


def _plot_accuracy(plt, rows):
    rows = [r for r in rows if not r["smoothing"].endswith(" float")]  # the sensitivity runs are in the JSON
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    labels = [f"{r['model'].split(' (')[0]}\n{r['variant']}, {r['smoothing']}" for r in rows]
    palette = {_label(a): c for a, c in zip(SMOOTHING, ("tab:red", "tab:green", "tab:olive"))}
    palette[RECIPE] = "tab:blue"
    palette.update({LLMC_FIXTURE_LABEL: "tab:purple", LLMC_LABEL: "tab:purple", DECODER_ONLY: "tab:cyan",
                    f"{TUNED} (dynamic)": "tab:orange", f"{TUNED} (static)": "tab:brown"})
    colors = [palette[r["smoothing"]] for r in rows]
    axes[0].bar(range(len(rows)), [1 - r["cosine_mean"] for r in rows], color=colors)
    axes[0].set_yscale("log")
    axes[0].axhline(0.01, color="k", lw=0.8, ls="--")
    axes[0].set_ylabel("1 - logits cosine (lower is better; dashed: goal)")
    axes[1].bar(range(len(rows)), [r["top1_agreement"] * 100 for r in rows], color=colors)
    axes[1].set_ylabel("top-1 agreement with the float model (%)")
    for ax in axes:
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, fontsize=6, rotation=60, ha="right")
    fig.suptitle("W8A8 vs the float model: no smoothing (red), SmoothQuant alpha 0.5 (green) and 0.75 (olive), "
                 "alpha 0.5 with the recipe's float linears (blue)")
    return fig
