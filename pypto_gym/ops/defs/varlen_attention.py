"""varlen_attention (SPEC 14): softmax(q k^T * scale) v inside each window of `cu_seqlens`, all windows and heads in
one call: the attention of a Qwen2.5-VL / Qwen2-VL vision block.

q, k, v are [T, H, D] (the T tokens of every window, one after another); window w is tokens
cu_seqlens[w]..cu_seqlens[w+1], attending to itself only, no mask inside it. HF's vision attention (sdpa and eager)
splits q, k and v by those lengths and calls the attention once per window: about 60 calls per block for a
document page, 1,700 per image, each a few small kernels. The full-attention blocks are the same op with one
window per image.

- `hf` (default): HF's per-window loop itself, `F.scaled_dot_product_attention` per window (HF's default
  `sdpa` implementation): bit-identical to HF on the `torch` backend.
- `fp32`: the same in fp32, rounded once.

cu_seqlens is a list of ints (HF's tensor `.tolist()`, as HF's own loop does to split): the windows are the
op's shape, recorded in case files, and what the NPU's fused attention takes as `actual_seq_lengths`.
"""
import torch
import torch.nn.functional as F

from ..args import FLOAT_DTYPES, ArgValueError, Choice, Float, Ints, Output, Tensor, dtype_name
from ..backends.npu import FIA, FIA_MAX_TND_SEQUENCES, FIA_TND_D, fia_limits
from ..backends.pypto_attention import MAX_ROWS, key_tile, tiled_attention
from ..backends.pypto_backend import MASKED, MATMUL_PAIRS, RunInfo, Tiles, first_runs_here
from ..op import BenchSpec, Op

CAST_MODES = ("hf", "fp32")
MODES = {"hf": 0, "fp32": 1}


def varlen_attention(q, k, v, cu_seqlens, scale, cast_mode="hf"):
    """softmax(q k^T * scale) v per window of cu_seqlens; `hf` as HF's per-window sdpa loop, `fp32` in fp32."""
    dtype = q.dtype
    if cast_mode == "fp32":
        q, k, v = q.float(), k.float(), v.float()
    outs = []
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):  # as HF: [1, H, L, D] views of one window each
        window = [t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        outs.append(F.scaled_dot_product_attention(*window, scale=scale)[0].transpose(0, 1))
    y = torch.cat(outs) if outs else q.new_empty(q.shape)
    return y.to(dtype).contiguous()


def _check(ctx, q, k, v, cu_seqlens, scale, cast_mode):
    T = q.shape[0]
    if not cu_seqlens or cu_seqlens[0] != 0 or cu_seqlens[-1] != T or \
            any(b < a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])):
        shown = list(cu_seqlens) if len(cu_seqlens) <= 8 else [*cu_seqlens[:4], "...", *cu_seqlens[-2:]]
        raise ArgValueError("cu_seqlens", f"{shown}; expected window bounds rising from 0 to T = {T}", "value")


def windows(sizes) -> list[int]:
    """cu_seqlens for windows of these sizes."""
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    return bounds


# GutenOCR-3B's document page (728x1008 pixels, patch 14: 52 x 72 patches): Qwen2.5-VL's windows are 112 pixels
# (4 x 4 merged tokens of 2 x 2 patches = 64 patches), the page's right column half as wide (32 patches):
# 9 rows of 6 x 64 + 32 = 63 windows, 3744 patches
PAGE_WINDOWS = windows(([64] * 6 + [32]) * 9)
PAGE_T, VISION_HEADS, VISION_D = 3744, 16, 80


def _bench_shapes(quick, dtype):
    """The document page's window block: 63 windows of up to 64 patches."""
    gen = torch.Generator().manual_seed(0)
    qkv = [torch.randn(PAGE_T, VISION_HEADS, VISION_D, generator=gen).to(dtype) for _ in range(3)]
    return [("vision", PAGE_T, (*qkv, PAGE_WINDOWS, VISION_D ** -0.5, "hf"))]


