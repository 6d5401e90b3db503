"""`pypto-gym bench ...` (scripts/bench.py): benchmarks that print ratios, PASS/FAIL goal lines and write JSON/PNG."""
from __future__ import annotations

from pathlib import Path

from .common import BENCH_OUT, POSITIVE, POSITIVE_LIST, UserError, bench_outputs, config_family


def add_parser(sub):
    p = sub.add_parser("bench", help="benchmarks: ops, cases, pypto, layer, e2e, gemm, w8a8 (ratios, JSON, PNG)")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    b = bench_sub.add_parser("ops", help="each op vs HF eager, the torch reference and clone()")
    b.add_argument("--dtypes", default="bfloat16", help="comma list of bfloat16,float16,float32")
    b.add_argument("--quick", action="store_true", help="fewer shapes")
    b.add_argument("--rounds", type=POSITIVE, default=15, help="interleaved rounds per shape (median reported)")
    b.add_argument("--no-pin-allocator", action="store_true",
                   help="time with glibc's default mmap/trim behaviour (page faults make large shapes bimodal)")
    b.add_argument("--isa", default="best", help="cpu kernel levels to time: best (default), all, or a comma list "
                                                 "of avx512amx,avx512bf16,avx512,avx2,generic")
    b.add_argument("--ops", help="comma list of ops to time (default: every op with a bench spec)")
    b.add_argument("--json", help=f"default: {BENCH_OUT}/ops.json")
    b.add_argument("--png", help=f"default: {BENCH_OUT}/ops.png")
    b.set_defaults(func=cmd_bench_ops)
    b = bench_sub.add_parser("e2e", help="end to end at GutenOCR-3B dims: unpatched vs patched variants")
    b.add_argument("--model", help="a checkpoint of any known family instead of GutenOCR-3B dims (e.g. "
                                   "modeling/tiny_qwen3; --num-layers/--vision-depth then do not apply)")
    b.add_argument("--config", help="random weights at this config's dimensions (default: modeling/gutenocr_3b/"
                                    "config.json; modeling/qwen3_vl_2b/config.json: Qwen3-VL-2B's)")
    b.add_argument("--num-layers", type=POSITIVE, default=4)
    b.add_argument("--vision-depth", type=POSITIVE, default=4)
    b.add_argument("--repeats", type=POSITIVE, default=3, help="interleaved rounds (median reported)")
    b.add_argument("--max-new-tokens", type=POSITIVE, default=16)
    b.add_argument("--image", help="default: the document page in modeling/gutenocr_3b/")
    b.add_argument("--quick", action="store_true", help="2 layers, 2 blocks, 2 rounds, 8 tokens")
    b.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                   help="model dtype (default: bfloat16 on a CPU with AVX512-BF16 or AMX, else float32)")
    b.add_argument("--quant", choices=["w8a8", "w8a8_static"],
                   help="add a W8A8 variant (patched cpu, int8 linears); w8a8_static: the static and the dynamic "
                        "scheme, both calibrated on the bench's input")
    b.add_argument("--json", help=f"default: {BENCH_OUT}/e2e.json")
    b.add_argument("--png", help=f"default: {BENCH_OUT}/e2e.png")
    b.set_defaults(func=cmd_bench_e2e)
    b = bench_sub.add_parser("cases", help="every captured case timed per backend (+ pypto's NPU estimate)")
    b.add_argument("file")
    b.add_argument("--backends", default="torch,cpu", help="comma list, e.g. torch,cpu,pypto")
    b.add_argument("--rounds", type=POSITIVE, default=9)
    b.add_argument("--json", default=None)
    b.set_defaults(func=cmd_bench_cases)
    b = bench_sub.add_parser("vllm", help="vLLM's throughput with and without pypto-gym's kernels inside it, and "
                                          "each provider vs vLLM's op (run with vLLM's venv: .venv-vllm/bin/pypto-gym)")
    b.add_argument("--layers", type=POSITIVE, default=2, help="GutenOCR-3B text layers (random weights)")
    b.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    b.add_argument("--quick", action="store_true", help="the tiny models only")
    b.add_argument("--rounds", type=POSITIVE, default=41, help="interleaved rounds per provider shape (median "
                   "reported; the toy models' rotary takes ~7 us either way, where medians of 15 rounds moved by a "
                   "few per cent between runs)")
    b.add_argument("--json", help=f"default: {BENCH_OUT}/vllm.json")
    b.add_argument("--png", help=f"default: {BENCH_OUT}/vllm.png")
    b.set_defaults(func=cmd_bench_vllm)
    b = bench_sub.add_parser("gemm", help="int8 GEMM candidates vs bf16 F.linear (decode and prefill shapes)")
    b.add_argument("--rounds", type=POSITIVE, default=9)
    b.add_argument("--json", help=f"default: {BENCH_OUT}/gemm.json")
    b.add_argument("--png", help=f"default: {BENCH_OUT}/gemm.png")
    b.set_defaults(func=cmd_bench_gemm)
    b = bench_sub.add_parser("w8a8", help="W8A8 accuracy vs the float model, with and without smoothing")
    b.add_argument("--quick", action="store_true", help="one image, one GutenOCR layer")
    b.add_argument("--float-linears", default=None,
                   help="a recipe column: alpha 0.5 with these linear kinds/paths kept in the model dtype")
    b.add_argument("--sensitivity", action="store_true",
                   help="also each outlier model with one kind of linear kept float at a time")
    b.add_argument("--llmcompressor", metavar="PYTHON", default=None,
                   help="the python of an llm-compressor 0.14 environment: an llm-compressor row per model and "
                        "variant, calibrated on the same inputs (scripts/make_llmcompressor_fixture.py)")
    b.add_argument("--json", help=f"default: {BENCH_OUT}/w8a8.json")
    b.add_argument("--png", help=f"default: {BENCH_OUT}/w8a8.png")
    b.set_defaults(func=cmd_bench_w8a8)
    b = bench_sub.add_parser("pypto", help="PyPTO's estimated 910B time per case vs the HBM bound")
    b.add_argument("file")
    b.add_argument("--tune", action="store_true", help="first tune the tiles per shape class of FILE (rewrites "
                                                         "pypto_gym/kernels/pypto/tiling.json; about an hour)")
    b.add_argument("--no-documents", action="store_true", help="skip the source documents' rms_norm (one process "
                                                                 "per case)")
    b.add_argument("--max-elements", type=POSITIVE, help="simulate only cases whose tensors have at most N elements "
                                                         "(PyPTO's CPU simulation of a document page's MLP takes "
                                                         "minutes); the others are listed")
    b.add_argument("--json", help=f"default: {BENCH_OUT}/pypto.json")
    b.add_argument("--png", help=f"default: {BENCH_OUT}/pypto.png")
    b.set_defaults(func=cmd_bench_pypto)
    b = bench_sub.add_parser("layer", help="one decoder layer and vision block (GutenOCR-3B's, or --config's): HF's "
                                           "kernels vs the fused ones on PyPTO's NPU model, with launch counts and "
                                           "the GEMMs on a stated roofline")
    b.add_argument("--config", default=None,
                   help="the model's dimensions from this config.json (default: modeling/gutenocr_3b/config.json; "
                        "modeling/qwen3_vl_2b/config.json: Qwen3-VL-2B's LayerNorm / GELU vision block and Qwen3 "
                        "text layer)")
    b.add_argument("--tokens", type=POSITIVE, default=None, help="prefill tokens of the text layer (default 128; "
                                                                    "--page: 512)")
    b.add_argument("--vision-tokens", type=POSITIVE, default=None, help="patches of the vision block (default 256, "
                                                                        "four windows; --page: 3744)")
    b.add_argument("--kv", type=POSITIVE_LIST, default=None,
                   help="KV lengths of the decode step's attention, one decode table each (default 1024; --page: "
                        "1024,4096)")
    b.add_argument("--page", action="store_true",
                   help="GutenOCR-3B's document page: 512 text tokens, 3744 patches, KV 1024 and 4096 (opt-in: "
                        f"about {pypto_layer_page_cost()})")
    b.add_argument("--json", help=f"default: {BENCH_OUT}/layer.json")
    b.add_argument("--png", help=f"default: {BENCH_OUT}/layer.png")
    b.set_defaults(func=cmd_bench_layer)


