"""The PyPTO attention kernels against PyPTO r0.2.0's documented rules, traced without compiling.

SIM proves the tiled graph, not the device compiler: a 3-D view into `pypto.matmul` verified on SIM though the
matmul page says the chip does not take it. Here each kernel runs on a recording stand-in of the `pypto` module
whose calls check what their pages say (hicann/pypto r0.2.0 docs/api/operation/pypto-matmul.md, pypto-concat.md,
pypto-view.md; config/pypto-set_cube_tile_shapes.md through budget.py), driven through the ops' own pypto
implementations at the shapes they really launch. Needs pypto only for the kernels' helper module.
"""
import importlib.util

import pytest
import torch

if importlib.util.find_spec("pypto") is None:
    pytest.skip("the pypto extra is not installed (pip install -e '.[pypto]')", allow_module_level=True)

from pypto_gym import config, ops  # noqa: E402
from pypto_gym.ops import registry  # noqa: E402
from pypto_gym.kernels.pypto import attention, budget, lib  # noqa: E402
from pypto_gym.kernels.pypto import backend as pypto_backend  # noqa: E402
from pypto_gym.ops.defs.varlen_attention import windows  # noqa: E402

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
TORCH = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class Traced:
    """A tensor while a kernel is traced: its shape, dtype and whether it is a `pypto.view`."""

    def __init__(self, shape, dtype, view=False):
        self.shape, self.dtype, self.view = list(shape), dtype, view

    def _with(self, other):
        if isinstance(other, Traced):
            assert len(other.shape) == len(self.shape), (self.shape, other.shape)
            shape = [max(a, b) for a, b in zip(self.shape, other.shape)]
            assert all(a in (1, s) and b in (1, s) for a, b, s in zip(self.shape, other.shape, shape))
            return Traced(shape, self.dtype)
        return Traced(self.shape, self.dtype)

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = _with

    def __setitem__(self, key, value):
        assert value.shape == self.shape and value.dtype == self.dtype, (value.shape, self.shape)
        Rules.written.append(self)


class Rules:
    """The stand-in for `pypto`: records tile settings and checks each call against its page."""

    DT_FP32 = "fp32"
    written: list = []

    def __init__(self):
        self.cube = self.vec = None
        self.matmuls = []

    @staticmethod
    def Tensor():  # noqa: N802 - pypto's annotation
        return None

    def set_cube_tile_shapes(self, m, k, n):
        assert all(len(a) == 2 and 0 < a[0] <= a[1] and a[1] % a[0] == 0 for a in (m, k, n))
        self.cube = (m[0], k[0], n[0])

    def set_vec_tile_shapes(self, *tile):
        assert 0 < len(tile) <= 4 and all(t > 0 for t in tile)
        self.vec = tile

    def view(self, t, shape, offsets):
        assert len(shape) == len(offsets) == len(t.shape)
        assert all(o + s <= d for o, s, d in zip(offsets, shape, t.shape)), (shape, offsets, t.shape)
        return Traced(shape, t.dtype, view=True)

    def matmul(self, a, b, out_dtype, b_trans=False):
        assert a.dtype == b.dtype and len(a.shape) == len(b.shape) and len(a.shape) in (2, 3, 4)
        if len(a.shape) > 2:  # pypto-matmul.md: "当矩阵维度为3维或者4维时，不支持pypto.view场景"
            assert not (a.view or b.view), "a 3-D or 4-D view into pypto.matmul"
        for t, outer_inner in ((a, (0, 1)), (b, (1, 0) if b_trans else (0, 1))):
            if t.view:  # pypto-matmul.md: a view's inner axis 32-byte aligned, its outer axis 16 elements
                outer, inner = (t.shape[-2:][i] for i in outer_inner)
                assert inner * BYTES[t.dtype] % 32 == 0 and outer % 16 == 0, (t.shape, b_trans)
        M, K = a.shape[-2:]
        N = b.shape[-2] if b_trans else b.shape[-1]
        assert (b.shape[-1] if b_trans else b.shape[-2]) == K
        assert self.cube is not None, "pypto.matmul before set_cube_tile_shapes"
        m, k, n = self.cube
        assert k == K and n == N and m == M, ("the kernels hold M, K and N whole in one tile", self.cube, M, K, N)
        why = budget.matmul_problem(budget.Matmul("traced", m, k, n, BYTES[a.dtype]))
        assert why is None, why
        self.matmuls.append((M, K, N, a.dtype))
        return Traced([*a.shape[:-2], M, N], out_dtype)

    def concat(self, parts, dim):
        assert 2 <= len(parts) <= 128  # pypto-concat.md
        assert self.vec is not None and len(self.vec) == len(parts[0].shape)
        # pypto-concat.md: "设置viewshape时，dim对应维度不切块"
        assert all(self.vec[dim] >= p.shape[dim] for p in parts), ("the tile splits the concat axis", self.vec)
        shape = list(parts[0].shape)
        shape[dim] = sum(p.shape[dim] for p in parts)
        return Traced(shape, parts[0].dtype)

    def _vector(self, t):
        assert self.vec is not None and len(self.vec) == len(t.shape), (self.vec, t.shape)
        assert budget.vector_problem(tuple(self.vec)) is None
        return t

    def cast(self, t, dtype):
        return Traced(self._vector(t).shape, dtype)

    def exp(self, t):
        return Traced(self._vector(t).shape, t.dtype)

    def maximum(self, a, b):
        return a._with(b)

    def amax(self, t, dim, keepdim):
        assert keepdim and dim == -1
        return Traced([*self._vector(t).shape[:-1], 1], t.dtype)

    sum = amax