def padded_batch(args):
    """One batched sdpa over the windows padded to the longest (keys past a window's end masked): the loop's
    alternative without a fused kernel. Padding happens here, outside the timed call."""
    q, k, v, cu, scale = args[:5]
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    L = max(lengths)
    batch = [torch.zeros(len(lengths), q.shape[1], L, q.shape[2], dtype=q.dtype) for _ in range(3)]
    mask = torch.zeros(len(lengths), 1, 1, L, dtype=torch.bool)
    for w, (a, n) in enumerate(zip(cu[:-1], lengths)):
        for b, t in zip(batch, (q, k, v)):
            b[w, :, :n] = t[a:a + n].transpose(0, 1)
        mask[w, ..., :n] = True
    return lambda: F.scaled_dot_product_attention(*batch, attn_mask=mask, scale=scale)


VARLEN_ATTENTION = Op(varlen_attention, [
    Tensor("q", "T H D", FLOAT_DTYPES, case="query"),
    Tensor("k", "T H D", None, like="q", case="key"),
    Tensor("v", "T H D", None, like="q", case="value"),
    Ints("cu_seqlens"),
    Float("scale", low=0.0, low_open=True),
    Choice("cast_mode", CAST_MODES, default="hf", kw_only=True),
], [Output("out", "mixture")], check=_check, min_dims={"D": 1, "H": 1},
    examples=({"T": 10, "H": 2, "D": 16, "cu_seqlens": [0, 4, 10], "scale": 0.25},
              {"T": 200, "H": 3, "D": 80, "cu_seqlens": [0, 64, 128, 130, 130, 200], "scale": 80 ** -0.5},
              {"T": 150, "H": 2, "D": 24, "cu_seqlens": [0, 150], "scale": 0.2, "cast_mode": "fp32"},
              {"T": 7, "H": 1, "D": 5, "cu_seqlens": [0, 3, 7], "scale": 0.4, "dtype": torch.float16},
              {"T": 83, "H": 2, "D": 7, "cu_seqlens": [0, 3, 83], "scale": 0.3},
              {"T": 70, "H": 2, "D": 32, "cu_seqlens": [0, 70], "scale": 0.17, "dtype": torch.float32}),
    bench=BenchSpec(_bench_shapes, lambda a: (lambda: varlen_attention(*a)), lambda a: (lambda: a[0].clone()),
                    "clone() of q", {"vs_hf": 5.0, "vs_padded_sdpa": 1.5}, alternatives={"padded_sdpa": padded_batch}))


@VARLEN_ATTENTION.impl("cpu")
def _(backend, q, k, v, cu_seqlens, scale, cast_mode):
    return backend.ext.varlen_attention(q, k, v, list(cu_seqlens), float(scale), MODES[cast_mode])


# ---- pypto: each (window, head) pair padded to [L, D] (L and D rounded up to 16, padded keys masked by an additive
# bias, padded columns zero), then S = q k^T as one pypto.matmul whose cube tile holds the whole K (head_dim), the
# softmax on the vector unit in fp32, and P V as one pypto.matmul holding the whole K (the window), divided by the
# fp32 sum at the end; `hf` rounds the exps to the input dtype before P V (torch's flash attention, the golden),
# `fp32` keeps P V on fp32 operands (one rounding). Windows longer than PYPTO_MAX_WINDOW (a full-attention block)
# take pypto_attention's online softmax over key tiles. Limits found on PyPTO 0.2.0's SIM (each a compile in its
# own process):
PYPTO_MAX_WINDOW = 128  # a whole [L, L] fp32 score tile per pair; L 256 crashed PyPTO's compiler
PYPTO_LAUNCH_PAIRS = 64  # pairs per launch: 128 verify (95.8 us, two launches of 64 102.4), the page's 1008 in one
# program ran out of 24 GiB simulating


