"""A patched model under torch.compile, as transformers' own generate compiles it: one decode graph whatever
the prompt lengths (as the unpatched model), and the tokens of eager (SPEC 12).

generate compiles the decode step when the cache is static and a CompileConfig allows the device; the
prefill runs eagerly, so a fast path that remembers something per call in an attribute dynamo guards on
(a bound op's last call, a counter) changes that attribute between graphs and recompiles the decode graph
for every new prompt, and `fullgraph=True` with no recompilation allowed then fails. Counted with dynamo's
own counters, for every site kind of four families (Qwen3-VL's text decode among them), in bf16 and in W8A8.
"""
import copy

import pytest
import torch
from torch._dynamo.utils import counters

from pypto_gym import models, patch_model

PROMPTS = ["Hello there", "Count from one to ten, slowly please", "What is an RMS norm? Say it in one long sentence"]


def _generate(model, processor, compiled: bool):
    """Greedy tokens of each prompt in turn (static cache sized once), and the decode graphs dynamo compiled."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True, dynamic=False)
    config._compile_all_devices = True  # on the CPU too, as transformers' own compile test does
    torch._dynamo.reset()
    counters.clear()
    tokens = []
    for prompt in PROMPTS:
        batch = processor([prompt], None, model)
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=5, do_sample=False, cache_implementation="static",
                                 max_cache_len=64, **({"compile_config": config} if compiled else
                                                      {"disable_compile": True}))
        tokens.append(out[0, batch["input_ids"].shape[1]:].tolist())
    return tokens, counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def loaded():
    cache = {}

    def load(name, dtype):
        if (name, dtype) not in cache:
            cache[name, dtype] = models.FAMILIES[name].load(models.FAMILIES[name].tiny_dir, dtype)
        return cache[name, dtype]
    return load


# command 2: each family, each quant mode and both dtypes at least once; the other combinations (the same compile
# paths, ~10 s each) in CI's second step (`integration`)
FAST = {("qwen3", None, "bfloat16"), ("llama", "w8a8", "bfloat16"), ("qwen2_5_vl", None, "bfloat16"),
        ("qwen2_5_vl", "w8a8", "float32")}
CASES = [(name, quant, "bfloat16") for name in ("qwen3", "llama", "qwen2_5_vl") for quant in (None, "w8a8")]
CASES += [("qwen3", None, "float32"), ("qwen2_5_vl", "w8a8", "float32"), ("qwen3_vl", None, "bfloat16")]
CASES = [case if case in FAST else pytest.param(*case, marks=pytest.mark.integration) for case in CASES]


@pytest.mark.parametrize("name,quant,dtype", CASES)
def test_a_patched_model_compiles_one_decode_graph_and_generates_eager_tokens(loaded, name, quant, dtype):
    model, processor = loaded(name, dtype)
    _, unpatched_graphs = _generate(copy.deepcopy(model), processor, compiled=True)
    patched = copy.deepcopy(model)
    report = patch_model(patched, backend="cpu", quant=quant)
    eager, _ = _generate(patched, processor, compiled=False)
    calls_before = report.to_json()["summary"]["calls"]
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        tokens, graphs = _generate(patched, processor, compiled=True)
    assert unpatched_graphs == 1 and graphs == unpatched_graphs, (graphs, unpatched_graphs)
    assert tokens == eager
    summary = report.to_json()["summary"]
    assert summary["calls"] > calls_before and not summary["fallbacks"]  # the compiled graph ran the kernels
    rows = report.to_json()["sites"]
    assert all(r["calls"] > 0 for r in rows if r["status"] == "patched" and not r["fused_into"]
               and not r["kind"].startswith("vision"))
