"""A patched model under transformers' tensor parallelism (torchrun, 2 processes, gloo on CPU).

Every rank patches every site (norms, MLPs, rotary embeddings on its shard of the heads), nothing falls back, and the logits equal the unpatched TP
model's: bit for bit on the torch backend, within the cpu kernel's rounding on the cpu backend.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from models import tiny_qwen3
from pypto_gym.models.qwen2_5_vl import TINY_DIR

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    tiny_qwen3().save_pretrained(path)
    return path


@pytest.mark.parametrize("kind", ["qwen3", "qwen2_5_vl"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_tensor_parallel_logits_unchanged_by_patching(kind, backend, qwen3_dir, tmp_path):
    path = qwen3_dir if kind == "qwen3" else TINY_DIR
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, PYTHONPATH=str(HERE), OMP_NUM_THREADS="1")
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "2",
                           str(HERE / "tp_worker.py"), kind, str(path), backend, str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(r["rank"] for r in rows) == [0, 1]
    for r in rows:
        assert r["world"] == 2 and r["sharded"]  # really tensor-parallel
        assert r["patched"] == r["candidates"] > 0 and not r["fallbacks"]
        assert set(r["ran_on"]) == {backend}
        # text only: each rank rotates its heads in the op, or (Qwen3 on transformers >= 5.25, whose TP plan hooks
        # q_norm/k_norm: "replicated_with_grad_allreduce") its fused q/k-norm + rope declines, counted, and HF's runs
        assert r["rope_calls"] and all(n > 0 or (kind == "qwen3" and b == {"q_norm/k_norm has hooks": 1})
                                       for n, b in zip(r["rope_calls"], r["rope_bypassed"])), r
        if backend == "torch":
            assert r["equal"]
        else:
            assert r["max_diff"] < 1e-4
