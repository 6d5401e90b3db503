"""PyPTO attention over key tiles with an online softmax, shared by the attention ops whose keys do not fit one
tile: the decoder's attention (a decode step over its KV cache, a causal prefill) and the vision tower's
full-attention blocks (varlen_attention windows longer than its whole-window kernel holds, or whose whole window
the chip's buffers do not).

The caller cuts its attention into pairs of equal shape: each pair is `rows` query rows (a KV head's query heads
at one token, a chunk of a prefill's tokens, a chunk of a window) against its keys padded to whole tiles, with an
additive fp32 bias (0 where a row may attend, MASKED elsewhere: padded keys, the causal future, a padding mask), one
row per pair or one per query row. The kernel sees them as 2-D row tensors (q [pairs x rows, D], k and v [pairs x
keys, D], bias [pairs x 1 or rows, keys]) and, per pair and key tile, takes 2-D views into 2-D matmuls (PyPTO
r0.2.0's matmul takes no view in 3-D): S = q k^T with the whole head_dim in one cube tile, the running max and sum
in fp32, the exps rounded to the input dtype before P V (torch's flash attention rounds them so; `round_exps=False`
keeps P V on fp32 operands), P V with the whole key tile in one cube tile; out = O / sum, the pairs concatenated
along rows with a tile that holds a pair whole (pypto.concat's rule). So no cube tile splits K, the condition under
which PyPTO 0.2.0's matmul verifies (varlen_attention's finding). The key tile is the widest whose tiles the chip
holds (budget.py: fp32 operands halve it). A launch holds as many pairs as one concat takes on the chip; in SIM at
most LAUNCH_PAIRS pairs and LAUNCH_PAIR_TILES pair x key-tile steps, each checked at the compiled level as an
attention output ("mixture": SPEC 5).
"""

# no `from __future__ import annotations` here: PyPTO reads the kernel's annotations as objects
import torch

from .backend import RunInfo, Tiles
from .budget import MAX_CONCAT, Budget, Matmul, problem

KEY_TILE = 256  # keys per online-softmax step, at most
MAX_ROWS = 64  # query rows per pair: a [64, 256] fp32 score tile at most
LAUNCH_PAIRS = 32  # pairs per launch
# PyPTO 0.2.0's SIM holds the whole unrolled program: at 15 key tiles (a document page's full-attention block) a
# launch of 2 pairs took 0.55 GB, 8 pairs 2.0 GB, 16 pairs 5.9 GB and 32 pairs ran out of 24 GiB
LAUNCH_PAIR_TILES = 128


def tiled_budget(rows: int, cols: int, tile: int, in_bytes: int, round_exps: bool, pairs: int = 1) -> Budget:
    """The tiles one launch of `pairs` pairs sets: its two matmuls, the [rows, key tile] score tile, the concat."""
    return Budget(matmuls=(Matmul("attention's q k^T", rows, cols, tile, in_bytes),
                           Matmul("attention's P V", rows, tile, cols, in_bytes if round_exps else 4)),
                  vector=(rows, max(tile, cols)), concat=pairs if pairs > 1 else 0)


def key_tile(keys: int, rows: int, cols: int, in_bytes: int, round_exps: bool) -> tuple[int | None, str | None]:
    """(the widest key tile, a multiple of 16 up to KEY_TILE and the keys rounded up to 16, whose tiles the chip
    holds; None) or (None, why not even 16 keys fit)."""
    tile = min(KEY_TILE, -(-keys // 16) * 16)
    while True:
        why = problem(tiled_budget(rows, cols, tile, in_bytes, round_exps))
        if why is None or tile == 16:
            return (None, why) if why else (tile, None)
        tile -= 16


def pairs_per_launch(tiles: int, device: str = "cpu") -> int:
    """Pairs in one launch at this many key tiles per pair: on the chip as many as one pypto.concat takes; in SIM what
    its memory holds (it holds the whole unrolled program, which grows with pairs x tiles)."""
    if device == "npu":
        return MAX_CONCAT
    return max(1, min(LAUNCH_PAIRS, LAUNCH_PAIR_TILES // tiles))


def tiled_attention_kernel(pypto):
    from . import lib as pl

    def tiled_attention(q: pypto.Tensor(), k: pypto.Tensor(), v: pypto.Tensor(), bias: pypto.Tensor(),
                        out: pypto.Tensor(), scale, tile, round_exps, rows, cols):
        G, D, P = rows, cols, q.shape[0] // rows
        S, B = k.shape[0] // P, bias.shape[0] // P
        parts = []
        for p in range(P):  # unrolled while tracing: each pair's online softmax over its key tiles
            qp = pypto.view(q, [G, D], [p * G, 0])
            running_max = total = acc = None
            for t in range(0, S, tile):
                kt = pypto.view(k, [tile, D], [p * S + t, 0])
                vt = pypto.view(v, [tile, D], [p * S + t, 0])
                pypto.set_cube_tile_shapes([G, G], [D, D], [tile, tile])  # m, k (= head_dim, whole), n
                s = pypto.matmul(qp, kt, pl.FP32, b_trans=True)
                pypto.set_vec_tile_shapes(G, tile)
                s = s * scale + pypto.view(bias, [B, tile], [p * B, t])
                new_max = pypto.amax(s, -1, keepdim=True)
                if running_max is not None:
                    new_max = pypto.maximum(running_max, new_max)
                e = pypto.exp(s - new_max)
                tile_sum = pypto.sum(e, -1, keepdim=True)
                pypto.set_cube_tile_shapes([G, G], [tile, tile], [D, D])  # k = the key tile, whole
                if round_exps:
                    pv = pypto.matmul(pypto.cast(e, q.dtype), vt, pl.FP32)
                else:
                    pv = pypto.matmul(e, pl.f32(vt), pl.FP32)
                pypto.set_vec_tile_shapes(G, D)
                if running_max is None:
                    acc, total = pv, tile_sum
                else:
                    alpha = pypto.exp(running_max - new_max)
                    acc, total = acc * alpha + pv, total * alpha + tile_sum
                running_max = new_max
            parts.append(acc / total)
        out[:] = pypto.cast(parts[0] if P == 1 else pypto.concat(parts, 0), out.dtype)
    return tiled_attention


def tiled_attention(backend, name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                    scale: float, tile: int, round_exps: bool = True) -> torch.Tensor:
    """q [P, rows, D16], k and v [P, S, D16] (S a multiple of `tile`), bias fp32 [P, 1 or rows, S] -> [P, rows,
    D16]; backend.last_run sums the launches."""
    P, R, D = q.shape
    o, runs = torch.empty_like(q), []
    step = pairs_per_launch(k.shape[1] // tile, q.device.type)
    for a in range(0, P, step):
        b = min(a + step, P)
        rows2d = [t[a:b].reshape(-1, t.shape[-1]).contiguous() for t in (q, k, v, bias)]
        out = torch.empty_like(rows2d[0])
        backend.launch(name, tiled_attention_kernel, rows2d[0], rows2d, [out], [float(scale), tile, bool(round_exps)],
                       tiles=Tiles(R, D), kinds=("mixture",),
                       budget=tiled_budget(R, D, tile, q.element_size(), round_exps, b - a))
        o[a:b] = out.reshape(b - a, R, D)
        runs.append(backend.last_run)
    backend.last_run = RunInfo.of_launches(runs)
    return o
