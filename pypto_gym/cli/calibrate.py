"""`pypto-gym calibrate` (scripts/calibrate.py): SmoothQuant smooth scales for --quant w8a8, from generate on
real inputs."""
from __future__ import annotations

from . import common
from .capture import requests


def add_parser(sub):
    p = sub.add_parser("calibrate", help="SmoothQuant smooth scales for --quant w8a8, from generate on real inputs")
    common.add_model_args(p, many=True, random_weights=True)
    p.add_argument("--alpha", type=float, default=0.5, help="migration strength: s = max|X|^a / max|W|^(1-a)")
    p.add_argument("--max-new-tokens", type=common.POSITIVE, default=8)
    p.add_argument("--out", required=True, help="calibration file to write (.safetensors)")
    p.set_defaults(func=run)


def run(args) -> int:
    from .. import files
    from ..inference import generate, resolve_device
    from ..quant import calibration

    family = common.model_family(args)
    device = resolve_device(args.device)
    if not 0.0 <= args.alpha <= 1.0:
        raise common.UserError(f"--alpha: got {args.alpha}; expected a number in [0, 1]")
    out = files.check_writable(args.out, "--out")
    args.prompt = args.prompt or list(family.CALIBRATION_PROMPTS)
    todo = requests(args, family)
    model, processor, _ = common.load_model(args, family, device)
    with calibration.Calibrator(model) as rec:
        for i, (prompt, image, label) in enumerate(todo, 1):
            print(f"[{i}/{len(todo)}] generate {args.max_new_tokens} tokens: {label + ' | ' if label else ''}{prompt}",
                  flush=True)
            generate(model, processor, [prompt], [image], args.max_new_tokens)
    scales = calibration.smooth_scales(model, rec.absmax, args.alpha)
    inputs = [f"{label} | {prompt}" if label else prompt for prompt, _, label in todo]
    calibration.save(out, scales, args.alpha, getattr(model.config, "model_type", "?"), inputs)
    spread = [float(s.max() / s.min()) for s in scales.values()]
    mlps = sum(1 for p in scales if p.endswith("mlp"))
    print(f"{len(scales)} producers calibrated ({len(scales) - mlps} norms, {mlps} MLPs; alpha={args.alpha}) on "
          f"{len(todo)} inputs; max/min smooth scale per producer: median {sorted(spread)[len(spread) // 2]:.1f}, "
          f"largest {max(spread):.1f}; written to {out}")
    return 0
