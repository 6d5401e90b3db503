"""`pypto-gym capture` (scripts/capture_shapes.py): record every site's real calls during generate as test cases."""
from __future__ import annotations

from pathlib import Path

from . import common


def add_parser(sub):
    p = sub.add_parser("capture", help="record the calls every site makes during generate into JSON test cases")
    common.add_model_args(p, many=True, random_weights=True)
    common.add_patch_args(p)
    p.add_argument("--batch-size", type=common.POSITIVE, default=1)
    p.add_argument("--max-new-tokens", type=common.POSITIVE, default=4)
    p.add_argument("--model-name", help="the 'model' field of the JSON file")
    p.add_argument("--out", required=True, help="case file to write (merged into if it exists)")
    p.add_argument("--no-merge", action="store_true", help="overwrite --out instead of adding new cases")
    p.set_defaults(func=run)


def requests(args, family) -> list:
    """(prompt, image or None, label) for every prompt x image the command runs (text models: prompts only)."""
    from ..inference import open_image

    image_paths = (args.image or [str(p) for p in family.images]) if family.multimodal else [None]
    images = [(open_image(p) if p else None, Path(p).name if p else "") for p in image_paths]
    return [(prompt, image, label) for prompt in args.prompt for image, label in images]


def run(args) -> int:
    from .. import files
    from ..capture import ShapeRecorder, load_cases
    from ..capture.cases import MAX_ELEMENTS
    from ..inference import generate, resolve_device

    family = common.model_family(args)
    options = common.patch_options(args)
    device = resolve_device(args.device)
    common.refuse_backend_that_cannot_run(args, options, device)
    out = files.check_writable(args.out, "--out")  # before the model is built and run, not after
    if out.exists() and not args.no_merge:
        load_cases(out, max_elements=None, allow_empty=True)  # an existing --out must be a case file
    args.prompt = args.prompt or [common.default_prompt(family)]
    todo = requests(args, family)
    model, processor, _ = common.load_model(args, family, device)
    if options is not None:
        common.patch(model, options)
    batches = [todo[i:i + args.batch_size] for i in range(0, len(todo), args.batch_size)]
    with ShapeRecorder(model) as rec:
        for i, batch in enumerate(batches, 1):
            desc = ", ".join(f"{label} {im.size[0]}x{im.size[1]}" if im else prompt for prompt, im, label in batch)
            print(f"[{i}/{len(batches)}] generate {args.max_new_tokens} tokens: {desc}", flush=True)
            generate(model, processor, [p for p, _, _ in batch], [im for _, im, _ in batch], args.max_new_tokens)
    info = rec.save(out, model_name=args.model_name, merge=not args.no_merge)
    print(f"{info['cases']} cases in {info['path']} ({info['added']} new)")
    if rec.too_large:
        print(f"not recorded (a tensor above the case cap of {MAX_ELEMENTS:,} elements): "
              + ", ".join(f"{site} x{n}" for site, n in sorted(rec.too_large.items())))
    return 0