@pytest.fixture
def traced(monkeypatch):
    """Every pypto launch traced on the stand-in instead of compiled; yields the launches' matmuls."""
    seen = []

    def launch(self, name, factory, x, inputs, outputs, scalars, tiles=None, align=16, kinds=None, budget=None):
        rules = Rules()
        Rules.written = []
        monkeypatch.setattr(lib, "pypto", rules)
        monkeypatch.setattr(lib, "FP32", "fp32")
        kernel = factory(rules)
        args = [Traced(t.shape, TORCH[t.dtype]) for t in (*inputs, *outputs)]
        kernel(*args, *scalars, *tiles.shape)
        assert Rules.written == args[len(inputs):], "every output written once"
        seen.append(rules.matmuls)
        self.last_run = pypto_backend.RunInfo(1.0, 0.0, "compiled", {}, str(tiles))

    monkeypatch.setattr(pypto_backend.PyptoBackend, "launch", launch)
    return seen


def _run(op, *args, **kwargs):
    stats = ops.Stats()
    getattr(ops, op)(*args, backend="pypto", stats=stats, **kwargs)
    assert stats.ran == {"pypto": 1}, stats.fallbacks


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("mode", ["hf", "fp32"])
@pytest.mark.parametrize("D", [16, 64, 80, 128])
def test_window_attention_launches_follow_the_documented_rules(traced, dtype, mode, D):
    """A page's windows (64, 16, 100 and 128 patches over 16 heads) and a full-attention image (300 patches): every
    matmul 2-D on aligned 2-D views with its tiles in the chip's buffers, concats whose tile holds each part."""
    for lengths in ([64, 16, 100, 128, 0, 3], [300]):
        cu = windows(lengths)
        q = torch.randn(cu[-1], 16 if len(lengths) > 1 else 2, D).to(dtype)
        _run("varlen_attention", q, q, q, cu, D ** -0.5, cast_mode=mode)
    assert all(mm for mm in traced)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("Hq,Hkv,S,Skv,D", [(16, 2, 1, 300, 128), (16, 2, 40, 40, 128), (12, 2, 1, 900, 64),
                                            (32, 8, 1, 70, 256)])
def test_decoder_attention_launches_follow_the_documented_rules(traced, dtype, Hq, Hkv, S, Skv, D):
    q = torch.randn(1, Hq, S, D).to(dtype)
    k = torch.randn(1, Hkv, Skv, D).to(dtype)
    _run("decoder_attention", q, k, k, D ** -0.5, S > 1)
    assert all(mm for mm in traced)


def test_the_key_tile_is_the_widest_the_chip_holds():
    """set_cube_tile_shapes' L0B rule at A2/A3's 64 KiB: P V holds key tile x head dim of its operands, so fp32
    operands (fp32 inputs, or the fp32 cast mode's exps) halve the tile; 16-bit keep KEY_TILE."""
    assert attention.key_tile(1000, 64, 128, 2, True) == (256, None)
    assert attention.key_tile(1000, 64, 128, 2, False) == (128, None)  # 128 x 128 x 4 = 64 KiB
    assert attention.key_tile(1000, 64, 80, 4, True) == (192, None)  # 208 x 80 x 4 > 64 KiB
    assert attention.key_tile(100, 64, 128, 2, True) == (112, None)  # the keys, whole
    tile, why = attention.key_tile(1000, 64, 512, 4, True)  # q k^T alone: 64 x 512 x 4 = 128 KiB of L0A
    assert tile is None and "L0A needs 131072 bytes" in why and "65536" in why


