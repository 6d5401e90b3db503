"""The canonical layout every backend's rope and qk_norm_rope kernel reads, whatever layout HF hands over.

q and k as [O, H, I, D] (views for every layout HF hands over), cos/sin as [P, Oc, I, E] (`Layout`); the outputs'
dtypes (`out_dtypes`); a call with q or k empty split into what a kernel rotating q and k together takes
(`pairwise`, `norm_args`). Shared by kernels/cpu, kernels/npu and kernels/pypto (and the HF kernel list of
bench/specs/rope.py), so that no backend repeats it.
"""
import math

import torch

from ..ops.args import FLOAT_DTYPES, dtype_name
from ..ops.defs.rope import merged_shape


def _as4(x, n, u):
    """(x as [O, H, I, D], whether that is a view): O the dims before the heads dim, I those between it and D."""
    a = u + x.dim() - n
    shape = (math.prod(x.shape[:a]), x.shape[a], math.prod(x.shape[a + 1:-1]), x.shape[-1])
    try:
        return x.view(shape), True
    except RuntimeError:
        return x.reshape(shape), False


def heads_dim(q, cos, mrope_section, unsqueeze_dim) -> int:
    """Which dim of q holds its heads (cos/sin broadcast over it, at HF's `unsqueeze_dim`)."""
    n = len(merged_shape(cos, mrope_section)) + 1
    return unsqueeze_dim % n + q.dim() - n


class Layout:
    """One call in the layout every kernel reads: q and k as [O, H, I, D] (views for every layout HF hands
    over) and cos/sin as [P, Oc, I, E], P = 3 MRoPE planes or 1, Oc = O, or 1 when cos is shared across
    the leading dims (batch 1, or HF's vision [S, D]). What no kernel reads directly is copied into that
    layout (`copied` says so): a q or k no view reaches, a cos shared over some leading dims only."""

    def __init__(self, q, k, cos, sin, mrope_section, unsqueeze_dim):
        merged = merged_shape(cos, mrope_section)
        n = len(merged) + 1
        u = unsqueeze_dim % n
        self.n, self.u = n, u
        self.P = 3 if mrope_section else 1
        (self.q, q_view), (self.k, k_view) = _as4(q, n, u), _as4(k, n, u)
        self.copied = not (q_view and k_view)
        self.O, self.Hq, self.I, self.D = self.q.shape
        self.Hk = self.k.shape[1]
        a = heads_dim(q, cos, mrope_section, unsqueeze_dim)
        outer, inner = tuple(merged[:u]), tuple(merged[u:-1])
        q_outer, q_inner = tuple(q.shape[:a]), tuple(q.shape[a + 1:-1])
        self.E = E = cos.shape[-1]
        if inner == q_inner and math.prod(outer) == 1:
            self.Oc = 1
        elif inner == q_inner and outer == q_outer:
            self.Oc = self.O
        else:
            self.Oc, self.copied = self.O, True
            full = (self.P, *q_outer, *q_inner, E)
            cos, sin = (t.reshape(self.P, *[1] * (a - u), *merged).expand(full).contiguous() for t in (cos, sin))
        self.cos = cos.reshape(self.P, self.Oc, self.I, E)
        self.sin = sin.reshape(self.P, self.Oc, self.I, E)
        self._pending = []

    def targets(self, oq, ok):
        """[O, H, I, D] views of the outputs for a kernel to write (an output no view reaches gets a stand-in,
        copied back by `finish`)."""
        views = []
        for t in (oq, ok):
            view, ok_ = _as4(t, self.n, self.u)
            if not ok_:
                view = torch.empty(view.shape, dtype=t.dtype, device=t.device)
                self._pending.append((t, view))
            views.append(view)
        return views

    def finish(self) -> None:
        for t, v in self._pending:
            t.copy_(v.reshape(t.shape))

    def geometry(self, oq4, ok4) -> torch.Tensor:
        """The integers the C++ kernels read the layout from (rope.cpp's Geometry)."""
        g = [self.O, self.I, self.D, self.E, self.P, self.Oc]
        for t in (self.q, self.k, oq4, ok4):
            g += [t.shape[1], t.stride(0), t.stride(1), t.stride(2)]
        for t in (self.cos, self.sin):
            g += [t.stride(0), t.stride(1), t.stride(2)]
        return torch.tensor(g, dtype=torch.int64)


def out_dtypes(q, k, cos, cast_mode):
    """The outputs' dtypes: HF's promotion of q (k) and cos in hf mode, q's (k's) own in fp32 mode."""
    if cast_mode == "fp32":
        return q.dtype, k.dtype
    return torch.promote_types(q.dtype, cos.dtype), torch.promote_types(k.dtype, cos.dtype)


def pairwise(q, k, cos, cast_mode, run):
    """`run(q, k, which)` -> (q_embed, k_embed) for a kernel that takes q and k together and rotates nothing when
    either is empty: with one of them empty, the other is rotated alone (passed as both; `which` says whose weights
    and eps go with it) and the empty output made, as the golden gives both."""
    if q.numel() and k.numel():
        return run(q, k, "qk")
    oq, ok = new_outputs(q, k, cos, cast_mode)
    if q.numel():
        oq = run(q, q, "qq")[0]
    elif k.numel():
        ok = run(k, k, "kk")[1]
    return oq, ok


def angles_not_float(cos):
    """Why a kernel cannot read these cos/sin (None if it can): the kernels read cos/sin as fp16, bf16 or fp32 (HF accepts any float: fp64 runs on torch)."""
    return None if cos.dtype in FLOAT_DTYPES else f"cos dtype {dtype_name(cos.dtype)} not supported"


def new_outputs(q, k, cos, cast_mode):
    dq, dk = out_dtypes(q, k, cos, cast_mode)
    return torch.empty_like(q, dtype=dq), torch.empty_like(k, dtype=dk)


def norm_args(which, q_weight, k_weight, q_eps, k_eps):
    """The (q, k) weights and eps of `pairwise`'s call: q's twice when q is rotated alone, k's twice for k."""
    pick = {"q": (q_weight, q_eps), "k": (k_weight, k_eps)}
    (wa, ea), (wb, eb) = pick[which[0]], pick[which[1]]
    return wa, wb, ea, eb

