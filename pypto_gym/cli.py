"""`pypto-gym` console entry point; `scripts/*.py` are thin aliases of its subcommands."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


from .capture.cases import MAX_ELEMENTS


BENCH_OUT = Path("out") / "bench"  # scratch: benchmarks never overwrite committed figures unless told to


class UserError(Exception):
    """A problem with what the user passed: printed as one line, no traceback."""


class Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (no usage block) and exit status 2, like every other refusal."""

    def error(self, message):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _int_at_least(low: int):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"got {text!r}; expected an integer >= {low}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"got {value}; expected an integer >= {low}")
        return value
    parse.__name__ = f"integer >= {low}"
    return parse


POSITIVE, NON_NEGATIVE = _int_at_least(1), _int_at_least(0)


def _add_model_args(ap, many: bool = False):
    """Model and input flags; with many, --image/--prompt may repeat (capture runs every pair)."""
    ap.add_argument("--model", help="checkpoint directory (default: the embedded tiny Qwen2.5-VL)")
    if many:
        ap.add_argument("--image", action="append", help="image file, repeatable (default: the sample line "
                                                         "and the document page shipped in modeling/)")
        ap.add_argument("--prompt", action="append", help="prompt, repeatable")
    else:
        ap.add_argument("--image", help="image file (default: the sample image shipped in modeling/)")
        ap.add_argument("--prompt", default="Read the text in the image.")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "npu", "cuda"])
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                    help="model dtype (default: bfloat16 where the hardware computes it natively: NPU, CUDA, a CPU "
                         "with AVX512-BF16 or AMX; else float32)")


def _add_patch_args(ap):
    ap.add_argument("--use_pto", "--use-pto", dest="use_pto", action="store_true", default=None,
                    help="patch every RMSNorm with the fused kernels (default: $USE_PTO_RMS_NORM, else off)")
    ap.add_argument("--backend", default=None, help="auto|torch|cpu|npu|pypto (default: $PYPTO_GYM_BACKEND or auto)")
    ap.add_argument("--sites", default=None, help="globs over site kinds or paths, e.g. 'text.*,vision.merger.ln_q' "
                                                  "(default: $PYPTO_GYM_SITES or all)")
    ap.add_argument("--no-fuse-residual", dest="fuse_residual", action="store_false", default=None,
                    help="patch norms only, no fused residual add (default: $PYPTO_GYM_FUSE_RESIDUAL or on)")
    ap.add_argument("--quant", choices=["w8a8"], default=None,
                    help="with --use_pto: int8 weights and activations for the linears after each norm")
    ap.add_argument("--calibration", default=None,
                    help="with --quant w8a8: smooth scales from `calibrate` (default: no smoothing)")
    ap.add_argument("--allow-fallback", action="store_true",
                    help="with a --backend that cannot run here: run on torch (counted in the report) instead of "
                         "refusing")


def patch_options(args) -> dict | None:
    """The patch settings from flags, else the environment (SPEC 6); None when patching is off.

    Read and validated before any model is loaded, so a typo costs nothing. USE_PTO_RMS_NORM has
    its one meaning (config.py): 1 patches as --use_pto does, 0 or unset does not; the flag wins.
    """
    from . import config
    from .ops import registry
    from .patching import api, discovery

    use = args.use_pto if args.use_pto is not None else config.env_bool("USE_PTO_RMS_NORM", False)
    if args.calibration is not None and args.quant is None:
        raise UserError("--calibration: given without --quant w8a8")
    if args.calibration is not None and not Path(args.calibration).is_file():
        raise UserError(f"--calibration: no file at {args.calibration}")
    if not use:
        if args.quant is not None:
            raise UserError("--quant: needs patching on (--use_pto or USE_PTO_RMS_NORM=1)")
        return None
    config.set_enabled(True)  # --use_pto beats USE_PTO_RMS_NORM=0
    if args.backend is None:
        backend = registry.env_backend()
    else:
        backend = registry.check_name(args.backend.strip().lower(), "--backend")
    fuse = args.fuse_residual if args.fuse_residual is not None else api.default_fuse_residual()
    sites = discovery.parse_sites(args.sites, "--sites") if args.sites is not None else api.default_sites()
    return {"backend": backend, "sites": sites, "fuse_residual": fuse, "quant": args.quant,
            "calibration": args.calibration, "sites_from": "--sites" if args.sites is not None else "PYPTO_GYM_SITES"}