def cmd_bench_ops(args) -> int:
    from .. import hardware
    from ..bench import ops_bench
    from ..ops import OPS

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
    from ..bench.specs import SPECS

    benched = [name for name in OPS if name in SPECS]
    op_names = [o.strip() for o in (args.ops or "").split(",") if o.strip()]
    if args.ops is not None and (not op_names or set(op_names) - set(benched)):
        raise UserError(f"--ops: got {args.ops!r}; expected a comma list of {', '.join(benched)}")
    json_path, png_path = bench_outputs(args, "ops")
    return ops_bench.run(dtypes, args.quick, args.rounds, json_path, png_path, pin=not args.no_pin_allocator,
                         isas=isas, op_names=op_names)


def cmd_bench_e2e(args) -> int:
    from ..bench import e2e_bench
    from ..quant import export

    if args.model and export.int8_format(args.model):  # transformers would decompress it: a float model, "unpatched"
        raise UserError(f"--model: {args.model} is an int8 checkpoint; bench e2e times a float model against itself "
                        f"patched (give the float checkpoint, with --quant w8a8 for the W8A8 variant; `infer --model "
                        f"{args.model} --use_pto --quant w8a8` times the export as stored)")
    if args.config:
        _random_weight_config(args)
    json_path, png_path = bench_outputs(args, "e2e")
    return e2e_bench.run(args.num_layers, args.vision_depth, args.repeats, args.max_new_tokens, args.image,
                         args.quick, json_path, png_path, args.dtype, args.quant, args.model, args.config)


