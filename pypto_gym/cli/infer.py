"""`pypto-gym infer` (scripts/infer.py): generate with a model, patched or not, and time what a user feels."""
from __future__ import annotations

import json

from . import common


def add_parser(sub):
    p = sub.add_parser("infer", help="generate with a model (patched with --use_pto) and time it")
    common.add_model_args(p)
    common.add_patch_args(p)
    p.add_argument("--max-new-tokens", type=common.POSITIVE, default=16)
    p.add_argument("--report-file", help="write timings (and the patch report) as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from .. import files
    from ..inference import InferenceResult, generate, open_image, peak_memory_mb, resolve_device

    family = common.model_family(args)
    options = common.patch_options(args)
    device = resolve_device(args.device)
    common.refuse_backend_that_cannot_run(args, options, device)
    if args.report_file:
        files.check_writable(args.report_file, "--report-file")
    image = open_image(args.image or family.images[0]) if family.multimodal else None
    from ..quant import export

    if args.model and export.int8_format(args.model):
        model, processor, load_s, report = common.load_int8_checkpoint(args, options, device)
    else:
        model, processor, load_s = common.load_model(args, family, device)
        report = common.patch(model, options) if options is not None else None
    prompt = args.prompt or common.default_prompt(family)
    texts, n_new, prefill_s, tps = generate(model, processor, [prompt], [image], args.max_new_tokens)
    result = InferenceResult(text=texts, new_tokens=n_new, load_s=load_s, prefill_s=prefill_s,
                             decode_tokens_per_s=tps, peak_memory_mb=peak_memory_mb(device),
                             device=device, dtype=str(model.dtype).replace("torch.", ""),
                             extra={"use_pto": report is not None, "model_family": family.name,
                                    "patch_report": report.to_json() if report is not None else None})
    print(f"generated: {texts[0]!r}")
    print(report if report is not None else "pypto-gym patching: off (pass --use_pto or set USE_PTO_RMS_NORM=1)")
    print(f"load {load_s:.2f} s | prefill {prefill_s * 1e3:.1f} ms | {common.speed(tps, n_new - 1)} | "
          f"peak memory {result.peak_memory_mb:.0f} MB | {device} {result.dtype}")
    if args.report_file:
        files.write_text(args.report_file, json.dumps(result.to_json(), indent=2) + "\n")
        print(f"report written to {args.report_file}")
    return 0
