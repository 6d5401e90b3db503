"""varlen_attention on the pypto backend.

Each (window, head) pair padded to [L, D] (L and D rounded up to 16, padded keys masked by an additive
bias, padded columns zero) and laid out as rows (q, k, v [pairs x L, D], the bias [pairs, L]); per pair, 2-D views
into S = q k^T as one pypto.matmul whose cube tile holds the whole K (head_dim), the softmax on the vector unit in
fp32, and P V as one pypto.matmul holding the whole K (the window), divided by the fp32 sum; the pairs concatenated
along rows with a tile that holds one pair whole (pypto.concat's rule). `hf` rounds the exps to the input dtype
before P V (torch's flash attention, the golden), `fp32` keeps P V on fp32 operands (one rounding). Windows longer
than PYPTO_MAX_WINDOW (a full-attention block), or whose whole-window tiles the chip cannot hold (fp32 operands at a
wide head dim: budget.py), take attention.py's online softmax over key tiles.
"""
import torch

from ...ops.defs.varlen_attention import VARLEN_ATTENTION
from .attention import MAX_ROWS, key_tile, tiled_attention
from .backend import MASKED, RunInfo, Tiles
from .budget import MAX_CONCAT, Budget, Matmul, problem

# Limits found on PyPTO 0.2.0's SIM (each a compile in its own process):
PYPTO_MAX_WINDOW = 128  # a whole [L, L] fp32 score tile per pair; L 256 crashed PyPTO's compiler
PYPTO_LAUNCH_PAIRS = 64  # pairs per SIM launch: 128 verify (95.8 us, two launches of 64 102.4), the page's 1008 in
# one program ran out of 24 GiB simulating