def refuse_backend_that_cannot_run(args, options, device: str) -> None:
    """A backend the user named (--backend, $PYPTO_GYM_BACKEND) that cannot run at all on this device is
    an error, said once, before loading anything; `auto` and --allow-fallback fall back, counted."""
    from .ops import registry

    if options is None or options["backend"] == "auto" or args.allow_fallback:
        return
    reason = registry.prepare(options["backend"], device.split(":")[0])
    if reason is not None:
        flag = "--backend" if args.backend is not None else "PYPTO_GYM_BACKEND"
        raise UserError(f"{flag} {options['backend']}: cannot run on {device} ({reason}); pass --allow-fallback "
                        f"to run on torch instead, counted in the report")


def speed(tokens_per_s: float, steps: int) -> str:
    """Decode speed as a figure that means something: tokens/s, s/token when slower than one a second."""
    if steps <= 0:
        return "decode n/a (one new token)"
    return f"decode {tokens_per_s:.1f} tokens/s" if tokens_per_s >= 1 else f"decode {1 / tokens_per_s:.1f} s/token"


def _patch(model, options, command: str):
    """Patch with `options`; a sites selection that matches nothing is refused naming where it came from."""
    from .patching import NoSitesError, patch_model

    options = dict(options)
    source = options.pop("sites_from")
    try:
        return patch_model(model, **options)
    except NoSitesError as e:
        raise UserError(e.describe(source)) from None


def _model_dtype(args, device: str) -> str:
    from .inference import default_dtype

    return args.dtype or default_dtype(device)


def _load(args, device):
    from .models.qwen2_5_vl import TINY_DIR, load_model_and_processor

    t0 = time.perf_counter()
    model, processor = load_model_and_processor(args.model or TINY_DIR, _model_dtype(args, device), device)
    return model, processor, device, time.perf_counter() - t0


def cmd_infer(args) -> int:
    from . import files
    from .inference import InferenceResult, generate, open_image, peak_memory_mb, resolve_device
    from .models.qwen2_5_vl import SAMPLE_IMAGE

    options = patch_options(args)
    device = resolve_device(args.device)
    refuse_backend_that_cannot_run(args, options, device)
    if args.report_file:
        files.check_writable(args.report_file, "--report-file")
    image = open_image(args.image or SAMPLE_IMAGE)
    model, processor, device, load_s = _load(args, device)
    report = _patch(model, options, "infer") if options is not None else None
    texts, n_new, prefill_s, tps = generate(model, processor, [args.prompt], [image], args.max_new_tokens)
    result = InferenceResult(text=texts, new_tokens=n_new, load_s=load_s, prefill_s=prefill_s,
                             decode_tokens_per_s=tps, peak_memory_mb=peak_memory_mb(device),
                             device=device, dtype=str(model.dtype).replace("torch.", ""),
                             extra={"use_pto": report is not None,
                                    "patch_report": report.to_json() if report is not None else None})
    print(f"generated: {texts[0]!r}")
    print(report if report is not None else "RMSNorm patching: off (pass --use_pto or set USE_PTO_RMS_NORM=1)")
    print(f"load {load_s:.2f} s | prefill {prefill_s * 1e3:.1f} ms | {speed(tps, n_new - 1)} | "
          f"peak memory {result.peak_memory_mb:.0f} MB | {device} {result.dtype}")
    if args.report_file:
        files.write_text(args.report_file, json.dumps(result.to_json(), indent=2) + "\n")
        print(f"report written to {args.report_file}")
    return 0


