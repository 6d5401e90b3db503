"""rope's and qk_norm_rope's goldens against independent evidence: a rotation worked by hand, the fp64
rotation of each pair, HF's own functions and modules (of whichever transformers is installed: CI runs
this module on 5.x and on 4.57, whose MRoPE function only the latter has), and the layouts HF hands over.

Everything else about the ops (opcheck, refusals of wrong types, backward, compile, the cpu/pypto/npu
backends against the golden on their examples, the case format) comes from the definitions through the
parametrised suites.
"""
import importlib
import math

import pytest
import torch

from pypto_gym import ops
from pypto_gym.ops import OPS

from support import assert_close, run_on

qwen2_5_vl = importlib.import_module("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl")
qwen3 = importlib.import_module("transformers.models.qwen3.modeling_qwen3")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def hf_text_inputs(dtype, B=2, S=7, H=16, Hk=2, D=128, seed=0):
    """q, k as HF's text attention hands them over ([B, H, S, D] views of [B, S, H, D] projections) and
    cos/sin as its rotary embedding makes them (cat of the frequencies twice, in the model dtype)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(B, S, Hk, D, generator=gen).to(dtype).transpose(1, 2)
    angles = torch.rand(B, S, D // 2, generator=gen) * 50
    emb = torch.cat((angles, angles), dim=-1)
    return q, k, emb.cos().to(dtype), emb.sin().to(dtype)


def hf_vision_inputs(dtype, S=37, H=16, D=80, seed=0):
    """q, k as the vision attention hands them over: strided views of one qkv projection; fp32 cos/sin."""
    gen = torch.Generator().manual_seed(seed)
    q, k, _ = torch.randn(S, 3 * H * D, generator=gen).to(dtype).reshape(S, 3, H, D).permute(1, 0, 2, 3).unbind(0)
    angles = torch.rand(S, D // 2, generator=gen) * 50
    emb = torch.cat((angles, angles), dim=-1)
    return q, k, emb.cos(), emb.sin()


def test_hand_worked_rotation():
    """D = 4: the pairs (x0, x2) and (x1, x3) rotate by their own angles, (a, b) -> (a cos - b sin, b cos + a sin)."""
    q = torch.tensor([[[[1.0, 2.0, 3.0, 4.0]]]])
    t0, t1 = math.pi / 2, math.pi / 3
    cos = torch.tensor([[[math.cos(t0), math.cos(t1), math.cos(t0), math.cos(t1)]]])
    sin = torch.tensor([[[math.sin(t0), math.sin(t1), math.sin(t0), math.sin(t1)]]])
    expected = [1 * 0 - 3 * 1, 2 * 0.5 - 4 * math.sqrt(3) / 2, 3 * 0 + 1 * 1, 4 * 0.5 + 2 * math.sqrt(3) / 2]
    for mode in ("hf", "fp32"):
        q_embed, k_embed = ops.rope(q, q, cos, sin, cast_mode=mode, backend="torch")
        assert q_embed.flatten().tolist() == pytest.approx(expected, abs=1e-6)
        assert torch.equal(q_embed, k_embed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp32_mode_is_the_fp64_rotation_rounded_once_per_step(dtype):
    """Against the rotation in fp64: fp32 mode's error is a few fp32 ulps of the pair's magnitude, then one
    rounding to the dtype; each pair keeps its length."""
    q, k, cos, sin = hf_text_inputs(dtype)
    q_embed, _ = ops.rope(q, k, cos, sin, cast_mode="fp32", backend="torch")
    qd, c, s = q.double(), cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    h = q.shape[-1] // 2
    x1, x2 = qd[..., :h], qd[..., h:]
    exact = torch.cat((x1 * c[..., :h] - x2 * s[..., :h], x2 * c[..., h:] + x1 * s[..., h:]), dim=-1)
    pair = (x1.square() + x2.square()).sqrt().repeat(1, 1, 1, 2)
    err = (q_embed.double() - exact).abs() / pair
    assert float(err.max()) <= torch.finfo(dtype).eps + 4 * torch.finfo(torch.float32).eps


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_hf_mode_is_bit_identical_to_the_text_function(dtype):
    q, k, cos, sin = hf_text_inputs(dtype)
    expected = qwen3.apply_rotary_pos_emb(q, k, cos, sin)
    for got in (ops.rope(q, k, cos, sin, backend="torch"), run_on("cpu", OPS["rope"], (q, k, cos, sin, [], 1, "hf"))):
        assert all(torch.equal(a, b) and a.stride() == b.stride() for a, b in zip(got, expected))
    # an fp32 cos with a low-precision q: HF promotes, and so does the op
    expected = qwen3.apply_rotary_pos_emb(q, k, cos.float(), sin.float())
    got = run_on("cpu", OPS["rope"], (q, k, cos.float(), sin.float(), [], 1, "hf"))
    assert all(torch.equal(a, b) for a, b in zip(got, expected)) and got[0].dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp32_mode_is_bit_identical_to_the_vision_function(dtype):
    q, k, cos, sin = hf_vision_inputs(dtype)
    expected = qwen2_5_vl.apply_rotary_pos_emb_vision(q, k, cos, sin)
    args = (q, k, cos, sin, [], -2, "fp32")
    for got in (OPS["rope"].golden(*args), run_on("cpu", OPS["rope"], args)):
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    if dtype != torch.float32:  # the text rounding is not the vision one
        assert not torch.equal(ops.rope(q, k, cos, sin, unsqueeze_dim=-2, backend="torch")[0], expected[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mrope_planes_give_what_each_transformers_version_computes(dtype):
    """The (3, B, S, D) planes with mrope_section: 4.57's apply_multimodal_rotary_pos_emb where it exists, and
    on every version the same as merging as 5.x's rotary embedding does and rotating the merged form."""
    q, k, _, _ = hf_text_inputs(dtype)
    gen = torch.Generator().manual_seed(3)
    angles = torch.rand(3, 2, 7, 64, generator=gen) * 50
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    section = [16, 24, 24]
    args = (q, k, cos, sin, section, 1, "hf")
    got = [OPS["rope"].golden(*args), run_on("cpu", OPS["rope"], args)]
    if hasattr(qwen2_5_vl, "apply_multimodal_rotary_pos_emb"):  # transformers 4.57
        expected = qwen2_5_vl.apply_multimodal_rotary_pos_emb(q, k, cos, sin, section)
    else:  # 5.x: Qwen2_5_VLRotaryEmbedding.recomposition_frequencies on the half-width frequencies
        def recompose(freq):
            freq = torch.cat([m[i % 3] for i, m in enumerate(freq.split(section, dim=-1))], dim=-1)
            return torch.cat((freq, freq), dim=-1)

        expected = qwen2_5_vl.apply_rotary_pos_emb(q, k, recompose(angles.cos().to(dtype)),
                                                   recompose(angles.sin().to(dtype)))
    for g in got:
        assert all(torch.equal(a, b) for a, b in zip(g, expected))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_partial_rotary_rotates_the_first_dims_and_passes_the_rest(dtype):
    q, k, cos, sin = hf_text_inputs(dtype, D=96)
    cos, sin = cos[..., :64], sin[..., :64]
    args = (q, k, cos, sin, [], 1, "hf")
    for q_embed, k_embed in (OPS["rope"].golden(*args), run_on("cpu", OPS["rope"], args)):
        assert torch.equal(q_embed[..., 64:], q[..., 64:]) and torch.equal(k_embed[..., 64:], k[..., 64:])
        assert torch.equal(q_embed[..., :64], qwen3.apply_rotary_pos_emb(q[..., :64], k[..., :64], cos, sin)[0])


