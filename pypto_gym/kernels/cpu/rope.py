"""rope, qk_norm_rope and rotary_embedding on the cpu backend: rope.cpp, q and k rotated in one pass, position by
position; the layout (rope_layout.Layout) handed over as integers where no copy is needed."""
import torch

from ...ops.defs.rope import MODES, QK_NORM_ROPE, ROPE, ROTARY_EMBEDDING, like
from ..rope_layout import Layout, angles_not_float, norm_args, out_dtypes, pairwise

_plans: dict = {}  # kind of call -> (output dtypes, the kernels' geometry or None where the layout needs copies)


def _cpu_call(entry, q, k, cos, sin, mrope_section, unsqueeze_dim, cast_mode, *extra):
    """Run a C++ rope kernel: outputs made like q and k (rope.like) by the kernel, the layout read from the
    per-signature plan, the tensors where they are; a layout that needs copies goes through a Layout. The kernels
    step along D by one element: an input whose last dim is strided (q[..., ::2], a cos expanded along D) is
    copied first, and the outputs laid out as the golden's (like q and k)."""
    if any(t.stride(-1) != 1 and t.shape[-1] > 1 for t in (q, k, cos, sin)):
        oq, ok = _cpu_call(entry, *(t.contiguous() if t.stride(-1) != 1 else t for t in (q, k, cos, sin)),
                           mrope_section, unsqueeze_dim, cast_mode, *extra)
        return like(q, oq), like(k, ok)
    key = (q.shape, q.stride(), k.shape, k.stride(), cos.shape, cos.stride(), sin.stride(), q.dtype, cos.dtype,
           tuple(mrope_section), unsqueeze_dim, cast_mode)
    plan = _plans.get(key)
    if plan is None:
        dq, dk = out_dtypes(q, k, cos, cast_mode)
        meta = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for t in (q, k, cos, sin)]
        lay = Layout(*meta, mrope_section, unsqueeze_dim)
        targets = lay.targets(torch.empty_like(meta[0], dtype=dq), torch.empty_like(meta[1], dtype=dk))
        if len(_plans) > 256:
            _plans.clear()
        plan = _plans[key] = (dq, dk, None if lay.copied or lay._pending else lay.geometry(*targets))
    dq, dk, geometry = plan
    sections, mode = list(mrope_section), MODES[cast_mode]
    if geometry is not None:
        return entry(q, k, cos, sin, geometry, sections, mode, dq, dk, *extra, None, None)
    oq, ok = torch.empty_like(q, dtype=dq), torch.empty_like(k, dtype=dk)
    lay = Layout(q, k, cos, sin, mrope_section, unsqueeze_dim)
    oq4, ok4 = lay.targets(oq, ok)
    entry(lay.q, lay.k, lay.cos, lay.sin, lay.geometry(oq4, ok4), sections, mode, dq, dk, *extra, oq4, ok4)
    lay.finish()
    return oq, ok


@ROPE.impl("cpu", supports=lambda backend, q, k, cos, *rest: angles_not_float(cos))
def _(backend, q, k, cos, sin, mrope_section, unsqueeze_dim, cast_mode):
    return pairwise(q, k, cos, cast_mode, lambda a, b, _: _cpu_call(backend.ext.rope, a, b, cos, sin, mrope_section,
                                                                    unsqueeze_dim, cast_mode))


@QK_NORM_ROPE.impl("cpu", supports=lambda backend, q, k, qw, kw, cos, *rest: angles_not_float(cos))
def _(backend, q, k, q_weight, k_weight, cos, sin, mrope_section, q_eps, k_eps, unsqueeze_dim, cast_mode):
    D = q.shape[-1]
    qw, kw = q_weight.reshape(D).contiguous(), k_weight.reshape(D).contiguous()

    def run(a, b, which):
        wa, wb, ea, eb = norm_args(which, qw, kw, float(q_eps), float(k_eps))
        return _cpu_call(backend.ext.qk_norm_rope, a, b, cos, sin, mrope_section, unsqueeze_dim, cast_mode, wa, wb,
                         ea, eb)
    return pairwise(q, k, cos, cast_mode, run)


def _cache_supported(backend, positions, query, key, cache, *rest):
    return angles_not_float(cache)


@ROTARY_EMBEDDING.impl("cpu", supports=_cache_supported, into=True)
def _(backend, positions, query, key, cos_sin_cache, head_size, mrope_section, cast_mode, mrope_interleaved,
      out=None):
    """rope.cpp's rotary_embedding: each token's cos/sin row read from the cache at its position(s), every head of
    q and k rotated with it; written over `out` (the inputs themselves for vLLM: in place) or new tensors. The
    kernel reads vLLM's [T, H * D] row views where they are and copies any other layout itself."""
    oq, ok = out if out is not None else (torch.empty(query.shape, dtype=query.dtype),
                                          torch.empty(key.shape, dtype=key.dtype))
    backend.ext.rotary_embedding(positions, query, key, cos_sin_cache, head_size, mrope_section, mrope_interleaved,
                                 MODES[cast_mode], oq, ok)
    return oq, ok

