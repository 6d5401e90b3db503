"""Does vLLM serve an export as pypto-gym runs it? Greedy tokens and top-k logprobs from both, side by side.

vLLM runs in its own venv (scripts/make_vllm_env.sh), as a subprocess of scripts/vllm_generate.py given
token-id prompts; pypto-gym runs the same export from its int8 weights (quant.export.load) on the same ids.
Both in bf16: vLLM's CPU int8 GEMM takes bf16 or fp16 activations only, and its fp16 path has no scalar
fallback on AVX-512 (refused), so bf16 is what a CPU deployment of these exports runs.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

GENERATE = Path(__file__).resolve().parents[2] / "scripts" / "vllm_generate.py"
MARK = "vllm_generate: "  # the script's answer line


def vllm_run(python: str, model_dir, prompts: list[list[int]], max_tokens: int, logprobs: int = 5,
             dtype: str = "bfloat16", timeout: float = 900, env: dict | None = None, tensor_parallel_size: int = 1,
             processes: bool = False) -> dict:
    """{"quantization", "outputs": [{"token_ids", "logprobs": [{token id: logprob}]}]} from vLLM's greedy run; with
    `processes` (or tensor parallel) in the engine core and worker processes a deployment runs, else all in one
    process (scripts/vllm_generate.py: the same tokens, half the start-up)."""
    with tempfile.TemporaryDirectory() as tmp:
        request = Path(tmp) / "request.json"
        request.write_text(json.dumps({"prompts": prompts, "max_tokens": max_tokens, "logprobs": logprobs,
                                       "dtype": dtype, "tensor_parallel_size": tensor_parallel_size,
                                       "processes": processes}))
        proc = subprocess.run([python, str(GENERATE), str(model_dir), str(request)], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})})
    answer = [line[len(MARK):] for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if proc.returncode != 0 or not answer:
        causes = []  # the exceptions vLLM's processes printed, each once, in order
        for line in (proc.stdout + proc.stderr).splitlines():
            cause = line.split("] ")[-1].strip()
            if ("Error: " in cause or "Exception: " in cause) and cause not in causes:
                causes.append(cause)
        raise RuntimeError(f"vLLM on {model_dir} failed (exit {proc.returncode}): {'; '.join(causes)[-2000:]}")
    return json.loads(answer[-1])


def own_run(model_dir, prompts: list[list[int]], max_tokens: int, logprobs: int = 5, dtype: str = "bfloat16") -> dict:
    """The same greedy run from pypto-gym's load of the export, on the fused kernels, in vLLM's answer's shape."""
    import torch

    from ..quant import export

    model, _, _, report = export.load(model_dir, backend="cpu", dtype=dtype)
    import inspect

    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # 5.x : 4.57
    outputs = []
    for ids in prompts:  # greedy, EOS ignored (as vLLM's ignore_eos): no logits processor between model and argmax
        tokens, steps, past, step_ids = [], [], None, torch.tensor([ids])
        with torch.no_grad():
            for _ in range(max_tokens):
                out = model(input_ids=step_ids, use_cache=True, **{cache_arg: past})
                past = out[cache_arg]
                lp = torch.log_softmax(out.logits[0, -1].float(), -1)
                top = lp.topk(logprobs)
                steps.append({str(int(t)): float(v) for t, v in zip(top.indices, top.values)})
                tokens.append(int(lp.argmax()))
                step_ids = torch.tensor([[tokens[-1]]])
        outputs.append({"token_ids": tokens, "logprobs": steps})
    return {"int8_linears": report.to_json()["w8a8"]["summary"]["int8"], "outputs": outputs}


def agreement(theirs: dict, ours: dict) -> dict:
    """Two greedy runs side by side, per vLLM's own rule for comparing engines (its tests' check_logprobs_close):
    per prompt the tokens are compared up to the first step where they differ; there each side's token must be in
    the other's top-k (a near-tie between two candidates that rounding decides, which greedy decoding then follows
    into different contexts, so the rest of that prompt is not compared). `tokens_equal`: no prompt diverged;
    `close`: every divergence was such a near-tie. Over the compared steps: the largest |logprob difference| of the
    tokens both top-k lists hold, also in bf16 ulps of that logprob (`max_logprob_diff_ulps`: the rounding a bf16
    model's logits carry), the smallest share of top-k tokens both hold, and `max_topk_gap_ulps`: how far (bf16
    ulps) a token one list holds and the other does not lies above the other list's k-th logprob (near 0: a tie
    at the boundary, which a nearly flat distribution such as a tiny random model's has many of)."""
    equal, close, diverged, diffs, ulps, overlap, gaps = [], [], [], [0.0], [0.0], [1.0], [0.0]
    for t, o in zip(theirs["outputs"], ours["outputs"]):
        steps = list(zip(t["token_ids"], o["token_ids"], t["logprobs"], o["logprobs"]))
        where = next((i for i, (a, b, _, _) in enumerate(steps) if a != b), None)
        equal.append(where is None and len(t["token_ids"]) == len(o["token_ids"]))
        diverged.append(where)
        if where is not None:
            a, b, ts, os_ = steps[where]
            close.append(str(a) in os_ and str(b) in ts)
        for _, _, ts, os_ in steps[:None if where is None else where + 1]:
            both = set(ts) & set(os_)
            overlap.append(len(both) / max(1, len(ts)))
            for one, other in ((ts, os_), (os_, ts)):
                floor = min(other.values())
                gaps += [(one[k] - floor) / bf16_ulp(floor) for k in set(one) - both]
            for k in both:
                d = abs(ts[k] - os_[k])
                diffs.append(d)
                ulps.append(d / bf16_ulp(max(abs(ts[k]), abs(os_[k]))))
    return {"tokens_equal": all(equal), "close": all(close), "prompts": len(equal), "diverged_at": diverged,
            "max_logprob_diff": max(diffs), "max_logprob_diff_ulps": max(ulps), "min_topk_overlap": min(overlap),
            "max_topk_gap_ulps": max(gaps)}


def bf16_ulp(x: float) -> float:
    """The spacing of bf16 values at |x| (8 significant bits)."""
    import math

    return 2.0 ** (math.floor(math.log2(max(abs(x), 2.0 ** -126))) - 7)