def windows_per_launch(heads: int, device: str) -> int:
    """Windows in one launch of the whole-window kernel: their pairs as many as one pypto.concat takes on the chip,
    PYPTO_LAUNCH_PAIRS in SIM (its memory)."""
    return max(1, (MAX_CONCAT if device == "npu" else PYPTO_LAUNCH_PAIRS) // heads)


def window_attention_kernel(pypto):
    from . import lib as pl

    def window_attention(q: pypto.Tensor(), k: pypto.Tensor(), v: pypto.Tensor(), bias: pypto.Tensor(),
                         out: pypto.Tensor(), scale, round_exps, rows, cols):
        L, D, n = rows, cols, bias.shape[0]
        parts = []
        for p in range(n):  # unrolled while tracing: two 2-D matmuls per (window, head) pair
            qp = pypto.view(q, [L, D], [p * L, 0])  # PyPTO's parser takes no generator expressions
            kp = pypto.view(k, [L, D], [p * L, 0])
            vp = pypto.view(v, [L, D], [p * L, 0])
            pypto.set_cube_tile_shapes([L, L], [D, D], [L, L])  # m, k (= head_dim, whole), n
            s = pypto.matmul(qp, kp, pl.FP32, b_trans=True)
            pypto.set_vec_tile_shapes(L, L)
            s = s * scale + pypto.view(bias, [1, L], [p, 0])
            e = pypto.exp(s - pypto.amax(s, -1, keepdim=True))
            total = pypto.sum(e, -1, keepdim=True)
            pypto.set_cube_tile_shapes([L, L], [L, L], [D, D])  # k = the window, whole
            if round_exps:  # hf: the exps in the input dtype, as torch's flash attention rounds them
                o = pypto.matmul(pypto.cast(e, q.dtype), vp, pl.FP32)
            else:
                o = pypto.matmul(e, pl.f32(vp), pl.FP32)
            pypto.set_vec_tile_shapes(L, D)
            parts.append(o / total)
        out[:] = pypto.cast(parts[0] if n == 1 else pypto.concat(parts, 0), out.dtype)
    return window_attention


def window_budget(L: int, D16: int, in_bytes: int, round_exps: bool, pairs: int) -> Budget:
    """The tiles one launch of the whole-window kernel sets."""
    return Budget(matmuls=(Matmul("window attention's q k^T", L, D16, L, in_bytes),
                           Matmul("window attention's P V", L, L, D16, in_bytes if round_exps else 4)),
                  vector=(L, max(L, D16)), concat=pairs if pairs > 1 else 0)


def _padded_pairs(q, k, v, windows, D16):
    """q, k, v of these windows as rows [windows x heads x L, D16] (zeros past a window's end and past D) and the
    key bias [windows x heads, L] (0 on a window's keys, -1e30 past its end)."""
    H, D = q.shape[1], q.shape[2]
    L = -(-max(b - a for a, b in windows) // 16) * 16
    padded = [t.new_zeros(len(windows) * H, L, D16) for t in (q, k, v)]
    bias = torch.full((len(windows) * H, L), MASKED, dtype=torch.float32, device=q.device)
    for j, (a, b) in enumerate(windows):
        for p, t in zip(padded, (q, k, v)):
            p[j * H:(j + 1) * H, :b - a, :D] = t[a:b].transpose(0, 1)
        bias[j * H:(j + 1) * H, :b - a] = 0.0
    return [p.reshape(-1, D16) for p in padded], bias, L


def _whole_windows(q, windows, round_exps) -> bool:
    """Whether these windows take the whole-window kernel: none longer than PYPTO_MAX_WINDOW, and its tiles fit."""
    longest = -(-max(b - a for a, b in windows) // 16) * 16
    D16, pairs = -(-q.shape[2] // 16) * 16, windows_per_launch(q.shape[1], q.device.type) * q.shape[1]
    return longest <= PYPTO_MAX_WINDOW and problem(window_budget(longest, D16, q.element_size(), round_exps,
                                                                 pairs)) is None


def long_window_pairs(q, k, v, windows, round_exps=True):
    """Windows for attention.py's online softmax (longer than PYPTO_MAX_WINDOW, a full-attention block's image, or
    too wide for the whole-window kernel's tiles) as its pairs: each (window, chunk of 64 query rows, head) against
    the window's keys padded to whole tiles. Returns q [P, 64, D16], k and v [P, S, D16], the key bias [P, 1, S],
    the key tile and the chunks [(window end, first row)] in pair order (each chunk's H heads consecutive)."""
    H, D = q.shape[1], q.shape[2]
    D16, longest = -(-D // 16) * 16, max(b - a for a, b in windows)
    tile, why = key_tile(longest, MAX_ROWS, D16, q.element_size(), round_exps)
    if why:
        raise ValueError(f"varlen_attention's pypto kernel: {why}")  # _pypto_supports declines it first
    S_pad, rows = -(-longest // tile) * tile, MAX_ROWS
    chunks = [(j, b, c) for j, (a, b) in enumerate(windows) for c in range(a, b, rows)]
    qp = q.new_zeros(len(chunks), H, rows, D16)
    kp, vp = (t.new_zeros(len(windows), H, S_pad, D16) for t in (k, v))
    bias = torch.full((len(windows), 1, S_pad), MASKED, dtype=torch.float32, device=q.device)
    for j, (a, b) in enumerate(windows):
        kp[j, :, :b - a, :D], vp[j, :, :b - a, :D] = k[a:b].transpose(0, 1), v[a:b].transpose(0, 1)
        bias[j, :, :b - a] = 0.0
    for i, (_, b, c) in enumerate(chunks):
        qp[i, :, :min(rows, b - c), :D] = q[c:min(c + rows, b)].transpose(0, 1)
    idx = torch.tensor([j for j, _, _ in chunks], device=q.device)
    kp, vp = (t[idx].reshape(-1, S_pad, D16) for t in (kp, vp))
    bias = bias[idx][:, None].expand(len(chunks), H, 1, S_pad).reshape(-1, 1, S_pad)
    return qp.reshape(-1, rows, D16), kp, vp, bias, tile, [(b, c) for _, b, c in chunks]


def _long_windows(backend, q, k, v, windows, scale, round_exps):
    """long_window_pairs through attention.py's online softmax over key tiles; [T, H, D]."""
    T, H, D = q.shape
    qp, kp, vp, bias, tile, chunks = long_window_pairs(q, k, v, windows, round_exps)
    o = tiled_attention(backend, "varlen_attention", qp, kp, vp, bias, scale, tile, round_exps)
    o = o.reshape(len(chunks), H, MAX_ROWS, -1)
    out = q.new_empty(T, H, D)
    for i, (b, c) in enumerate(chunks):
        out[c:min(c + MAX_ROWS, b)] = o[i, :, :min(MAX_ROWS, b - c), :D].transpose(0, 1)
    return out


def _pypto_supports(backend, q, k, v, cu_seqlens, scale, cast_mode):
    windows = [(a, b) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]) if b > a]
    if windows and not _whole_windows(q, windows, cast_mode == "hf"):
        _, why = key_tile(max(b - a for a, b in windows), MAX_ROWS, -(-q.shape[2] // 16) * 16, q.element_size(),
                          cast_mode == "hf")
        if why:
            return why
    return backend.runs_on(q)


@VARLEN_ATTENTION.impl("pypto", supports=_pypto_supports)
def _(backend, q, k, v, cu_seqlens, scale, cast_mode):
    T, H, D = q.shape
    round_exps = cast_mode == "hf"
    windows = [(a, b) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]) if b > a]
    if windows and not _whole_windows(q, windows, round_exps):
        return _long_windows(backend, q, k, v, windows, scale, round_exps)
    out = q.new_empty(T, H, D)
    D16, per_launch, runs = -(-D // 16) * 16, windows_per_launch(H, q.device.type), []
    for i in range(0, len(windows), per_launch):
        group = windows[i:i + per_launch]
        (qp, kp, vp), bias, L = _padded_pairs(q, k, v, group, D16)
        o = torch.empty_like(qp)
        backend.launch("varlen_attention", window_attention_kernel, qp, [qp, kp, vp, bias], [o],
                       [float(scale), round_exps], tiles=Tiles(L, D16), kinds=("mixture",),
                       budget=window_budget(L, D16, q.element_size(), round_exps, bias.shape[0]))
        runs.append(backend.last_run)
        o = o.reshape(-1, L, D16)
        for j, (a, b) in enumerate(group):
            out[a:b] = o[j * H:(j + 1) * H, :b - a, :D].transpose(0, 1)
    if runs:
        backend.last_run = RunInfo.of_launches(runs)
    return out
