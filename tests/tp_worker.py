"""Run under torchrun (gloo on CPU): a tensor-parallel model's logits before and after patching.

Each rank writes its figures as JSON to OUT_DIR/rank<r>.json; tests/test_tp.py compares them.
"""
import json
import sys

import torch
import torch.distributed as dist

import pypto_gym


def main(kind: str, path: str, backend: str, out_dir: str) -> None:
    if kind == "qwen3":
        from transformers import AutoModelForCausalLM as cls
    else:
        from transformers import Qwen2_5_VLForConditionalGeneration as cls
    model = cls.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    ids = (torch.arange(12).reshape(1, 12) * 7) % 200
    with torch.no_grad():
        before = model(input_ids=ids).logits
    pypto_gym.patch_model(model, backend=backend)
    with torch.no_grad():
        after = model(input_ids=ids).logits
    report = pypto_gym.patch_report(model).to_json()
    sharded = any(type(p).__name__ == "DTensor" for p in model.parameters())
    row = {"rank": dist.get_rank(), "world": dist.get_world_size(), "sharded": sharded,
           "patched": report["summary"]["patched"], "candidates": report["summary"]["candidates"],
           "ran_on": report["summary"]["ran_on"], "fallbacks": report["summary"]["fallbacks"],
           "rope_calls": [r["calls"] for r in report["sites"] if r["kind"] in ("text.rope", "text.qk_norm_rope")],
           "rope_bypassed": [r["fusion_bypassed"] for r in report["sites"]
                             if r["kind"] in ("text.rope", "text.qk_norm_rope")],
           "equal": torch.equal(before, after), "max_diff": float((before - after).abs().max())}
    with open(f"{out_dir}/rank{row['rank']}.json", "w") as f:
        json.dump(row, f)
    # Tear the gloo group down before the interpreter exits: left to interpreter shutdown, its
    # threads can still be joinable when their std::thread objects are destroyed, which aborts the
    # process ("terminate called without an active exception") after the work is done.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
