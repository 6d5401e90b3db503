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
    p.add_argument("--percentile", type=float, default=None,
                   help="static ranges from each channel's lower/upper percentile (e.g. 99.99) instead of min/max")
    p.add_argument("--out", required=True, help="calibration file to write (.safetensors)")
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    from .. import files
    from ..inference import generate, resolve_device
    from ..quant import calibration

    family = common.model_family(args)
    device = resolve_device(args.device)
    if not 0.0 <= args.alpha <= 1.0:
        raise common.UserError(f"--alpha: got {args.alpha}; expected a number in [0, 1]")
    if args.percentile is not None and not 50.0 < args.percentile <= 100.0:
        raise common.UserError(f"--percentile: got {args.percentile}; expected a number in (50, 100]")
    out = files.check_writable(common.safetensors_name(args.out), "--out")
    args.prompt = args.prompt or list(family.calibration_prompts)
    todo = requests(args, family)
    model, processor, _ = common.load_model(args, family, device)
    with calibration.Calibrator(model, args.percentile) as rec:
        for i, (prompt, image, label) in enumerate(todo, 1):
            print(f"[{i}/{len(todo)}] generate {args.max_new_tokens} tokens: {label + ' | ' if label else ''}{prompt}",
                  flush=True)
            generate(model, processor, [prompt], [image], args.max_new_tokens)
    scales = calibration.smooth_scales(model, rec.absmax, args.alpha)
    inputs = [f"{label} | {prompt}" if label else prompt for prompt, _, label in todo]
    calibration.save(out, scales, args.alpha, getattr(model.config, "model_type", "?"), inputs, rec.ranges(scales),
                     range_rule=rec.range_rule)
    spread = [float(s.max() / s.min()) for s in scales.values()]
    linears = sum(isinstance(model.get_submodule(p), torch.nn.Linear) for p in scales)
    mlps = sum(1 for p in scales if hasattr(model.get_submodule(p), "down_proj"))
    print(f"{len(scales)} smooth scales ({len(scales) - mlps - linears} norms, {mlps} MLPs, {linears} linears "
          f"quantising their own input; alpha={args.alpha}) from {len(todo)} inputs; max/min per scale: median "
          f"{sorted(spread)[len(spread) // 2]:.1f}, largest {max(spread):.1f}; written to {out}")
    return 0
