"""PyPTO attention over key tiles with an online softmax, shared by the attention ops whose keys do not fit one
tile: the decoder's attention (a decode step over its KV cache, a causal prefill) and the vision tower's
full-attention blocks (varlen_attention windows longer than its whole-window kernel holds).

The caller cuts its attention into pairs of equal shape: each pair is `rows` query rows (a KV head's query heads
at one token, a chunk of a prefill's tokens, a chunk of a window) against its keys padded to whole tiles, with an
additive fp32 bias (0 where a row may attend, MASKED elsewhere: padded keys, the causal future, a padding mask), one
row per pair ([P, 1, S]) or one per query row ([P, rows, S]). Per key tile: S = q k^T with the whole head_dim in one
cube tile, the running max and sum in fp32, the exps rounded to the input dtype before P V (torch's flash attention
rounds them so; `round_exps=False` keeps P V on fp32 operands), P V with the whole key tile in one cube tile;
out = O / sum. So no cube tile splits K, the condition under which PyPTO 0.2.0's matmul verifies (varlen_attention's
finding). Launches of at most MATMUL_PAIRS pairs and LAUNCH_PAIR_TILES pair x key-tile steps, each checked at the
compiled level as an attention output ("mixture": SPEC 5).
"""

# no `from __future__ import annotations` here: PyPTO reads the kernel's annotations as objects
import torch

from .backend import MATMUL_PAIRS, RunInfo, Tiles

KEY_TILE = 256  # keys per online-softmax step
MAX_ROWS = 64  # query rows per pair: a [64, 256] fp32 score tile at most
# PyPTO 0.2.0's SIM holds the whole unrolled program: at 15 key tiles (a document page's full-attention block) a
# launch of 2 pairs took 0.55 GB, 8 pairs 2.0 GB, 16 pairs 5.9 GB and 32 pairs ran out of 24 GiB
LAUNCH_PAIR_TILES = 128


def key_tile(keys: int) -> int:
    """The key tile for this many keys: whole (rounded up to 16) up to KEY_TILE."""
    return min(KEY_TILE, -(-keys // 16) * 16)


def pairs_per_launch(tiles: int) -> int:
    """Pairs in one launch at this many key tiles per pair (the simulator's memory grows with pairs x tiles)."""
    return max(1, min(MATMUL_PAIRS, LAUNCH_PAIR_TILES // tiles))


def tiled_attention_kernel(pypto):
    from . import lib as pl

    def tiled_attention(q: pypto.Tensor(), k: pypto.Tensor(), v: pypto.Tensor(), bias: pypto.Tensor(),
                        out: pypto.Tensor(), scale, tile, round_exps, rows, cols):
        P, G, D, Skv, B = q.shape[0], rows, cols, k.shape[1], bias.shape[1]
        running_max = total = acc = None
        for t in range(0, Skv, tile):  # unrolled while tracing: one step of the online softmax per key tile
            kt = pypto.view(k, [P, tile, D], [0, t, 0])
            vt = pypto.view(v, [P, tile, D], [0, t, 0])
            pypto.set_cube_tile_shapes([G, G], [D, D], [tile, tile])  # m, k (= head_dim, whole), n
            s = pypto.matmul(q, kt, pl.FP32, b_trans=True)
            pypto.set_vec_tile_shapes(1, G, tile)
            s = s * scale + pypto.view(bias, [P, B, tile], [0, 0, t])
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
            pypto.set_vec_tile_shapes(1, G, D)
            if running_max is None:
                acc, total = pv, tile_sum
            else:
                alpha = pypto.exp(running_max - new_max)
                acc, total = acc * alpha + pv, total * alpha + tile_sum
            running_max = new_max
        out[:] = pypto.cast(acc / total, out.dtype)
    return tiled_attention


def tiled_attention(backend, name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                    scale: float, tile: int, round_exps: bool = True) -> torch.Tensor:
    """q [P, rows, D16], k and v [P, S, D16] (S a multiple of `tile`), bias fp32 [P, 1 or rows, S] -> [P, rows,
    D16]; backend.last_run sums the launches."""
    o, runs = torch.empty_like(q), []
    step = pairs_per_launch(k.shape[1] // tile)
    for a in range(0, q.shape[0], step):
        b = a + step
        backend.launch(name, tiled_attention_kernel, q[a:b], [q[a:b], k[a:b], v[a:b], bias[a:b].contiguous()],
                       [o[a:b]], [float(scale), tile, bool(round_exps)], tiles=Tiles(q.shape[1], q.shape[2]),
                       kinds=("mixture",))
        runs.append(backend.last_run)
    backend.last_run = RunInfo.of_launches(runs)
    return o