def test_a_cos_shared_by_some_leading_dims_only_is_materialised_exactly():
    """q [2, 3, H, S, D] with cos [3, S, D] (shared over the first dim only): no kernel reads that broadcast
    directly, so the cpu backend copies cos out; the result is still the golden's."""
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 3, 4, 5, 32, generator=gen), torch.randn(2, 3, 2, 5, 32, generator=gen)
    cos, sin = torch.randn(3, 5, 32, generator=gen), torch.randn(3, 5, 32, generator=gen)
    args = (q, k, cos, sin, [], 1, "hf")
    got = run_on("cpu", OPS["rope"], args)
    assert all(torch.equal(a, b) for a, b in zip(got, OPS["rope"].golden(*args)))


@pytest.mark.parametrize("call,match", [
    (lambda q, k, c: ops.rope(q, k, c[..., :63], c[..., :63]), r"cos: rotary dim E=63 .*expected an even E"),
    (lambda q, k, c: ops.rope(q[..., :32], k[..., :32], c, c), "cos: rotary dim E=128 exceeds the head dim D=32"),
    (lambda q, k, c: ops.rope(q, k, c, c, [16, 24, 24]), r"cos: shape \(2, 7, 128\); with mrope_section expected"),
    (lambda q, k, c: ops.rope(q, k, c.expand(3, 2, 7, 128), c.expand(3, 2, 7, 128), [16, 24, 20]),
     r"mrope_section: \[16, 24, 20\] sums to 60; expected E/2 = 64"),
    (lambda q, k, c: ops.rope(q, k, c, c, unsqueeze_dim=4), r"unsqueeze_dim: got 4; expected a dim in \[-4, 3\]"),
    (lambda q, k, c: ops.rope(q, k, c, c, unsqueeze_dim=2), r"q: shape \(2, 16, 7, 128\) does not broadcast"),
    (lambda q, k, c: ops.rope(q, k[:1], c, c), r"k: shape \(1, 2, 7, 128\) does not broadcast"),
    (lambda q, k, c: ops.rope(q, k, c, c, unsqueeze_dim=True), "unsqueeze_dim: expected an int, got bool"),
])
def test_layouts_hf_would_not_accept_are_refused_naming_the_argument(call, match):
    q, k, cos, _ = hf_text_inputs(torch.float32)
    with pytest.raises((ValueError, TypeError), match=match):
        call(q, k, cos)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qk_norm_rope_is_qwen3s_norms_then_its_rotation(dtype):
    """hf mode against a real Qwen3 attention's own q_norm/k_norm, transpose and apply_rotary_pos_emb."""
    from transformers import Qwen3Config

    config = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6)
    attn = qwen3.Qwen3Attention(config, layer_idx=0).to(dtype)
    with torch.no_grad():
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.copy_(1 + 0.1 * torch.randn(32))
    gen = torch.Generator().manual_seed(7)
    q_proj, k_proj = torch.randn(2, 5, 4, 32, generator=gen).to(dtype), torch.randn(2, 5, 2, 32, generator=gen).to(dtype)
    cos, sin = hf_text_inputs(dtype, S=5, D=32)[2:]
    with torch.no_grad():
        expected = qwen3.apply_rotary_pos_emb(attn.q_norm(q_proj).transpose(1, 2), attn.k_norm(k_proj).transpose(1, 2),
                                              cos, sin)
    args = (q_proj.transpose(1, 2), k_proj.transpose(1, 2), attn.q_norm.weight.detach(), attn.k_norm.weight.detach(),
            cos, sin, [], 1e-6, 1e-6, 1, "hf")
    assert all(torch.equal(a, b) for a, b in zip(OPS["qk_norm_rope"].golden(*args), expected))
    fp32 = ops.qk_norm_rope(*args[:9], unsqueeze_dim=1, cast_mode="fp32", backend="torch")
    exact_norm = [x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
                  for x, w in ((args[0], args[2]), (args[1], args[3]))]
    exact = OPS["rope"].golden(*exact_norm, cos.double(), sin.double())
    for got, want in zip(fp32, exact):  # one rounding of the fp64 value, plus fp32 steps
        assert float((got.double() - want).abs().max()) <= 2 * torch.finfo(dtype).eps * float(want.abs().max())


