"""`pypto-gym export`: the model patched in W8A8 mode, written as a compressed-tensors or an msModelSlim
checkpoint (int8 weights + per-channel scales, config, tokenizer/processor, generation config); a
--calibration's smoothing is folded into the weights (quant/fold.py). --quant w8a8_static writes the static scheme
(msModelSlim's W8A8: activation scales and offsets, deq_scale, quant_bias; or compressed-tensors' static int8),
which needs --calibration. --text-only writes a vision-language model's decoder as its text-only model (what vLLM's
text engines serve)."""
from __future__ import annotations

from . import common


def add_parser(sub):
    p = sub.add_parser("export", help="write the W8A8 model as a compressed-tensors or msModelSlim checkpoint")
    common.add_model_args(p, random_weights=True)
    p.add_argument("--format", choices=["compressed-tensors", "msmodelslim"], default="compressed-tensors")
    p.add_argument("--quant", choices=["w8a8", "w8a8_static"], default="w8a8",
                   help="w8a8: per-token dynamic activations (W8A8_DYNAMIC); w8a8_static: static per-tensor activation "
                        "scales and offsets from --calibration (msModelSlim's W8A8, or compressed-tensors' static "
                        "int8 with an input_zero_point)")
    p.add_argument("--calibration", default=None,
                   help="smooth scales from `calibrate`, folded into the checkpoint (default: no smoothing)")
    p.add_argument("--float-linears", default=None,
                   help="globs over linear kinds or paths kept in the model dtype (e.g. 'text.q_proj')")
    p.add_argument("--int8-lm-head", action="store_true",
                   help="lm_head int8 too (default float: what vLLM and vllm-ascend load; vLLM refuses an int8 "
                        "lm_head in compressed-tensors, vllm-ascend loads msModelSlim's)")
    p.add_argument("--release-float-weights", action="store_true",
                   help="drop each float weight once its int8 copy exists (a large model's peak memory)")
    p.add_argument("--text-only", action="store_true",
                   help="a vision-language model's decoder alone, as its text-only model (Qwen3-VL: "
                        "Qwen3ForCausalLM): what vLLM's text engines serve")
    p.add_argument("out", help="a new or empty directory (its parent must exist)")
    p.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    from ..inference import resolve_device
    from ..patching import patch_model
    from ..quant import export

    family = common.model_family(args)
    if args.calibration is not None and not Path(args.calibration).is_file():
        raise common.UserError(f"--calibration: no file at {args.calibration}")
    if args.quant == "w8a8_static" and args.calibration is None:
        raise common.UserError("--quant w8a8_static: needs --calibration (the static scales come from its activation "
                               "ranges)")
    if args.text_only and export.text_only_refusal(family):
        raise common.UserError(f"--text-only: {export.text_only_refusal(family)}")
    float_linears = common.parse_float_linears(args.float_linears)
    try:
        out = export.check_out_dir(args.out)  # before the model is loaded and quantised, not after
    except OSError as e:
        raise common.UserError(f"out: {str(e).removeprefix('export: ')}") from None
    device = resolve_device(getattr(args, "device", None) or "cpu")
    model, processor, _ = common.load_model(args, family, device)
    report = patch_model(model, backend="cpu", quant=args.quant, calibration=args.calibration,
                         float_linears=float_linears, int8_lm_head=args.int8_lm_head,
                         release_float_weights=args.release_float_weights)
    wrote = export.save(model, out, processor, args.format, text_only=args.text_only)
    s = report.to_json()["w8a8"]["summary"]
    head = ("lm_head float (in the ignore list: what vLLM and vllm-ascend load)" if wrote["lm_head"] == "float" else
            f"lm_head int8 (--int8-lm-head: {export.LM_HEAD_CONSUMERS[args.format]})")
    kind = "weight int8 + weight_scale fp32 per output channel"
    if args.quant == "w8a8_static":
        kind = ("W8A8 static: weight int8, input_scale/input_offset, deq_scale, quant_bias" if args.format ==
                "msmodelslim" else "static: weight int8 + weight_scale, input_scale + input_zero_point per tensor")
    what = f"text-only ({family.text_only_config(model.config).architectures[0]}) " if args.text_only else ""
    print(f"{args.format} {what}checkpoint written to {out}: {len(wrote['int8'])} int8 linears ({kind}), "
          f"{len(wrote['ignore'])} float ({', '.join(wrote['ignore'][:3])}"
          f"{', ...' if len(wrote['ignore']) > 3 else ''}); {head}; {s['int8_weight_bytes'] / 2 ** 20:.1f} MB of int8 "
          f"weights" + ("; smoothing folded into the weights" if args.calibration else ""))
    return 0
