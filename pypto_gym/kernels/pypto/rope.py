"""rope, qk_norm_rope and rotary_embedding on the pypto backend: tokens x heads x D tiles.

q and k as [T, H, D] (T = O*I tokens, BSND memory: a view for HF's layouts), cos/sin as [T, 1, E] per MRoPE
plane; the kernel merges the sections with views and a concat, and rotates with views, neg and concat.
A tile spans all heads of a token (PyPTO 0.2.0's compiled program disagrees with its own tensor graph
when a tile cuts the heads dim of these view/concat chains), and as many tokens as fit the UB.
rotary_embedding runs the rope kernel on [T, H, D] views.
"""
import torch

from ...ops.defs.rope import QK_NORM_ROPE, ROPE, ROTARY_EMBEDDING, cached_angles
from ..rope_layout import Layout, angles_not_float, heads_dim, new_outputs, norm_args, pairwise
from .backend import UB_BYTES, Tiles
from .budget import Budget, vector_problem

LIVE_FP32 = 6  # x, its rotation, two products, the sum, the pass-through concat


def rope_tiles(T: int, H: int, D: int) -> Tiles:
    cols = -(-D // 16) * 16
    per_token = LIVE_FP32 * H * cols * 4
    rows = 1
    while rows * 2 * per_token <= UB_BYTES and rows < 8 and rows < T:
        rows *= 2
    return Tiles(rows, cols, heads=H)


def _launch_tiles(T: int, H: int, D: int) -> dict:
    """The launch's tiles and the budget they state (LIVE_FP32 tiles live in UB)."""
    tiles = rope_tiles(T, H, D)
    return {"tiles": tiles, "budget": Budget(vector=tiles.shape, live=LIVE_FP32)}


def rope_kernel(pypto):
    from . import lib as pl

    def rope(q: pypto.Tensor(), k: pypto.Tensor(), c0: pypto.Tensor(), c1: pypto.Tensor(), c2: pypto.Tensor(),
             s0: pypto.Tensor(), s1: pypto.Tensor(), s2: pypto.Tensor(), oq: pypto.Tensor(), ok: pypto.Tensor(),
             hf, sec_t, sec_h, sec_w, rows, heads, cols):
        pypto.set_vec_tile_shapes(rows, heads, cols)
        cos = pl.merged_angles([c0, c1, c2], sec_t, sec_h, sec_w)
        sin = pl.merged_angles([s0, s1, s2], sec_t, sec_h, sec_w)
        yq = pl.rotate(pl.f32(q), cos, sin, oq.dtype, hf)
        yk = pl.rotate(pl.f32(k), cos, sin, ok.dtype, hf)
        oq[:] = yq
        ok[:] = yk
    return rope


def qk_norm_rope_kernel(pypto):
    from . import lib as pl

    def qk_norm_rope(q: pypto.Tensor(), k: pypto.Tensor(), gq: pypto.Tensor(), gk: pypto.Tensor(),
                     c0: pypto.Tensor(), c1: pypto.Tensor(), c2: pypto.Tensor(), s0: pypto.Tensor(),
                     s1: pypto.Tensor(), s2: pypto.Tensor(), oq: pypto.Tensor(), ok: pypto.Tensor(),
                     hf, sec_t, sec_h, sec_w, q_eps, k_eps, inv_d, rows, heads, cols):
        pypto.set_vec_tile_shapes(rows, heads, cols)
        cos = pl.merged_angles([c0, c1, c2], sec_t, sec_h, sec_w)
        sin = pl.merged_angles([s0, s1, s2], sec_t, sec_h, sec_w)
        nq = pl.head_norm(q, gq, q_eps, inv_d, hf)
        nk = pl.head_norm(k, gk, k_eps, inv_d, hf)
        yq = pl.rotate(nq, cos, sin, oq.dtype, hf)
        yk = pl.rotate(nk, cos, sin, ok.dtype, hf)
        oq[:] = yq
        ok[:] = yk
    return qk_norm_rope


def _pypto_inputs(lay, mrope_section):
    """q, k as [T, H, D] and the six cos/sin planes as [T, 1, E] (the merged form's one plane three times),
    plus the sections as the kernel reads them."""
    T = lay.O * lay.I
    x3 = [x4.permute(0, 2, 1, 3).reshape(T, x4.shape[1], lay.D).contiguous() for x4 in (lay.q, lay.k)]
    planes = []
    for t in (lay.cos, lay.sin):
        t = t.expand(lay.P, lay.O, lay.I, lay.E) if lay.Oc == 1 else t
        ps = [t[p].reshape(T, 1, lay.E).contiguous() for p in range(lay.P)]
        planes += ps * (3 // len(ps))
    sections = list(mrope_section) if mrope_section else [lay.E // 2, 0, 0]
    return x3, planes, sections


def _pypto_outputs(lay, outs):
    """Kernel outputs [T, H, D] over the op's outputs when their memory is token-major (the golden's for HF's
    layouts), else contiguous stand-ins copied back by `finish`."""
    views = []
    T = lay.O * lay.I
    lay._pending = []
    for t in outs:
        H = t.numel() // (T * lay.D) if T * lay.D else 0
        try:
            view = t.view(lay.O, H, lay.I, lay.D).permute(0, 2, 1, 3).view(T, H, lay.D)
        except RuntimeError:
            view = None
        if view is not None and view.is_contiguous():
            views.append(view)
        else:
            stand_in = torch.empty(T, H, lay.D, dtype=t.dtype, device=t.device)
            lay._pending.append((t, stand_in.view(lay.O, lay.I, H, lay.D).permute(0, 2, 1, 3)))
            views.append(stand_in)
    return views


def _pypto_supports(backend, q, k, cos, sin, mrope_section, unsqueeze_dim, *rest):
    """A tile holds a token's heads whole: one token's q must fit the unified buffer."""
    why = backend.runs_on(q) or angles_not_float(cos)
    if why:
        return why
    H = q.shape[heads_dim(q, cos, mrope_section, unsqueeze_dim)]
    too_wide = vector_problem((1, H, -(-q.shape[-1] // 16) * 16), LIVE_FP32)
    return f"one token's {H} heads of {q.shape[-1]} (a tile holds them whole): {too_wide}" if too_wide else None


@ROPE.impl("pypto", supports=_pypto_supports)
def _rope(backend, q, k, cos, sin, mrope_section, unsqueeze_dim, cast_mode):
    def run(q, k, _):
        oq, ok = new_outputs(q, k, cos, cast_mode)
        lay = Layout(q, k, cos, sin, mrope_section, unsqueeze_dim)
        x3, planes, sections = _pypto_inputs(lay, mrope_section)
        backend.launch("rope", rope_kernel, x3[0], [*x3, *planes], _pypto_outputs(lay, (oq, ok)),
                       [int(cast_mode == "hf"), *sections], **_launch_tiles(x3[0].shape[0], lay.Hq, lay.D))
        lay.finish()
        return oq, ok
    return pairwise(q, k, cos, cast_mode, run)


@QK_NORM_ROPE.impl("pypto", supports=lambda backend, q, k, qw, kw, cos, sin, sections, qe, ke, unsqueeze_dim, *rest:
                   _pypto_supports(backend, q, k, cos, sin, sections, unsqueeze_dim))
def _(backend, q, k, q_weight, k_weight, cos, sin, mrope_section, q_eps, k_eps, unsqueeze_dim, cast_mode):
    def run(q, k, which):
        qw, kw, qe, ke = norm_args(which, q_weight, k_weight, q_eps, k_eps)
        oq, ok = new_outputs(q, k, cos, cast_mode)
        lay = Layout(q, k, cos, sin, mrope_section, unsqueeze_dim)
        x3, planes, sections = _pypto_inputs(lay, mrope_section)
        D = lay.D
        # [1, H, D]: PyPTO broadcasts one axis at a time (a [1, 1, D] weight over [T, H, D] is refused)
        weights = [w.reshape(1, 1, D).expand(1, H, D).contiguous() for w, H in ((qw, lay.Hq), (kw, lay.Hk))]
        backend.launch("qk_norm_rope", qk_norm_rope_kernel, x3[0], [*x3, *weights, *planes],
                       _pypto_outputs(lay, (oq, ok)),
                       [int(cast_mode == "hf"), *sections, float(qe), float(ke), 1.0 / D],
                       **_launch_tiles(x3[0].shape[0], lay.Hq, D))
        lay.finish()
        return oq, ok
    return pairwise(q, k, cos, cast_mode, run)


@ROTARY_EMBEDDING.impl("pypto", supports=lambda backend, positions, query, key, cache, *rest:
                       backend.runs_on(query) or angles_not_float(cache))
def _(backend, positions, query, key, cos_sin_cache, head_size, mrope_section, cast_mode, mrope_interleaved):
    """The rope kernel on [T, H, D] views, cos and sin gathered at full rotary width on the host (the section
    merge, or interleave, too): the rotation the device runs is rope's, verified at the compiled level."""
    T = positions.shape[-1]
    cos, sin = cached_angles(positions, cos_sin_cache, mrope_section, mrope_interleaved)
    if cast_mode == "hf":
        cos, sin = cos.to(query.dtype), sin.to(query.dtype)
    cos, sin = torch.cat((cos, cos), dim=-1).contiguous(), torch.cat((sin, sin), dim=-1).contiguous()
    q3, k3 = (x.reshape(T, -1, head_size) for x in (query, key))
    yq, yk = _rope(backend, q3, k3, cos, sin, [], -2, cast_mode)
    return yq.to(query.dtype).reshape(query.shape), yk.to(key.dtype).reshape(key.shape)
