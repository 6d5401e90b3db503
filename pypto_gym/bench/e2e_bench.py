"""`bench e2e`: what the swap buys end to end, at GutenOCR-3B's (or `--config`'s: Qwen3-VL-2B's) dimensions with reduced
depth.

One random-weight bf16 model (no download) runs generate on a document-sized image (or `--model`: any
family's checkpoint); variants (unpatched, patched torch, patched cpu: every site, norms only (no MLP
or rotary fusion), and no residual fusion) are patched onto the same model in turn and measured
round-robin (A B C D A B C D ...), so machine noise hits all of them alike. Per variant: patch time,
vision-encoder time, prefill latency (vision included), decode tokens/s, and the process's peak RSS
during the run (reset before each run on Linux).
With `--quant w8a8` a W8A8 variant joins (goal: its decoder layers decode >= 1.5x the unpatched float model's,
the float lm_head's time, timed alone, taken out of both: at reduced depth a 151,936-row lm_head is most of a
token's weight reads, at the real depth a small share), and the
weight bytes a W8A8 deployment needs are reported next to the float model's. `--quant w8a8_static` adds the
static scheme (msModelSlim's W8A8) beside the dynamic one, both from one calibration run on the bench's own
input (alpha 0.5), with the goal that static is no slower than dynamic. Goals are decided on at least three
interleaved rounds of the default run; `--quick` or fewer rounds print FIGURE lines (the ratio and the goal, no
verdict).
"""
from __future__ import annotations

import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch

from .. import config, hardware
from ..kernels.cpu import quant_matmul
from ..models.qwen2_5_vl import DOCUMENT_IMAGE, GUTENOCR_CONFIG
from ..patching import patch_model, unpatch_model
from .timing import goal_line, header, save_plot, write_json

VARIANTS = {
    "unpatched": None,
    "patched torch": {"backend": "torch"},
    "patched cpu": {"backend": "cpu"},
    "patched cpu, norms only": {"backend": "cpu", "sites": ["*norm*", "*ln_q"]},
    "patched cpu, no fusion": {"backend": "cpu", "fuse_residual": False},
}


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _peak_rss_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class _VisionClock:
    """Times the vision encoder through forward hooks on the model's vision tower."""

    def __init__(self, model):
        self.total = 0.0
        tower = next(m for n, m in model.named_modules() if n.endswith("visual"))
        self._handles = [tower.register_forward_pre_hook(self._start), tower.register_forward_hook(self._stop)]

    def _start(self, *args):
        self._t0 = time.perf_counter()

    def _stop(self, *args):
        self.total += time.perf_counter() - self._t0

    def remove(self):
        for h in self._handles:
            h.remove()


W8A8_VARIANT = "patched cpu, W8A8"
STATIC_VARIANT = "patched cpu, W8A8 static"
_REPEATED = (re.compile(r"\.layers\.\d+\."), re.compile(r"\.blocks\.\d+\."))  # a decoder layer, a vision block


def _unit(path: str) -> int:
    """0 for a parameter of a decoder layer, 1 of a vision block, 2 for the rest (embedding, merger, norms)."""
    return next((i for i, r in enumerate(_REPEATED) if r.search(path)), 2)


def full_depth_ratio(model, w8a8: dict, layers: int, blocks: int, depth: tuple) -> float:
    """Deployed W8A8 weight bytes / float weight bytes, the embedding excluded from both, projected from this
    reduced-depth model to `depth` = (decoder layers, vision blocks): bytes per layer and per block as measured
    here (float parameters; each int8 linear's int8 bytes in place of its released float ones, plus the int8 copy
    of a tied one), the rest once."""
    emb = model.get_input_embeddings().weight
    float_bytes, delta = [0, 0, 0], [0, 0, 0]
    for path, p in model.named_parameters():
        if p is not emb:
            float_bytes[_unit(path)] += p.numel() * p.element_size()
    for r in w8a8["linears"]:
        if r["became"] == "w8a8":
            delta[_unit(r["path"] + ".")] += r["int8_weight_bytes"] - (0 if r["float_weight_shared"]
                                                                        else r["float_weight_bytes"])
    scale = (depth[0] / layers, depth[1] / blocks, 1)
    full = sum(b * k for b, k in zip(float_bytes, scale))
    return (full + sum(d * k for d, k in zip(delta, scale))) / full


MIN_VERDICT_ROUNDS = 3


