"""vLLM's own throughput on one model, as `bench vllm` measures it (run with vLLM's python, one process a run):

    python -m pypto_gym.vllm.throughput MODEL_DIR DTYPE  ->  'throughput: {JSON}' on stdout

The plugin is on or off by the environment it inherits (PYPTO_GYM_VLLM). Token-id prompts (no tokenizer
needed: GutenOCR-3B's text model is written with random weights and no tokenizer), greedy, EOS ignored:
- prefill: 4 prompts of 256 tokens with max_tokens=1 -> prompt tokens per second;
- decode at batch 1 and 16: 33 tokens per prompt from an 8-token prompt, the one-token run's time taken off,
  -> generated tokens per second over the 32 decode steps.
Each figure is the best of five runs after a warm-up run (decode is the difference of two such times: with the
best of two, GutenOCR-3B's batch-1 decode moved by 9 % between two identical sides; the runs are seconds, the
engine's start a minute).
"""
import json
import os
import sys
import time

RUNS = 5


def main(model: str, dtype: str) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype=dtype, max_model_len=512, enforce_eager=True, seed=0, skip_tokenizer_init=True,
              max_num_seqs=16)

    def timed(prompts, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t0

    def best(prompts, max_tokens):
        return min(timed(prompts, max_tokens) for _ in range(RUNS))

    timed([[1] * 8], 2)  # warm-up
    long = [[(i * 7 + j) % 1000 + 1 for j in range(256)] for i in range(4)]
    out = {"prefill_tokens_per_s": 4 * 256 / best(long, 1)}
    for batch in (1, 16):
        prompts = [[(i * 3 + j) % 1000 + 1 for j in range(8)] for i in range(batch)]
        decode_s = best(prompts, 33) - best(prompts, 1)
        out[f"decode_tokens_per_s_batch{batch}"] = batch * 32 / max(decode_s, 1e-9)
    print("throughput: " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