def _check_model_source(args) -> None:
    if args.model and args.config:
        raise UserError("--model and --config: give one (a checkpoint, or a config for random weights)")
    for flag in ("num_layers", "vision_depth"):
        if getattr(args, flag) is not None and not args.config:
            raise UserError(f"--{flag.replace('_', '-')}: only with --config (a random-weight model of that "
                            f"architecture)")


def _load_for_capture(args, device):
    """The embedded/local checkpoint, or a random-weight model from --config (GutenOCR-3B dims)."""
    from .models.qwen2_5_vl import TINY_DIR, Processor, build_random_model, load_model_and_processor

    dtype = _model_dtype(args, device)
    if args.config:
        processor = Processor(TINY_DIR)
        print(f"building a random-weight {dtype} model from {args.config} "
              f"(text layers={args.num_layers or 'all'}, vision depth={args.vision_depth or 'all'})", flush=True)
        model = build_random_model(args.config, args.num_layers, args.vision_depth, dtype,
                                   token_ids=processor.token_ids())
        return model.to(device), processor
    model, processor = load_model_and_processor(args.model or TINY_DIR, dtype, device)
    return model, processor


def cmd_capture(args) -> int:
    from . import files
    from .capture import ShapeRecorder, load_cases
    from .inference import generate, open_image, resolve_device
    from .models.qwen2_5_vl import DOCUMENT_IMAGE, SAMPLE_IMAGE

    _check_model_source(args)
    options = patch_options(args)
    device = resolve_device(args.device)
    refuse_backend_that_cannot_run(args, options, device)
    out = files.check_writable(args.out, "--out")  # before the model is built and run, not after
    if out.exists() and not args.no_merge:
        load_cases(out, max_elements=None, allow_empty=True)  # an existing --out must be a case file
    image_paths = args.image or [str(SAMPLE_IMAGE), str(DOCUMENT_IMAGE)]
    images = [open_image(p) for p in image_paths]
    prompts = args.prompt or ["Read the text in the image."]
    model, processor = _load_for_capture(args, device)
    if options is not None:
        _patch(model, options, "capture")
    requests = [(p, im, path) for p in prompts for im, path in zip(images, image_paths)]
    batches = [requests[i:i + args.batch_size] for i in range(0, len(requests), args.batch_size)]
    with ShapeRecorder(model) as rec:
        for i, batch in enumerate(batches, 1):
            desc = ", ".join(f"{Path(path).name} {im.size[0]}x{im.size[1]}" for _, im, path in batch)
            print(f"[{i}/{len(batches)}] generate {args.max_new_tokens} tokens: {desc}", flush=True)
            generate(model, processor, [p for p, _, _ in batch], [im for _, im, _ in batch], args.max_new_tokens)
    info = rec.save(out, model_name=args.model_name, merge=not args.no_merge)
    print(f"{info['cases']} cases in {info['path']} ({info['added']} new)")
    return 0


CALIBRATION_PROMPTS = ["Read the text in the image.", "What is written in this document?",
                       "Transcribe every line of the page.", "Describe the layout of this image."]


def cmd_calibrate(args) -> int:
    from . import files
    from .capture import ShapeRecorder
    from .inference import generate, open_image, resolve_device
    from .models.qwen2_5_vl import DOCUMENT_IMAGE, SAMPLE_IMAGE
    from .quant import calibration

    _check_model_source(args)
    device = resolve_device(args.device)
    if not 0.0 <= args.alpha <= 1.0:
        raise UserError(f"--alpha: got {args.alpha}; expected a number in [0, 1]")
    out = files.check_writable(args.out, "--out")
    image_paths = args.image or [str(SAMPLE_IMAGE), str(DOCUMENT_IMAGE)]
    images = [open_image(p) for p in image_paths]
    prompts = args.prompt or CALIBRATION_PROMPTS
    model, processor = _load_for_capture(args, device)
    requests = [(p, im, path) for p in prompts for im, path in zip(images, image_paths)]
    with ShapeRecorder(model, absmax=True) as rec:
        for i, (prompt, image, path) in enumerate(requests, 1):
            print(f"[{i}/{len(requests)}] generate {args.max_new_tokens} tokens: {Path(path).name} | {prompt}",
                  flush=True)
            generate(model, processor, [prompt], [image], args.max_new_tokens)
    scales = calibration.smooth_scales(model, rec.absmax, args.alpha)
    inputs = [f"{Path(path).name} | {prompt}" for prompt, _, path in requests]
    calibration.save(out, scales, args.alpha, getattr(model.config, "model_type", "?"), inputs)
    spread = [float(s.max() / s.min()) for s in scales.values()]
    print(f"{len(scales)} norms calibrated (alpha={args.alpha}) on {len(requests)} inputs; max/min smooth scale per "
          f"norm: median {sorted(spread)[len(spread) // 2]:.1f}, largest {max(spread):.1f}; written to {out}")
    return 0


