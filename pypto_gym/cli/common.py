"""What the subcommands share: one-line errors, checked integer flags, the model and patch flags (read and
validated before anything is loaded), the model a command runs on, and the benchmarks' output paths."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

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


def POSITIVE_LIST(text):  # noqa: N802 - an argparse type, named like the others
    """A comma-separated list of positive integers ("1024,4096")."""
    return [POSITIVE(part) for part in text.split(",")]


POSITIVE_LIST.__name__ = "comma-separated integers >= 1"


# ---- the model a command runs on ------------------------------------------------------------------
def add_model_args(ap, many: bool = False, random_weights: bool = False):
    """Model and input flags; with many, --image/--prompt may repeat (capture runs every pair)."""
    ap.add_argument("--model", help="checkpoint directory of any known family (Qwen2.5-VL, Qwen2-VL, Qwen3-VL, Qwen3, "
                                    "Llama; default: the embedded tiny Qwen2.5-VL)")
    if random_weights:
        ap.add_argument("--config", help="build random weights from this config (e.g. modeling/gutenocr_3b/"
                                         "config.json: GutenOCR-3B's real dimensions, no download)")
        ap.add_argument("--num-layers", type=POSITIVE, help="with --config: text layers to keep")
        ap.add_argument("--vision-depth", type=POSITIVE, help="with --config: vision blocks to keep")
    if many:
        ap.add_argument("--image", action="append", help="image file, repeatable (default: the family's sample "
                                                         "line and document page; none for text models)")
        ap.add_argument("--prompt", action="append", help="prompt, repeatable")
    else:
        ap.add_argument("--image", help="image file (default: the sample image; none for text models)")
        ap.add_argument("--prompt", default=None, help="prompt (default: one suited to the model)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "npu", "cuda"])
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                    help="model dtype (default: bfloat16 where the hardware computes it natively: NPU, CUDA, a CPU "
                         "with AVX512-BF16 or AMX; else float32)")


def config_family(config: str):
    """The family of a --config file (its config.json's model_type), one that random weights are built for."""
    import json

    from .. import models

    path = Path(config)
    if not path.is_file():
        raise UserError(f"--config: no config file at {path}")
    try:
        family = models.family(json.loads(path.read_text()).get("model_type"))
    except (ValueError, AttributeError) as e:
        raise UserError(f"--config: {e}") from None
    if family.random_model is None:
        known = ", ".join(f.name for f in models.FAMILIES.values() if f.random_model is not None)
        raise UserError(f"--config: random weights are built for the {known} families, not {family.name}")
    return family


def model_family(args):
    """The family the flags name (from config.json's model_type), checked before anything is loaded."""
    from .. import models

    if getattr(args, "config", None) and args.model:
        raise UserError("--model and --config: give one (a checkpoint, or a config for random weights)")
    for flag in ("num_layers", "vision_depth"):
        if getattr(args, flag, None) is not None and not args.config:
            raise UserError(f"--{flag.replace('_', '-')}: only with --config (a random-weight model of that "
                            f"architecture)")
    if getattr(args, "config", None):
        family = config_family(args.config)
    else:
        family = models.DEFAULT if args.model is None else models.family(models.model_type(args.model))
    images = args.image if isinstance(args.image, list) else [args.image] if args.image else []
    if images and not family.multimodal:
        raise UserError(f"--image: {family.name} is a text-only model; it takes prompts only")
    return family


def model_dtype(args, device: str) -> str:
    from ..inference import default_dtype

    return args.dtype or default_dtype(device)


def load_int8_checkpoint(args, options, device):
    """(model, processor, seconds, report) for `infer --model DIR` where DIR holds int8 weights (an export or
    llm-compressor's): loaded onto the fused kernels as stored, which needs --use_pto --quant w8a8."""
    from ..quant import export

    fmt, mode = export.int8_format(args.model), export.quant_mode_of(args.model)
    if options is None or options["quant"] != mode:
        raise UserError(f"--model: {args.model} is a {fmt} {'W8A8 static' if mode == 'w8a8_static' else 'W8A8'} "
                        f"checkpoint (int8 weights, no float ones); run it with --use_pto --quant {mode}")
    for flag, key in (("--calibration", "calibration"), ("--float-linears", "float_linears"),
                      ("--int8-lm-head", "int8_lm_head")):
        if options[key]:
            raise UserError(f"{flag}: not with an int8 checkpoint ({args.model}): its smoothing and its float "
                            f"linears are in the checkpoint")
    t0 = time.perf_counter()
    try:
        model, processor, _, report = export.load(args.model, options["backend"], model_dtype(args, device), device,
                                                  sites=options["sites"], fuse_residual=options["fuse_residual"])
    except (ValueError, FileNotFoundError) as e:
        raise UserError(f"--model: {e}") from None
    return model, processor, time.perf_counter() - t0, report


def load_model(args, family, device):
    """(model, processor, seconds): --config's random weights, --model's checkpoint, or the embedded one."""
    from ..quant import export

    if getattr(args, "model", None) and export.int8_format(args.model):
        raise UserError(f"--model: {args.model} is an int8 checkpoint; only `infer --use_pto --quant w8a8` runs one "
                        f"(its float weights are not there to calibrate, capture or export from)")
    t0 = time.perf_counter()
    dtype = model_dtype(args, device)
    if getattr(args, "config", None):
        print(f"building a random-weight {dtype} model from {args.config} (text layers={args.num_layers or 'all'}, "
              f"vision depth={args.vision_depth or 'all'})", flush=True)
        model, processor = family.random_model(args.config, args.num_layers, args.vision_depth, dtype)
        model = model.to(device)
    else:
        model, processor = family.load(args.model or family.tiny_dir, dtype, device)
    return model, processor, time.perf_counter() - t0


def safetensors_name(out: str) -> str:
    """--out of a calibration file: safetensors, so a name with another suffix is refused (calibrate --out x.json
    wrote a safetensors file named .json without a word)."""
    from pathlib import Path

    if Path(out).suffix != ".safetensors":
        raise UserError(f"--out: {out} names a {Path(out).suffix or 'suffix-less'} file; a calibration file is "
                        f"safetensors: expected a name ending in .safetensors")
    return out


def default_prompt(family) -> str:
    return "Read the text in the image." if family.multimodal else family.calibration_prompts[0]


# ---- patching -----------------------------------------------------------------------------------------
def add_patch_args(ap):
    ap.add_argument("--use_pto", "--use-pto", dest="use_pto", action="store_true", default=None,
                    help="patch the model with pypto-gym's fused kernels (default: $USE_PTO_RMS_NORM, else off)")
    ap.add_argument("--backend", default=None, help="auto|torch|cpu|npu|pypto (default: $PYPTO_GYM_BACKEND or auto)")
    ap.add_argument("--sites", default=None, help="globs over site kinds or paths, e.g. 'text.*,vision.merger.ln_q'; "
                                                  "'!glob' excludes (default: $PYPTO_GYM_SITES or all)")
    ap.add_argument("--no-fuse-residual", dest="fuse_residual", action="store_false", default=None,
                    help="patch norms only, no fused residual add (default: $PYPTO_GYM_FUSE_RESIDUAL or on)")
    ap.add_argument("--quant", choices=["w8a8", "w8a8_static"], default=None,
                    help="with --use_pto: int8 weights and activations for the model's linears (w8a8: per-token "
                         "dynamic activation scales; w8a8_static: msModelSlim's W8A8, static scales from "
                         "--calibration)")
    ap.add_argument("--calibration", default=None,
                    help="with --quant w8a8: smooth scales from `calibrate` (default: no smoothing)")
    ap.add_argument("--float-linears", default=None,
                    help="with --quant w8a8: globs over linear kinds or paths kept in the model dtype, e.g. "
                         "'text.o_proj,vision.proj' (default: every linear but lm_head int8)")
    ap.add_argument("--release-float-weights", action="store_true",
                    help="with --quant w8a8: the int8 linears drop their float weights (memory returned, no unpatch)")
    ap.add_argument("--int8-lm-head", action="store_true",
                    help="with --quant w8a8: lm_head int8 too (default float: what vLLM and vllm-ascend serve)")
    ap.add_argument("--allow-fallback", action="store_true",
                    help="with a --backend that cannot run here: run on torch (counted in the report) instead of "
                         "refusing")


def parse_float_linears(value):
    """--float-linears checked before anything is loaded (options.parse_float_linears), refused as one line."""
    from ..patching import options

    try:
        return options.parse_float_linears(value, "--float-linears")
    except ValueError as e:
        raise UserError(str(e)) from None


def patch_options(args) -> dict | None:
    """The patch settings from flags, else the environment (SPEC 6); None when patching is off.

    Read and validated before any model is loaded, so a typo costs nothing. USE_PTO_RMS_NORM has
    its one meaning (config.py): 1 patches as --use_pto does, 0 or unset does not; the flag wins.
    """
    from .. import config
    from ..ops import registry
    from ..patching import options

    use = args.use_pto if args.use_pto is not None else config.env_bool("USE_PTO_RMS_NORM", False)
    if args.calibration is not None and args.quant is None:
        raise UserError("--calibration: given without --quant w8a8")
    if args.calibration is not None and not Path(args.calibration).is_file():
        raise UserError(f"--calibration: no file at {args.calibration}")
    if args.float_linears is not None and args.quant is None:
        raise UserError("--float-linears: given without --quant w8a8")
    if args.int8_lm_head and args.quant is None:
        raise UserError("--int8-lm-head: given without --quant w8a8")
    if args.release_float_weights and args.quant is None:
        raise UserError("--release-float-weights: given without --quant w8a8")
    if not use:
        if args.quant is not None:
            raise UserError("--quant: needs patching on (--use_pto or USE_PTO_RMS_NORM=1)")
        return None
    config.set_enabled(True)  # --use_pto beats USE_PTO_RMS_NORM=0
    if args.backend is None:
        backend = registry.env_backend()
    else:
        backend = registry.check_name(args.backend.strip().lower(), "--backend")
    fuse = args.fuse_residual if args.fuse_residual is not None else options.default_fuse_residual()
    sites = options.parse_sites(args.sites, "--sites") if args.sites is not None else options.default_sites()
    return {"backend": backend, "sites": sites, "fuse_residual": fuse, "quant": args.quant,
            "calibration": args.calibration,
            "float_linears": parse_float_linears(args.float_linears),
            "release_float_weights": args.release_float_weights, "int8_lm_head": args.int8_lm_head,
            "sites_from": "--sites" if args.sites is not None else "PYPTO_GYM_SITES"}


def refuse_backend_that_cannot_run(args, options, device: str) -> None:
    """A backend the user named (--backend, $PYPTO_GYM_BACKEND) that cannot run at all on this device is
    an error, said once, before loading anything; `auto` and --allow-fallback fall back, counted."""
    from ..ops import registry

    if options is None or options["backend"] == "auto" or args.allow_fallback:
        return
    reason = registry.prepare(options["backend"], device.split(":")[0])
    if reason is not None:
        flag = "--backend" if args.backend is not None else "PYPTO_GYM_BACKEND"
        raise UserError(f"{flag} {options['backend']}: cannot run on {device} ({reason}); pass --allow-fallback "
                        f"to run on torch instead, counted in the report")


def patch(model, options):
    """Patch with `options`; a sites selection that matches nothing is refused naming where it came from."""
    from ..patching import NoSitesError, patch_model

    options = dict(options)
    source = options.pop("sites_from")
    try:
        return patch_model(model, **options)
    except NoSitesError as e:
        raise UserError(e.describe(source)) from None


# ---- output ---------------------------------------------------------------------------------------------
def speed(tokens_per_s: float, steps: int) -> str:
    """Decode speed as a figure that means something: tokens/s, s/token when slower than one a second."""
    if steps <= 0:
        return "decode n/a (one new token)"
    return f"decode {tokens_per_s:.1f} tokens/s" if tokens_per_s >= 1 else f"decode {1 / tokens_per_s:.1f} s/token"


def bench_outputs(args, name: str):
    """--json/--png default to a scratch folder (out/bench/): committed figures are written explicitly."""
    from .. import files

    paths = [args.json or str(BENCH_OUT / f"{name}.json"), args.png or str(BENCH_OUT / f"{name}.png")]
    if not (args.json and args.png):
        BENCH_OUT.mkdir(parents=True, exist_ok=True)  # the scratch default is ours to create
    for flag, path in zip(("--json", "--png"), paths):
        files.check_writable(path, flag)
    return paths