def window_attention_kernel(pypto):
    from ..backends import pypto_lib as pl

    def window_attention(q: pypto.Tensor(), k: pypto.Tensor(), v: pypto.Tensor(), bias: pypto.Tensor(),
                         out: pypto.Tensor(), scale, pairs, round_exps, rows, cols):
        B, L, D = q.shape[0], rows, cols
        parts = []
        for c in range(0, B, pairs):  # unrolled while tracing: one pypto.matmul per `pairs` (window, head) pairs
            n = min(pairs, B - c)
            qc = pypto.view(q, [n, L, D], [c, 0, 0])  # PyPTO's parser takes no generator expressions
            kc = pypto.view(k, [n, L, D], [c, 0, 0])
            vc = pypto.view(v, [n, L, D], [c, 0, 0])
            pypto.set_cube_tile_shapes([L, L], [D, D], [L, L])  # m, k (= head_dim, whole), n
            s = pypto.matmul(qc, kc, pl.FP32, b_trans=True)
            pypto.set_vec_tile_shapes(1, L, L)
            s = s * scale + pypto.view(bias, [n, 1, L], [c, 0, 0])
            e = pypto.exp(s - pypto.amax(s, -1, keepdim=True))
            total = pypto.sum(e, -1, keepdim=True)
            pypto.set_cube_tile_shapes([L, L], [L, L], [D, D])  # k = the window, whole
            if round_exps:  # hf: the exps in the input dtype, as torch's flash attention rounds them
                o = pypto.matmul(pypto.cast(e, q.dtype), vc, pl.FP32)
            else:
                o = pypto.matmul(e, pl.f32(vc), pl.FP32)
            pypto.set_vec_tile_shapes(1, L, D)
            parts.append(o / total)
        out[:] = pypto.cast(parts[0] if len(parts) == 1 else pypto.concat(parts, 0), out.dtype)
    return window_attention