def cmd_cases_run(args) -> int:
    from . import files
    from .capture.cases import printable
    from .capture.runner import format_table, run_file

    if args.json:
        files.check_writable(args.json, "--json")
    start = time.perf_counter()

    def progress(i, n, row):
        if not args.quiet:
            print(f"[{i}/{n}] {printable(row['id'])} {row['result']} ({time.perf_counter() - start:.0f} s)",
                  file=sys.stderr, flush=True)

    rows = run_file(args.file, args.backend, args.repeat, progress, args.max_elements)
    print(format_table(rows))
    if args.json:
        files.write_text(args.json, json.dumps(rows, indent=2) + "\n")
    return 0 if all(r["passed"] for r in rows) else 1


def _bench_outputs(args, name: str):
    """--json/--png default to a scratch folder (out/bench/): committed figures are written explicitly."""
    from . import files

    paths = [args.json or str(BENCH_OUT / f"{name}.json"), args.png or str(BENCH_OUT / f"{name}.png")]
    if not (args.json and args.png):
        BENCH_OUT.mkdir(parents=True, exist_ok=True)  # the scratch default is ours to create
    for flag, path in zip(("--json", "--png"), paths):
        files.check_writable(path, flag)
    return paths


def cmd_bench_ops(args) -> int:
    from . import hardware
    from .bench import ops_bench

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in ops_bench.DTYPES]
    if bad or not dtypes:
        raise UserError(f"--dtypes: got {args.dtypes!r}; expected a comma list of {', '.join(ops_bench.DTYPES)}")
    levels = [name for name, _ in hardware.ISA_LEVELS]
    isas = [i.strip() for i in args.isa.split(",") if i.strip()]
    if isas == ["all"]:
        isas = [i for i in levels if hardware.supports_isa(i)]
    elif isas == ["best"]:
        isas = [hardware.best_isa()]
    for isa in isas:
        if isa not in levels or not hardware.supports_isa(isa):
            raise UserError(f"--isa: got {isa!r}; this CPU runs {', '.join(i for i in levels if hardware.supports_isa(i))}")
    json_path, png_path = _bench_outputs(args, "ops")
    return ops_bench.run(dtypes, args.quick, args.rounds, json_path, png_path, pin=not args.no_pin_allocator,
                         isas=isas)


def cmd_bench_e2e(args) -> int:
    from .bench import e2e_bench

    json_path, png_path = _bench_outputs(args, "e2e")
    return e2e_bench.run(args.num_layers, args.vision_depth, args.repeats, args.max_new_tokens, args.image,
                         args.quick, json_path, png_path, args.dtype, args.quant)


def cmd_bench_cases(args) -> int:
    from .bench import cases_bench
    from .ops import registry

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [b for b in backends if b not in registry.BACKENDS]
    if bad or not backends:
        raise UserError(f"--backends: got {args.backends!r}; expected a comma list of {', '.join(registry.BACKENDS)}")
    return cases_bench.run_cases(args.file, backends, args.rounds, args.json)


def cmd_bench_pypto(args) -> int:
    from .bench import cases_bench

    json_path, png_path = _bench_outputs(args, "pypto")
    return cases_bench.run_pypto(args.file, json_path, png_path, tune=args.tune)