def test_the_budget_rules_are_the_documented_formulas():
    mm = budget.Matmul("x", 64, 128, 256, 4)  # the fp32 P V tile the old kernel set: 128 KiB of L0B
    assert "L0B needs 131072 bytes" in budget.matmul_problem(mm)
    assert budget.matmul_problem(budget.Matmul("x", 64, 128, 256, 2)) is None
    assert "L0C needs" in budget.matmul_problem(budget.Matmul("x", 512, 16, 128, 2))  # 512 x 128 x 4 > 128 KiB
    assert "not 32-byte aligned" in budget.matmul_problem(budget.Matmul("x", 16, 8, 16, 2))
    assert "not a multiple of 16" in budget.matmul_problem(budget.Matmul("x", 8, 16, 16, 2))
    assert budget.vector_problem((64, 256)) is None  # 3 x 64 KiB: UB exactly
    assert "196704" in budget.vector_problem((1, 16385))  # 16392 x 4 x 3
    assert "129 tensors" in budget.problem(budget.Budget(concat=129))


def test_a_launch_the_chip_cannot_hold_is_refused_before_compiling(monkeypatch):
    """backend.launch checks the launch's tiles first: nothing is compiled (the kernel factory never called)."""
    backend = registry.get("pypto")
    x = torch.zeros(1, 16)

    def factory(pypto):
        raise AssertionError("compiled")

    too_wide = budget.Budget(matmuls=(budget.Matmul("P V", 64, 256, 128, 4),))
    with pytest.raises(budget.BudgetError, match="L0B needs 131072 bytes"):
        backend.launch("x", factory, x, [x], [x], [], tiles=pypto_backend.Tiles(1, 16), budget=too_wide)
    with pytest.raises(budget.BudgetError, match="vector tile 8x4096 needs 393216 bytes"):
        backend.launch("x", factory, x, [x], [x], [], tiles=pypto_backend.Tiles(8, 4096))


def test_calls_no_tile_fits_are_declined_with_the_reason():
    """An fp32 prefill at head dim 512 (64 query rows x 512 x 4 bytes: twice L0A), and rope over 128 heads of 128 (a
    tile holds a token's heads): declined by the ops' `supports`, counted with the budget's reason."""
    q = torch.randn(1, 4, 64, 512)
    stats = ops.Stats()
    with config.scoped(strict=False):
        ops.decoder_attention(q, q, q, 0.05, True, backend="pypto", stats=stats)
    assert stats.ran == {"torch": 1} and any("L0A needs" in why for why in stats.fallbacks), stats.fallbacks
    q = torch.randn(1, 128, 3, 128).bfloat16()  # [B, heads, S, D]
    cos = torch.randn(1, 3, 128).bfloat16()
    stats = ops.Stats()
    with config.scoped(strict=False):
        ops.rope(q, q, cos, cos, backend="pypto", stats=stats)
    assert stats.ran == {"torch": 1} and any("128 heads" in why and "UB" in why for why in stats.fallbacks), \
        stats.fallbacks


def test_a_chip_launch_holds_as_many_pairs_as_one_concat_takes(traced, monkeypatch):
    """The SIM's launch limits are its memory's (it holds the unrolled program); on the chip a launch takes as many
    (window, head) pairs as one pypto.concat documents (128): 8 windows of 16 heads in one launch, 9 in two."""
    from pypto_gym.kernels.pypto import varlen_attention as varlen

    assert attention.pairs_per_launch(15, "npu") == budget.MAX_CONCAT == 128 and attention.pairs_per_launch(15) == 8
    assert varlen.windows_per_launch(16, "npu") == 8 and varlen.windows_per_launch(16, "cpu") == 4
    monkeypatch.setattr(varlen, "windows_per_launch", lambda heads, device: 128 // heads)  # the chip's, on CPU
    for n, launches in ((8, 1), (9, 2)):
        traced.clear()
        cu = windows([64] * n)
        q = torch.randn(cu[-1], 16, 80).bfloat16()
        _run("varlen_attention", q, q, q, cu, 80 ** -0.5)
        assert len(traced) == launches and len(traced[0]) == 2 * 128  # two matmuls per pair