def _padded_pairs(q, k, v, windows, D16):
    """q, k, v of these windows as [windows x heads, L, D16] (zeros past a window's end and past D) and the key
    bias [windows x heads, 1, L] (0 on a window's keys, -1e30 past its end)."""
    H, D = q.shape[1], q.shape[2]
    L = -(-max(b - a for a, b in windows) // 16) * 16
    padded = [t.new_zeros(len(windows) * H, L, D16) for t in (q, k, v)]
    bias = torch.full((len(windows) * H, 1, L), MASKED, dtype=torch.float32, device=q.device)
    for j, (a, b) in enumerate(windows):
        for p, t in zip(padded, (q, k, v)):
            p[j * H:(j + 1) * H, :b - a, :D] = t[a:b].transpose(0, 1)
        bias[j * H:(j + 1) * H, :, :b - a] = 0.0
    return padded, bias


def long_window_pairs(q, k, v, windows):
    """Windows longer than PYPTO_MAX_WINDOW (a full-attention block's image) as pypto_attention's pairs: each
    (window, chunk of 64 query rows, head) against the window's keys padded to whole tiles. Returns q [P, 64, D16],
    k and v [P, S, D16], the key bias [P, 1, S], the key tile and the chunks [(window end, first row)] in pair
    order (each chunk's H heads consecutive)."""
    H, D = q.shape[1], q.shape[2]
    D16, longest = -(-D // 16) * 16, max(b - a for a, b in windows)
    tile = key_tile(longest)
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


def _long_windows(backend, q, k, v, windows, scale, cast_mode):
    """Windows longer than PYPTO_MAX_WINDOW: long_window_pairs through pypto_attention's online softmax over key
    tiles; [T, H, D]."""
    T, H, D = q.shape
    qp, kp, vp, bias, tile, chunks = long_window_pairs(q, k, v, windows)
    o = tiled_attention(backend, "varlen_attention", qp, kp, vp, bias, scale, tile, round_exps=cast_mode == "hf")
    o = o.reshape(len(chunks), H, MAX_ROWS, -1)
    out = q.new_empty(T, H, D)
    for i, (b, c) in enumerate(chunks):
        out[c:min(c + MAX_ROWS, b)] = o[i, :, :min(MAX_ROWS, b - c), :D].transpose(0, 1)
    return out


@VARLEN_ATTENTION.impl("pypto", supports=first_runs_here)
def _(backend, q, k, v, cu_seqlens, scale, cast_mode):
    T, H, D = q.shape
    windows = [(a, b) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]) if b > a]
    if windows and max(b - a for a, b in windows) > PYPTO_MAX_WINDOW:
        return _long_windows(backend, q, k, v, windows, scale, cast_mode)
    out = q.new_empty(T, H, D)
    D16, per_launch, runs = -(-D // 16) * 16, max(1, PYPTO_LAUNCH_PAIRS // H), []
    for i in range(0, len(windows), per_launch):
        group = windows[i:i + per_launch]
        (qp, kp, vp), bias = _padded_pairs(q, k, v, group, D16)
        o = torch.empty_like(qp)
        backend.launch("varlen_attention", window_attention_kernel, qp, [qp, kp, vp, bias], [o],
                       [float(scale), MATMUL_PAIRS, cast_mode == "hf"], tiles=Tiles(qp.shape[1], D16),
                       kinds=("mixture",))
        runs.append(backend.last_run)
        for j, (a, b) in enumerate(group):
            out[a:b] = o[j * H:(j + 1) * H, :b - a, :D].transpose(0, 1)
    if runs:
        backend.last_run = RunInfo.of_launches(runs)
    return out


# ---- npu: one npu_fused_infer_attention_score call in the TND layout (q, k, v [T, N, D] as they are), the windows as
# actual_seq_lengths (cumulative ends, empty windows dropped: the form vllm-ascend's AscendMMEncoderAttention passes
# for Qwen2.5-VL's vision attention), no mask, sparse_mode 0, pre/next tokens unbounded. The TND layout takes a head
# dim of 128, or 192 for q and k (its page's TND constraints): a smaller D is zero-padded to 128 (Qwen2.5-VL's 80,
# Qwen3-VL's 64; vllm-ascend pads the same way), one between 128 and 192 to 192, and the output sliced back (zero
# columns change neither q k^T nor the value rows' first D columns); a larger D is declined, as are more than 4096
# sequences. torch_npu 7.x keyword names (`scale`; 6.0's was `scale_value`).
FIA_ALL_TOKENS = 2 ** 31 - 1


def fia_tnd_dim(D: int) -> int | None:
    """The head dim the TND call runs at: D padded to 128 or 192, None above 192."""
    return next((d for d in FIA_TND_D if D <= d), None)


def _npu_supports(backend, q, k, v, cu_seqlens, scale, cast_mode):
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"{FIA}: query {dtype_name(q.dtype)} (float16, bfloat16 or int8 only)"
    if not q.numel():
        return f"{FIA}: empty tensors are not supported"
    if backend.series_of(q) != "a2_a3":
        return f"{FIA}: supported on Atlas A2/A3 chips only"
    D = q.shape[-1]
    if fia_tnd_dim(D) is None:
        return f"{FIA}: head dim {D} in the TND layout (128, or 192 for q and k; a smaller one is padded)"
    sequences = sum(1 for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]) if b > a)
    if sequences > FIA_MAX_TND_SEQUENCES:
        return f"{FIA}: {sequences} sequences in the TND layout (at most {FIA_MAX_TND_SEQUENCES})"
    return fia_limits(sequences, q.shape[1], q.shape[1], 2, fia_tnd_dim(D), 0, q.dtype)


@VARLEN_ATTENTION.impl("npu", supports=_npu_supports)
def _(backend, q, k, v, cu_seqlens, scale, cast_mode):
    T, H, D = q.shape
    pad = fia_tnd_dim(D) - D
    q, k, v = [F.pad(t, (0, pad)) if pad else t.contiguous() for t in (q, k, v)]
    ends = [b for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]) if b > a]
    out, _ = backend.torch_npu().npu_fused_infer_attention_score(
        q, k, v, actual_seq_lengths=ends, actual_seq_lengths_kv=ends, num_heads=H, num_key_value_heads=H,
        input_layout="TND", scale=float(scale), sparse_mode=0, pre_tokens=FIA_ALL_TOKENS, next_tokens=FIA_ALL_TOKENS)
    return out[..., :D].contiguous() if pad else out