def _random_weight_config(args) -> None:
    """--config for bench e2e: a multimodal family's config that random weights can be built from, not with --model."""
    if args.model:
        raise UserError("--model and --config: give one (a checkpoint, or a config for random weights)")
    family = config_family(args.config)
    if not family.multimodal:
        raise UserError(f"--config: bench e2e builds random weights for a vision-language family's config "
                        f"(modeling/gutenocr_3b, modeling/qwen3_vl_2b), not {family.name}'s")


def cmd_bench_cases(args) -> int:
    from ..bench import cases_bench
    from ..ops import registry

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [b for b in backends if b not in registry.BACKENDS]
    if bad or not backends:
        raise UserError(f"--backends: got {args.backends!r}; expected a comma list of {', '.join(registry.BACKENDS)}")
    return cases_bench.run_cases(args.file, backends, args.rounds, args.json)


def cmd_bench_pypto(args) -> int:
    from ..bench import cases_bench

    json_path, png_path = bench_outputs(args, "pypto")
    return cases_bench.run_pypto(args.file, json_path, png_path, tune=args.tune, documents=not args.no_documents,
                                 max_elements=args.max_elements)


def pypto_layer_page_cost() -> str:
    """What `bench layer --page` costs, measured (said in --help and before the run starts)."""
    return ("67 minutes on two cores, 5.4 GB of memory and, at its peak, hundreds of GB of PyPTO SIM output on disk "
            "(370 GB written in the run of 2026-12-05)")


def cmd_bench_layer(args) -> int:
    from ..bench import pypto_layer

    try:
        model = pypto_layer.layer_model(args.config) if args.config else None
    except (OSError, ValueError) as e:
        raise UserError(str(e) if str(e).startswith("--config") else f"--config: {e}") from None
    sizes = (512, 3744, [1024, 4096]) if args.page else (128, 256, [1024])
    tokens, vision, kv = (given if given is not None else default
                          for given, default in zip((args.tokens, args.vision_tokens, args.kv), sizes))
    if args.page:
        print(f"bench layer --page: the document page's shapes on PyPTO's SIM: about {pypto_layer_page_cost()}; "
              f"Ctrl-C stops it", flush=True)
    json_path, png_path = bench_outputs(args, "layer")
    return pypto_layer.run_layer(tokens, vision, json_path, kv_lengths=kv, png_path=png_path, model=model)


def cmd_bench_vllm(args) -> int:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise UserError("bench vllm: vLLM is not installed in this python; run it with vLLM's venv "
                        "(scripts/make_vllm_env.sh, then .venv-vllm/bin/pypto-gym bench vllm)")
    from ..bench import vllm_bench

    json_path, png_path = bench_outputs(args, "vllm")
    return vllm_bench.run(args.layers, args.dtype, args.quick, args.rounds, json_path, png_path)


def cmd_bench_gemm(args) -> int:
    from ..bench import w8a8_bench

    json_path, png_path = bench_outputs(args, "gemm")
    return w8a8_bench.run_gemm(args.rounds, json_path, png_path)


def cmd_bench_w8a8(args) -> int:
    from ..bench import w8a8_bench

    if args.llmcompressor is not None and not Path(args.llmcompressor).is_file():
        raise UserError(f"--llmcompressor: no python at {args.llmcompressor}")
    json_path, png_path = bench_outputs(args, "w8a8")
    return w8a8_bench.run_accuracy(args.quick, json_path, png_path, args.float_linears, args.sensitivity,
                                   args.llmcompressor)


