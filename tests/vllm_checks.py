"""Run by vLLM's python (tests/test_vllm.py): pypto-gym's providers against vLLM's own reference code, in vLLM.

    .venv-vllm/bin/python tests/vllm_checks.py   ->  one JSON line: {check name: [failures]}

Each provider is compared with what vLLM runs without it on the CPU: `vllm.ir.ops.<op>.impls["native"]` for the
norms, the layer's `forward_native` for SiluAndMul and MRotaryEmbedding, vLLM's C++ `rotary_embedding` (the
parent's `forward_cpu`, in place) for RotaryEmbedding, on random inputs of every float dtype and the layouts vLLM
hands over (partial rotary, GQA head counts, MRoPE sections, 2-D positions). That vLLM's CPU rotary op is not its
`forward_native` in 16-bit dtypes (one rounding, not one per product) is checked too: the provider follows the op. On the `torch` backend (pypto-gym's
goldens in the cast mode and norm input the provider uses) bit for bit: the semantics are vLLM's; on `cpu` within SPEC 5's
rule, as the cpu kernels are of the goldens. A call the provider must decline is declined with its reason.
"""
import json
import os
import sys

os.environ["PYPTO_GYM_VLLM"] = "1"
os.environ["PYPTO_GYM_STRICT"] = "0"  # declines are checked, not raised


def main() -> int:
    import torch
    from vllm.ir import ops as ir_ops

    from pypto_gym import vllm as plugin
    from pypto_gym.vllm import providers

    plugin.register()
    failures = {}
    gen = torch.Generator().manual_seed(0)

    from pypto_gym.precision import compare

    def check(name, ok, detail=""):
        failures.setdefault(name, [])
        if not ok:
            failures[name].append(detail)

    def same(got, want):  # bit for bit on torch, SPEC 5 on the cpu kernels
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        if providers.BACKEND == "torch":
            return all(torch.equal(g, w) for g, w in zip(got, want))
        return all(compare(g, w).passed and g.dtype == w.dtype for g, w in zip(got, want))

    for backend in ("torch", "cpu"):
        providers.BACKEND = backend
        run_checks(backend, check, same, gen, providers, ir_ops)
    calls = {op: row["calls"] for op, row in providers.COUNTERS.to_json().items()}
    check("every provider called", all(calls.values()), json.dumps(calls))
    print("vllm_checks: " + json.dumps(failures))
    return 0