def _strided_calls(dtype):
    """Views HF never hands over but a user may: a last dim with stride 2, cos/sin every other column of a wider
    table, a cos expanded along its last dim (stride 0)."""
    gen = torch.Generator().manual_seed(3)
    q, k, cos, sin = hf_text_inputs(dtype, B=1, S=5, H=4, Hk=2, D=32, seed=3)
    wide_q = torch.randn(1, 4, 5, 64, generator=gen).to(dtype)
    table = torch.randn(1, 5, 64, generator=gen).to(dtype)
    flat = torch.randn(1, 5, 1, generator=gen).to(dtype).expand(1, 5, 32)
    return {"q[..., ::2]": (wide_q[..., ::2], k, cos, sin),
            "cos, sin = table[..., ::2]": (q, k, table[..., ::2], table[..., 1::2]),
            "cos expanded along D": (q, k, flat, flat.neg())}


@pytest.mark.parametrize("op_name", ["rope", "qk_norm_rope"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_takes_a_strided_last_dim_as_the_golden_does(op_name, dtype):
    """The cpu kernels step along D by one element: q[..., ::2] or a strided cos gave errors of 6.6-21, a cos
    expanded along D read past its storage. Such inputs are copied first; results equal the golden's."""
    op = OPS[op_name]
    for what, (q, k, cos, sin) in _strided_calls(dtype).items():
        if op_name == "rope":
            args = (q, k, cos, sin, [], 1, "hf")
        else:
            w = torch.rand(32, generator=torch.Generator().manual_seed(1)).to(dtype) + 0.5
            args = (q, k, w, w.flip(0), cos, sin, [], 1e-6, 1e-5, 1, "hf")
        got, want = run_on("cpu", op, args), op.golden(*args)
        assert_close(got, want, op.outputs)  # rope: bit-identical; qk_norm_rope: its norm's sum order differs
        assert op_name == "qk_norm_rope" or all(torch.equal(g, w_) for g, w_ in zip(got, want)), what
        assert all(g.stride() == w_.stride() for g, w_ in zip(got, want)), what


@pytest.mark.parametrize("backend", ["cpu", "pypto"])
@pytest.mark.parametrize("empty", ["q", "k"])
def test_with_one_of_q_and_k_empty_the_other_is_still_rotated(backend, empty):
    """The kernels rotated nothing when either was empty and returned the other output uninitialised."""
    if backend == "pypto":
        from pypto_gym.ops import registry

        if registry.get("pypto").unavailable_reason():
            pytest.skip(registry.get("pypto").unavailable_reason())
    q, k, cos, sin = hf_text_inputs(torch.float32, B=1, S=3, H=2, Hk=2, D=16)
    if empty == "q":
        q = q[:, :0]
    else:
        k = k[:, :0]
    w = torch.rand(16, generator=torch.Generator().manual_seed(2)) + 0.5
    for op, args in ((OPS["rope"], (q, k, cos, sin, [], 1, "hf")),
                     (OPS["qk_norm_rope"], (q, k, w, w * 2, cos, sin, [], 1e-6, 1e-6, 1, "hf"))):
        got, want = run_on(backend, op, args), op.golden(*args)
        for g, w_ in zip(got, want):
            assert g.shape == w_.shape and torch.allclose(g, w_, rtol=1e-5, atol=1e-6), op.name


# ---- rotary_embedding: vLLM's form of the same rotation --------------------------------------------------------
def test_rotary_embedding_reads_the_angles_at_each_position_hand_worked():
    """head 4, rot 4: the cache row at position 2 holds (cos t0, cos t1, sin t0, sin t1); query [1, 2, 3, 4] at
    position 2 rotates as the hand-worked pairs above, the key at position 0 (angle 0) is unchanged."""
    t0, t1 = math.pi / 2, math.pi / 3
    cache = torch.zeros(3, 4)
    cache[:, :2] = 1.0  # cos 0 = 1, sin 0 = 0 on the other rows
    cache[2] = torch.tensor([math.cos(t0), math.cos(t1), math.sin(t0), math.sin(t1)])
    q = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]])
    expected = [1 * 0 - 3 * 1, 2 * 0.5 - 4 * math.sqrt(3) / 2, 3 * 0 + 1 * 1, 4 * 0.5 + 2 * math.sqrt(3) / 2]
    for backend in ("torch", "cpu"):
        qo, ko = ops.rotary_embedding(torch.tensor([2, 0]), q, q, cache, 4, backend=backend)
        assert qo[0].tolist() == pytest.approx(expected, abs=1e-6)
        assert torch.equal(qo[1], q[1]) and torch.equal(ko[1], q[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("section", [(), (8, 12, 12)], ids=["rope", "mrope"])
def test_rotary_embedding_is_ropes_rotation_of_the_gathered_angles(dtype, section):
    """Gathering cos/sin by position (MRoPE: each section from its own positions row), widening them to the
    full rotary width and running HF's text function (rope's golden, cos/sin in the model dtype) gives the
    same bits: the two forms are one rotation; head 128 with partial rotary 64, GQA 4/2 heads."""
    gen = torch.Generator().manual_seed(1)
    T, rot = 7, 64
    angles = torch.rand(40, rot // 2, generator=gen) * 50
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1)
    positions = torch.randint(0, 40, (3, T) if section else (T,), generator=gen)
    qkv = torch.randn(T, 8 * 128, generator=gen).to(dtype)
    q, k, _ = qkv.split([4 * 128, 2 * 128, 2 * 128], dim=-1)
    cos, sin = cache[positions].chunk(2, dim=-1)
    if section:
        cos, sin = (torch.cat([m[i] for i, m in enumerate(t.split(list(section), -1))], -1) for t in (cos, sin))
    cos, sin = (torch.cat((t, t), -1).to(dtype) for t in (cos, sin))
    want = OPS["rope"].golden(q.reshape(T, 4, 128), k.reshape(T, 2, 128), cos, sin, (), -2, "hf")
    got = ops.rotary_embedding(positions, q, k, cache, 128, section, backend="torch")
    assert torch.equal(got[0], want[0].reshape(T, -1)) and torch.equal(got[1], want[1].reshape(T, -1))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_rotary_embedding_into_its_inputs_rotates_them_in_place(backend):
    """The form vLLM calls: q and k, views of one qkv projection, are overwritten with their rotation and
    returned; v, between them in memory, is untouched."""
    gen = torch.Generator().manual_seed(2)
    T = 5
    angles = torch.rand(16, 32, generator=gen) * 50
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1).to(torch.bfloat16)
    qkv = torch.randn(T, 4 * 64, generator=gen).to(torch.bfloat16)
    before = qkv.clone()
    q, k, v = qkv.split([2 * 64, 64, 64], dim=-1)
    positions = torch.randint(0, 16, (T,), generator=gen)
    want = OPS["rotary_embedding"].golden(positions, q.clone(), k.clone(), cache, 64, (), "hf")
    got = OPS["rotary_embedding"].call((positions, q, k, cache, 64, [], "hf", False), backend, None, into=(q, k))
    assert got[0] is q and got[1] is k
    assert torch.equal(q, want[0]) and torch.equal(k, want[1])
    assert torch.equal(v, before[:, 3 * 64:])


@pytest.mark.parametrize("layout", ["[T, 1, H, D]", "strided last dim", "[T, H / 2, 2 * D]"])
def test_rotary_embedding_cpu_writes_any_layout_in_place(layout):
    """Layouts the kernel cannot read where they are (not [T, H * D] or [T, H, D] with a contiguous last dim) go
    through a stand-in, and the result still lands in the tensors given."""
    gen = torch.Generator().manual_seed(3)
    T, D = 4, 64
    cache = torch.cat([torch.rand(16, D // 2, generator=gen) * 50] * 2, dim=-1).to(torch.bfloat16)
    cache[:, D // 2:] = cache[:, D // 2:].float().sin().to(torch.bfloat16)
    if layout == "strided last dim":
        q, k = (torch.randn(T, n * 2 * D, generator=gen).to(torch.bfloat16)[:, ::2] for n in (4, 2))
    else:
        shape = (lambda n: (T, 1, n, D)) if layout == "[T, 1, H, D]" else (lambda n: (T, n // 2, 2 * D))
        q, k = (torch.randn(shape(n), generator=gen).to(torch.bfloat16) for n in (4, 2))
    positions = torch.randint(0, 16, (T,), generator=gen)
    want = OPS["rotary_embedding"].golden(positions, q.clone(), k.clone(), cache, D, (), "hf")
    got = OPS["rotary_embedding"].call((positions, q, k, cache, D, [], "hf", False), "cpu", None, into=(q, k))
    assert got[0] is q and got[1] is k
    assert torch.equal(q, want[0]) and torch.equal(k, want[1])


def test_rotary_embedding_refuses_a_position_past_the_cache():
    cache = torch.ones(4, 8)
    with pytest.raises(ValueError, match=r"positions: values 0\.\.4; expected rows of cos_sin_cache, 0\.\.3"):
        ops.rotary_embedding(torch.tensor([0, 4]), torch.ones(2, 8), torch.ones(2, 8), cache, 8)