def cmd_bench_gemm(args) -> int:
    from .bench import w8a8_bench

    json_path, png_path = _bench_outputs(args, "gemm")
    return w8a8_bench.run_gemm(args.rounds, json_path, png_path)


def cmd_bench_w8a8(args) -> int:
    from .bench import w8a8_bench

    json_path, png_path = _bench_outputs(args, "w8a8")
    return w8a8_bench.run_accuracy(args.quick, json_path, png_path)


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="pypto-gym", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("infer", help="generate with a Qwen2.5-VL-family model and time it")
    _add_model_args(p)
    _add_patch_args(p)
    p.add_argument("--max-new-tokens", type=POSITIVE, default=16)
    p.add_argument("--report-file", help="write timings (and the patch report) as JSON")
    p.set_defaults(func=cmd_infer)

    p = sub.add_parser("capture", help="record the shapes every RMSNorm sees during generate into JSON cases")
    _add_model_args(p, many=True)
    _add_patch_args(p)
    p.add_argument("--config", help="build random weights from this config (e.g. modeling/gutenocr_3b/config.json)")
    p.add_argument("--num-layers", type=POSITIVE, help="with --config: text layers to keep")
    p.add_argument("--vision-depth", type=POSITIVE, help="with --config: vision blocks to keep")
    p.add_argument("--batch-size", type=POSITIVE, default=1)
    p.add_argument("--max-new-tokens", type=POSITIVE, default=4)
    p.add_argument("--model-name", help="the 'model' field of the JSON file")
    p.add_argument("--out", required=True, help="case file to write (merged into if it exists)")
    p.add_argument("--no-merge", action="store_true", help="overwrite --out instead of adding new cases")
    p.set_defaults(func=cmd_capture)

    p = sub.add_parser("calibrate", help="SmoothQuant smooth scales for --quant w8a8, from generate on real inputs")
    _add_model_args(p, many=True)
    p.add_argument("--config", help="build random weights from this config (e.g. modeling/gutenocr_3b/config.json)")
    p.add_argument("--num-layers", type=POSITIVE, help="with --config: text layers to keep")
    p.add_argument("--vision-depth", type=POSITIVE, help="with --config: vision blocks to keep")
    p.add_argument("--alpha", type=float, default=0.5, help="migration strength: s = max|X|^a / max|W|^(1-a)")
    p.add_argument("--max-new-tokens", type=POSITIVE, default=8)
    p.add_argument("--out", required=True, help="calibration file to write (.safetensors)")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("cases", help="test cases: run a case file against a backend")
    cases_sub = p.add_subparsers(dest="cases_command", required=True)
    r = cases_sub.add_parser("run", help="run every case against the golden; exit 1 on any failure")
    r.add_argument("file")
    r.add_argument("--backend", default="auto")
    r.add_argument("--repeat", type=NON_NEGATIVE, default=5, help="timed calls per case (median reported)")
    r.add_argument("--json", help="write the rows as JSON")
    r.add_argument("--max-elements", type=POSITIVE, default=MAX_ELEMENTS,
                   help=f"refuse cases with a tensor above this many elements (default {MAX_ELEMENTS:,})")
    r.add_argument("--quiet", action="store_true", help="no progress line per case on stderr")
    r.set_defaults(func=cmd_cases_run)

    p = sub.add_parser("bench", help="benchmarks: ops, cases, pypto, e2e, gemm, w8a8 (ratios, JSON, PNG)")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    b = bench_sub.add_parser("ops", help="each op vs HF eager, the torch reference and clone()")
    b.add_argument("--dtypes", default="bfloat16", help="comma list of bfloat16,float16,float32")
    b.add_argument("--quick", action="store_true", help="fewer shapes")
    b.add_argument("--rounds", type=POSITIVE, default=15, help="interleaved rounds per shape (median reported)")
    b.add_argument("--no-pin-allocator", action="store_true",
                   help="time with glibc's default mmap/trim behaviour (page faults make large shapes bimodal)")
    b.add_argument("--isa", default="best", help="cpu kernel levels to time: best (default), all, or a comma list "
                                                 "of avx512bf16,avx512,avx2,generic")
    b.add_argument("--json", help=f"default: {BENCH_OUT}/ops.json")
    b.add_argument("--png", help=f"default: {BENCH_OUT}/ops.png")
    b.set_defaults(func=cmd_bench_ops)
    b = bench_sub.add_parser("e2e", help="end to end at GutenOCR-3B dims: unpatched vs patched variants")
    b.add_argument("--num-layers", type=POSITIVE, default=4)
    b.add_argument("--vision-depth", type=POSITIVE, default=4)
    b.add_argument("--repeats", type=POSITIVE, default=3, help="interleaved rounds (median reported)")
    b.add_argument("--max-new-tokens", type=POSITIVE, default=16)
    b.add_argument("--image", help="default: the document page in modeling/gutenocr_3b/")
    b.add_argument("--quick", action="store_true", help="2 layers, 2 blocks, 2 rounds, 8 tokens")
    b.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                   help="model dtype (default: bfloat16 on a CPU with AVX512-BF16 or AMX, else float32)")
    b.add_argument("--quant", choices=["w8a8"], help="add a W8A8 variant (patched cpu, int8 linears)")
    b.add_argument("--json", help=f"default: {BENCH_OUT}/e2e.json")
    b.add_argument("--png", help=f"default: {BENCH_OUT}/e2e.png")
    b.set_defaults(func=cmd_bench_e2e)
    b = bench_sub.add_parser("cases", help="every captured case timed per backend (+ pypto's NPU estimate)")
    b.add_argument("file")
    b.add_argument("--backends", default="torch,cpu", help="comma list, e.g. torch,cpu,pypto")
    b.add_argument("--rounds", type=POSITIVE, default=9)
    b.add_argument("--json", default=None)
    b.set_defaults(func=cmd_bench_cases)
    b = bench_sub.add_parser("gemm", help="int8 GEMM candidates vs bf16 F.linear (decode and prefill shapes)")
    b.add_argument("--rounds", type=POSITIVE, default=9)
    b.add_argument("--json", help=f"default: {BENCH_OUT}/gemm.json")
    b.add_argument("--png", help=f"default: {BENCH_OUT}/gemm.png")
    b.set_defaults(func=cmd_bench_gemm)
    b = bench_sub.add_parser("w8a8", help="W8A8 accuracy vs the float model, with and without smoothing")
    b.add_argument("--quick", action="store_true", help="one image, one GutenOCR layer")
    b.add_argument("--json", help=f"default: {BENCH_OUT}/w8a8.json")
    b.add_argument("--png", help=f"default: {BENCH_OUT}/w8a8.png")
    b.set_defaults(func=cmd_bench_w8a8)
    b = bench_sub.add_parser("pypto", help="PyPTO's estimated 910B time per case vs the HBM bound")
    b.add_argument("file")
    b.add_argument("--tune", action="store_true", help="first tune the tiles per shape class of FILE (rewrites "
                                                         "pypto_gym/ops/backends/pypto_tiling.json; about an hour)")
    b.add_argument("--json", help=f"default: {BENCH_OUT}/pypto.json")
    b.add_argument("--png", help=f"default: {BENCH_OUT}/pypto.png")
    b.set_defaults(func=cmd_bench_pypto)
    return ap


def main(argv=None) -> int:
    """Exit status: 0 success (benchmarks: every goal met), 1 a case failed or was not run (benchmarks:
    a goal missed), 2 bad usage or input (one line on stderr, no traceback; PYPTO_GYM_DEBUG=1 shows it)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        # every file is written atomically at the end of a command: an interrupted one wrote nothing
        print(f"pypto-gym {args.command}: interrupted; nothing written", file=sys.stderr)
        return 130
    except (UserError, OSError, ValueError, TypeError, RuntimeError) as e:
        if os.environ.get("PYPTO_GYM_DEBUG"):
            raise
        text = " ".join(str(e).split()) or type(e).__name__
        print(f"pypto-gym {args.command}: error: {text}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