def run_checks(backend, check, same, gen, providers, ir_ops):
    import torch

    from pypto_gym.precision import compare
    from vllm.config import VllmConfig, set_current_vllm_config

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for T, D in ((1, 128), (7, 2048), (33, 64)):
            x = (torch.randn(T, D, generator=gen) * 3).to(dtype)
            w = (1 + 0.1 * torch.randn(D, generator=gen)).to(dtype)
            r = torch.randn(T, D, generator=gen).to(dtype)
            for weight in (w, None):
                want = ir_ops.rms_norm.impls["native"].impl_fn(x, weight, 1e-6)
                assert providers.rms_norm_supports(x, weight, 1e-6)
                got = providers.rms_norm(x, weight, 1e-6)
                check(f"{backend} rms_norm", same(got, want), f"{dtype} {T}x{D} weight={weight is not None}")
            want = ir_ops.fused_add_rms_norm.impls["native"].impl_fn(x, r, w, 1e-6)
            assert providers.fused_add_rms_norm_supports(x, r, w, 1e-6)
            got = providers.fused_add_rms_norm(x, r, w, 1e-6)
            check(f"{backend} fused_add_rms_norm", same(got, want), f"{dtype} {T}x{D}")
    for name, supports in (("rms_norm", lambda: providers.rms_norm_supports(x, w, 1e-6, 64)),
                           ("fused_add_rms_norm", lambda: providers.fused_add_rms_norm_supports(x, r, w, 1e-6, 64))):
        check(f"{name} declines variance_size", not supports()
              and any("variance_size" in reason for reason in providers.COUNTERS.declined[name]), "not declined")

    with set_current_vllm_config(VllmConfig()):
        from vllm.model_executor.layers.activation import SiluAndMul
        from vllm.model_executor.layers.rotary_embedding import get_rope
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

        silu = SiluAndMul()
        check("SiluAndMul is pypto-gym's", type(silu).__name__ == "PyptoGymSiluAndMul", type(silu).__name__)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = (torch.randn(5, 2 * 688, generator=gen) * 2).to(dtype)
            check(f"{backend} SiluAndMul", same(silu.forward_cpu(x), SiluAndMul.forward_native(x)), f"{dtype}")
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for head, rot, heads, kv in ((128, 128, 4, 2), (64, 32, 2, 1), (80, 80, 16, 16)):
                rope = get_rope(head, max_position=512, is_neox_style=True,
                                rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": rot / head},
                                dtype=dtype)
                check("RotaryEmbedding is pypto-gym's", "PyptoGym" in type(rope).__name__, type(rope).__name__)
                T = 9
                pos = torch.randint(0, 512, (T,), generator=gen)
                q = torch.randn(T, heads * head, generator=gen).to(dtype)
                k = torch.randn(T, kv * head, generator=gen).to(dtype)
                op = RotaryEmbedding.forward_cpu(rope, pos, q.clone(), k.clone())  # vLLM's C++ op
                native = rope.forward_native(pos, q.clone(), k.clone())
                if dtype == torch.bfloat16 and rot == 128:  # the op's one rounding is not forward_native's
                    check("vLLM's CPU rotary op rounds once", not torch.equal(native[0], op[0]), "equal")
                q2, k2 = q.clone(), k.clone()
                got = rope.forward_cpu(pos, q2, k2)
                # in fp32 the C++ op contracts x*cos - y*sin into an FMA (1 ulp off torch's arithmetic, in about a
                # fifth of the outputs), which the op's kernels do not: there forward_native, and the C++ op by SPEC 5
                want = native if dtype == torch.float32 else op
                check(f"{backend} RotaryEmbedding", same(got, want), f"{dtype} head {head} rot {rot}")
                check("RotaryEmbedding within SPEC 5 of vLLM's C++ op", all(
                    compare(g, o, kind="rotation").passed for g, o in zip(got, op)), f"{dtype} head {head} rot {rot}")
                check("RotaryEmbedding in place", got[0].data_ptr() == q2.data_ptr(), "not in place")
            mrope = get_rope(128, max_position=512, is_neox_style=True, dtype=dtype,
                             rope_parameters={"rope_theta": 10000.0, "rope_type": "default",
                                              "mrope_section": [16, 24, 24]})
            check("MRotaryEmbedding is pypto-gym's", "PyptoGym" in type(mrope).__name__, type(mrope).__name__)
            for pos in (torch.randint(0, 512, (3, 6), generator=gen), torch.randint(0, 512, (6,), generator=gen)):
                q = torch.randn(6, 4 * 128, generator=gen).to(dtype)
                k = torch.randn(6, 2 * 128, generator=gen).to(dtype)
                want = mrope.forward_native(pos, q.clone(), k.clone())
                got = mrope.forward_cpu(pos, q.clone(), k.clone())
                check(f"{backend} MRotaryEmbedding", same(got, want), f"{dtype} positions {tuple(pos.shape)}")
            interleaved = get_rope(128, max_position=512, is_neox_style=True, dtype=dtype,  # Qwen3-VL's
                                   rope_parameters={"rope_theta": 5000000.0, "rope_type": "default",
                                                    "mrope_section": [24, 20, 20], "mrope_interleaved": True})
            check("interleaved MRotaryEmbedding is pypto-gym's", "PyptoGym" in type(interleaved).__name__
                  and interleaved.mrope_interleaved, type(interleaved).__name__)
            pos = torch.randint(0, 512, (3, 7), generator=gen)
            q, k = torch.randn(7, 2 * 128, generator=gen).to(dtype), torch.randn(7, 128, generator=gen).to(dtype)
            stats = providers.COUNTERS.stats["MRotaryEmbedding"]
            ran = sum(stats.ran.values())
            want = interleaved.forward_native(pos, q.clone(), k.clone())
            got = interleaved.forward_cpu(pos, q.clone(), k.clone())
            check(f"{backend} interleaved MRotaryEmbedding", same(got, want) and sum(stats.ran.values()) == ran + 1,
                  f"{dtype}: ran {dict(stats.ran)}, declined {dict(providers.COUNTERS.declined['MRotaryEmbedding'])}")
        gptj = get_rope(64, max_position=64, is_neox_style=False, rope_parameters={"rope_theta": 10000.0},
                        dtype=torch.float32)
        pos, q, k = torch.arange(3), torch.randn(3, 128, generator=gen), torch.randn(3, 64, generator=gen)
        want = gptj.forward_native(pos, q.clone(), k.clone())
        got = gptj.forward_cpu(pos, q.clone(), k.clone())
        check("GPT-J rotation declined, vLLM's runs", torch.allclose(got[0], want[0], atol=1e-5)
              and any("GPT-J" in r for r in providers.COUNTERS.declined["RotaryEmbedding"]), "not declined")


if __name__ == "__main__":
    sys.exit(main())