def goal_lines(verdicts: bool):
    """goal_line, or where the run is too short to decide a goal (--quick, fewer rounds) a FIGURE line: the measured
    ratio and the goal, no PASS or FAIL."""
    if verdicts:
        return goal_line
    return lambda ok, text: f"FIGURE  {text}"


def lm_head_seconds(model, calls: int = 21) -> float:
    """Median seconds of the output projection alone on one token's hidden state (the float lm_head both variants
    run at decode)."""
    head = model.get_output_embeddings()
    x = torch.randn(1, 1, head.weight.shape[1], dtype=head.weight.dtype)
    times = []
    with torch.inference_mode():
        for _ in range(calls):
            t = time.perf_counter()
            head(x)
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def decoder_layers_speedup(base_tps: float, tps: float, head_s: float) -> float | None:
    """How much faster a token's decoder layers run: (1 / base_tps - head) / (1 / tps - head), the lm_head's time
    (the same float GEMM in both) taken out of each token's; None where the lm_head alone takes a token's time."""
    base, other = 1 / base_tps - head_s, 1 / tps - head_s
    return base / other if base > 0 and other > 0 else None


def run(num_layers=4, vision_depth=4, repeats=3, new_tokens=16, image=None, quick=False, json_path=None,
        png_path=None, dtype=None, quant=None, model_path=None, config_path=None) -> int:
    """Random weights at a committed config's dimensions (GutenOCR-3B's unless `config_path`, e.g. Qwen3-VL-2B's),
    reduced to `num_layers` and `vision_depth`, or with `model_path` a checkpoint of any known family (a text
    family runs its first calibration prompt, no image)."""
    from .. import models
    from ..inference import default_dtype, generate, open_image

    if quick:
        num_layers, vision_depth, repeats, new_tokens = 2, 2, 2, 8
    dtype = dtype or default_dtype("cpu")
    config.set_enabled(True)
    print(header("bench e2e"))
    t0 = time.perf_counter()
    config_path = Path(config_path or GUTENOCR_CONFIG)
    dims = config_path.parent.name  # gutenocr_3b, qwen3_vl_2b
    if model_path is None:
        family = models.family(json.loads(config_path.read_text())["model_type"])
        model, processor = family.random_model(config_path, num_layers, vision_depth, dtype)
        what, multimodal = (f"{config_path.parent.name} dims ({family.name}), {num_layers} text layers, "
                            f"{vision_depth} vision blocks, random weights", True)
        prompt = "Read the text in the image."
    else:
        model, processor, family = models.load(model_path, dtype)
        what, multimodal = f"{model_path} ({family.name})", family.multimodal
        prompt = family.calibration_prompts[0]
    load_s = time.perf_counter() - t0
    img = open_image(image or DOCUMENT_IMAGE) if multimodal else None
    print(f"{what}, {dtype}: loaded in {load_s:.1f} s; "
          f"{f'image {img.size[0]}x{img.size[1]}' if img else 'no image'}; {new_tokens} new tokens; "
          f"{repeats} interleaved rounds; {torch.get_num_threads()} threads", flush=True)
    generate(model, processor, [prompt], [img], 2)  # warm-up: allocator, kernel build/load
    variants = dict(VARIANTS)
    scratch = tempfile.TemporaryDirectory()
    if quant == "w8a8_static":  # both schemes from one calibration (static needs its ranges)
        calib = _calibrate(model, processor, prompt, img, Path(scratch.name) / "calibration.safetensors")
        variants[W8A8_VARIANT] = {"backend": "cpu", "quant": "w8a8", "calibration": calib}
        variants[STATIC_VARIANT] = {"backend": "cpu", "quant": "w8a8_static", "calibration": calib}
    elif quant:
        variants[W8A8_VARIANT] = {"backend": "cpu", "quant": quant}
    samples = {name: [] for name in variants}
    embedding = model.get_input_embeddings().weight
    weights = {"float_model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
               "embedding_bytes": embedding.numel() * embedding.element_size()}
    for r in range(repeats):
        for name, opts in variants.items():
            tp = time.perf_counter()
            if opts:
                report = patch_model(model, **opts)
                if opts.get("quant"):
                    w8a8 = report.to_json()["w8a8"]
                    q = w8a8["summary"]
                    weights["w8a8_deployed_bytes"] = (weights["float_model_bytes"] - q["releasable_float_bytes"]
                                                      + q["int8_weight_bytes"])
                    if model_path is None:
                        raw = json.loads(config_path.read_text())
                        layers = raw.get("num_hidden_layers") or raw["text_config"]["num_hidden_layers"]
                        weights["full_depth"] = full_depth = (layers, raw["vision_config"]["depth"])
                        weights["deployed_vs_float_without_embedding_full_depth"] = full_depth_ratio(
                            model, w8a8, num_layers, vision_depth, full_depth)
            patch_s = time.perf_counter() - tp
            clock = _VisionClock(model) if img else None
            _reset_peak_rss()
            try:
                _, n_new, prefill_s, tps = generate(model, processor, [prompt], [img], new_tokens)
            finally:
                if clock:
                    clock.remove()
                unpatch_model(model)
            samples[name].append({"patch_s": patch_s, "vision_s": clock.total if clock else 0.0,
                                  "prefill_s": prefill_s,
                                  "decode_tokens_per_s": tps, "peak_rss_mb": _peak_rss_mb(), "new_tokens": n_new})
            print(f"  round {r + 1}/{repeats} {name:<26} prefill {prefill_s * 1e3:8.1f} ms  "
                  f"decode {tps:6.2f} tok/s", flush=True)
    med = {name: {k: statistics.median(s[k] for s in v) for k in v[0]} for name, v in samples.items()}
    columns_width = max(24, *map(len, med))
    base = med["unpatched"]
    columns = (f"{'variant':<{columns_width}} {'patch ms':>9} {'vision ms':>10} {'prefill ms':>11} {'vs unpatched':>13} "
               f"{'decode tok/s':>13} {'vs unpatched':>13} {'peak RSS MB':>12}")
    print("\n" + columns + "\n" + "-" * len(columns))
    for name, m in med.items():
        m["prefill_speedup"] = base["prefill_s"] / m["prefill_s"]
        m["decode_speedup"] = m["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        print(f"{name:<{columns_width}} {m['patch_s'] * 1e3:>9.1f} {m['vision_s'] * 1e3:>10.1f} {m['prefill_s'] * 1e3:>11.1f} "
              f"{m['prefill_speedup']:>12.3f}x {m['decode_tokens_per_s']:>13.2f} {m['decode_speedup']:>12.3f}x "
              f"{m['peak_rss_mb']:>12.0f}")
    cpu = med["patched cpu"]
    verdicts = not quick and repeats >= MIN_VERDICT_ROUNDS
    goal_line = goal_lines(verdicts)
    goals = [goal_line(cpu["prefill_speedup"] >= 1.0, f"patched cpu prefill {cpu['prefill_speedup']:.3f}x unpatched "
                                                      f"(goal: no slower)"),
             goal_line(cpu["decode_speedup"] >= 1.0, f"patched cpu decode {cpu['decode_speedup']:.3f}x unpatched "
                                                     f"(goal: no slower)")]
    if img is not None:  # a page: the vision tower (its window attention one call per block) and the first token
        for m in med.values():
            m["text_prefill_s"] = m["prefill_s"] - m["vision_s"]
        vision = base["vision_s"] / cpu["vision_s"]
        print(f"text prefill (prefill minus vision): unpatched {base['text_prefill_s'] * 1e3:.1f} ms, patched cpu "
              f"{cpu['text_prefill_s'] * 1e3:.1f} ms")
        goals.append(goal_line(vision >= 1.5, f"patched cpu vision tower {vision:.3f}x unpatched (goal: >= 1.5x)"))
        goals.append(goal_line(cpu["prefill_speedup"] >= 1.3, f"patched cpu time to first token "
                                                              f"{cpu['prefill_speedup']:.3f}x unpatched (goal: >= 1.3x)"))
    if quant:
        w = med[W8A8_VARIANT]
        emb = weights["embedding_bytes"]
        weights["deployed_vs_float_without_embedding"] = ratio = \
            (weights["w8a8_deployed_bytes"] - emb) / (weights["float_model_bytes"] - emb)
        gemm = quant_matmul.which_int32_gemm()
        head_s = lm_head_seconds(model)
        w["decode_layers_speedup"] = layers = decoder_layers_speedup(base["decode_tokens_per_s"],
                                                                     w["decode_tokens_per_s"], head_s)
        print(f"decode per token: unpatched {1e3 / base['decode_tokens_per_s']:.2f} ms, W8A8 "
              f"{1e3 / w['decode_tokens_per_s']:.2f} ms, of which the float lm_head (timed alone) {head_s * 1e3:.2f} ms: "
              f"at {num_layers if model_path is None else 'this'} depth it is a large share of a token, at full depth "
              f"a small one")
        goals.append(goal_line(layers is not None and layers >= 1.5,
                               f"W8A8 decode of the decoder layers {layers or float('nan'):.3f}x the unpatched {dtype} "
                               f"model's (token time minus the float lm_head's, timed alone; goal: >= 1.5x; {gemm})"))
        print(f"W8A8 decode of the whole token {w['decode_speedup']:.3f}x the unpatched model's (a figure: the float "
              f"lm_head is the same in both)")
        goals.append(goal_line(w["prefill_speedup"] >= 1.2, f"W8A8 prefill {w['prefill_speedup']:.3f}x the unpatched "
                                                            f"{dtype} model (goal: >= 1.2x; {gemm})"))
        goals.append(goal_line(ratio <= 0.55, f"W8A8 weights {ratio:.3f}x the {dtype} model's, the embedding "
                                              f"({emb / 2 ** 20:.0f} MB) excluded from both (goal: <= 0.55x)"))
        if quant == "w8a8_static":
            s = med[STATIC_VARIANT]
            for phase, key in (("decode", "decode_speedup"), ("prefill", "prefill_speedup")):
                goals.append(goal_line(s[key] >= w[key], f"W8A8 static {phase} {s[key]:.3f}x, dynamic {w[key]:.3f}x "
                                                         f"the unpatched model (goal: static no slower)"))
        if "full_depth" in weights:
            layers, blocks = weights["full_depth"]
            full = weights["deployed_vs_float_without_embedding_full_depth"]
            goals.append(goal_line(full <= 0.55, f"W8A8 weights projected to {dims}'s {layers} layers and {blocks} "
                                                 f"vision blocks from the per-layer bytes measured here: {full:.3f}x, "
                                                 f"the embedding excluded (goal: <= 0.55x)"))
        print(f"\nweights: {dtype} model {weights['float_model_bytes'] / 2 ** 20:.0f} MB; a W8A8 deployment "
              f"(release_float_weights=True) holds {weights['w8a8_deployed_bytes'] / 2 ** 20:.0f} MB (int8 linears + "
              f"the rest in {dtype}, the tied embedding and lm_head's table kept once; {ratio:.3f}x without the "
              f"{emb / 2 ** 20:.0f} MB embedding); the W8A8 variant's RSS above also holds the float copies kept for "
              f"unpatch_model, which the interleaved rounds need")
    if not verdicts:
        goals.append(f"no verdicts: {'--quick' if quick else f'{repeats} rounds'} (a goal is decided on at least "
                     f"{MIN_VERDICT_ROUNDS} interleaved rounds of the default depth: one disturbed round of two "
                     f"flipped decode from 2.9x to 0.997x)")
    print("\n" + "\n".join(goals))
    scratch.cleanup()
    result = {"bench": "e2e", "model": str(model_path) if model_path else f"{dims} dims", "dtype": dtype,
              "num_layers": num_layers, "weights": weights,
              "vision_depth": vision_depth, "machine": hardware.capability(),
              "image": list(img.size) if img else None, "new_tokens": new_tokens, "repeats": repeats, "load_s": load_s,
              "threads": torch.get_num_threads(), "medians": med, "samples": samples, "goals": goals}
    if json_path:
        write_json(json_path, result)
        print(f"JSON written to {json_path}")
    if png_path:
        print(save_plot(png_path, lambda plt: _plot(plt, med, f"{dims} dims (reduced depth)" if model_path is None
                                                    else str(model_path))))
    return 0 if not any(g.startswith("FAIL") for g in goals) else 1


def _calibrate(model, processor, prompt, img, path) -> Path:
    """A calibration file (smooth scales at alpha 0.5 and activation ranges) from generate on the bench's input."""
    from ..inference import generate
    from ..quant import calibration

    with calibration.Calibrator(model) as rec:
        generate(model, processor, [prompt], [img], 2)
    scales = calibration.smooth_scales(model, rec.absmax, 0.5)
    calibration.save(path, scales, 0.5, model.config.model_type, [prompt], rec.ranges(scales))
    return path


def _plot(plt, med, what):
    names = list(med)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].bar(names, [med[n]["prefill_s"] * 1e3 for n in names], color="tab:blue")
    axes[0].bar(names, [med[n]["vision_s"] * 1e3 for n in names], color="tab:orange", label="vision encoder")
    axes[0].set_ylabel("prefill ms (median)")
    axes[0].legend()
    axes[1].bar(names, [med[n]["decode_tokens_per_s"] for n in names], color="tab:green")
    axes[1].set_ylabel("decode tokens/s (median)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=25)
    fig.suptitle(f"{what}, CPU: {hardware.cpu_model()}")
    return fig
