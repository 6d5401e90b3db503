"""`pypto-gym tune`: a W8A8 recipe found by measurement (quant/tune.py): per source the SmoothQuant alpha and the
fewest float linears that reach --target-cosine on held-out prompts, written as a calibration file that
`infer`, `export` and `patch_model` take (its float linears kept float), with a report of what it chose and why."""
from __future__ import annotations

from . import common
from .capture import requests


def add_parser(sub):
    p = sub.add_parser("tune", help="a W8A8 recipe found by measurement: per-source alpha and the fewest float "
                                    "linears reaching a target logits cosine")
    common.add_model_args(p, many=True, random_weights=True)
    p.add_argument("--target-cosine", type=float, default=0.99, help="mean logits cosine vs the float model to reach")
    p.add_argument("--scheme", choices=["dynamic", "static"], default="dynamic",
                   help="dynamic: --quant w8a8; static: --quant w8a8_static (msModelSlim's W8A8)")
    p.add_argument("--max-new-tokens", type=common.POSITIVE, default=2, help="tokens generated per calibration input")
    p.add_argument("--out", required=True, help="the recipe: a calibration file (.safetensors)")
    p.add_argument("--json", default=None, help="also write the report here")
    p.set_defaults(func=run)


def run(args) -> int:
    import json

    import torch

    from .. import files
    from ..inference import generate, resolve_device
    from ..quant import tune

    family = common.model_family(args)
    if not 0.0 < args.target_cosine <= 1.0:
        raise common.UserError(f"--target-cosine: got {args.target_cosine}; expected a cosine in (0, 1]")
    out = files.check_writable(common.safetensors_name(args.out), "--out")
    device = resolve_device(args.device)
    args.prompt = args.prompt or list(family.calibration_prompts)
    calib = requests(args, family)
    images = list({id(im): im for _, im, _ in calib}.values())  # each calibration image once (None: a text model)
    held_out = [(p, im) for p in tune.HELD_OUT_PROMPTS for im in images]
    model, processor, _ = common.load_model(args, family, device)

    def calibrate():
        for prompt, image, _ in calib:
            generate(model, processor, [prompt], [image], args.max_new_tokens)

    def evaluate():
        with torch.inference_mode():
            return [model(**processor([p], [im], model), logits_to_keep=tune.KEEP_POSITIONS).logits[0].float()
                    for p, im in held_out]

    print(f"tune ({args.scheme}): {len(calib)} calibration inputs, {len(held_out)} held-out inputs, target cosine "
          f"{args.target_cosine}; each group of linears alone int8 at alpha {', '.join(map(str, tune.ALPHAS))}:",
          flush=True)
    report = tune.tune(model, evaluate, calibrate, args.target_cosine, args.scheme, out=out,
                       inputs=[f"{label + ' | ' if label else ''}{p}" for p, _, label in calib])
    floats = report["float_linears"]
    print(f"recipe written to {out}: {report['int8_groups']}/{report['groups']} groups int8, "
          f"{len(floats)} linears float ({', '.join(report['float_groups']) or 'none'}); cosine "
          f"{report['cosine']:.5f} ({'meets' if report['met'] else 'MISSES'} {args.target_cosine}); int8 share of "
          f"the decoder's linear weight bytes {report['decoder_int8_share'] * 100:.1f}%")
    if args.json:
        files.write_text(args.json, json.dumps(report, indent=2) + "\n")
    return 0 if report["met"] else 1
