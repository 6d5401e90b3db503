"""The hand-over of a quant norm's int8 rows to the int8 linears that read its output: `QuantRows`.

Between a norm and its linears the model's own code (attention, MLP) passes a float tensor around.
A quant norm returns a `QuantRows`: a tensor of the model dtype and the norm output's shape that
holds no float data, only the int8 rows and per-row scales (and the smooth scale they stand for
times), or, in the static scheme, the int8 rows under one static scale and offset. A QuantLinear
of the same norm given one (or a slice of whole rows of one: lm_head reads the last positions)
takes the int8 rows as they are; no dequantised float rows are written.

Anything else that touches a QuantRows goes through `__torch_dispatch__`, which makes the rows
"escape": the float tensor they stand for (q * scale * s, in the model dtype) is computed once,
the operation runs on it, and from then on every QuantLinear reading that tensor or any view of
it quantises the float values itself. So an in-place edit by model code, a `.data` edit, a view
written to, any op at all, is seen: a missed hand-over costs time, never correctness, in every
grad mode (no version counters needed: inference tensors have none). Row views (slices and
selects of non-last dims, detach) stay QuantRows sharing the same state, so an edit through a
view escapes the whole tensor too.
"""
from __future__ import annotations

import itertools

import torch
from torch.utils._pytree import tree_map

from ..patching.site import has_hooks

_aten = torch.ops.aten
_ROW_VIEWS = {_aten.slice.Tensor, _aten.select.int}  # views that keep whole rows (not on the last dim)
_ALIASES = {_aten.detach.default, _aten.alias.default}


class _Rows:
    """What every QuantRows view of one norm output shares: the int8 rows, and the float once escaped."""

    __slots__ = ("q", "scale", "smooth", "dtype", "owner", "float", "offset")

    def __init__(self, q, scale, smooth, dtype, owner, offset=None):
        self.q, self.scale, self.smooth, self.dtype, self.owner = q, scale, smooth, dtype, owner
        self.offset = offset  # static rows: the static offset ([1]), and `scale` the static scale ([1])
        self.float = None  # the dequantised float tensor, once something other than a QuantLinear touched it

    def escape(self) -> torch.Tensor:
        if self.float is None:
            self.float = dequantize(self.q, self.scale, self.offset, self.smooth, self.dtype)
        return self.float


class QuantRows(torch.Tensor):
    """A norm's output as int8 rows + per-row scales (see the module docstring)."""

    @staticmethod
    def __new__(cls, rows: _Rows, view=()):
        q = rows.q
        for func, args in view:
            q = func(q, *args)
        t = torch.Tensor._make_wrapper_subclass(cls, q.shape, strides=q.stride(), storage_offset=q.storage_offset(),
                                                dtype=rows.dtype, device=q.device, requires_grad=False)
        t._rows, t._view = rows, view
        return t

    def __repr__(self):
        state = "escaped" if self._rows.float is not None else "int8 rows"
        return f"QuantRows({tuple(self.shape)}, {self.dtype}, {state})"

    def _apply(self, base: torch.Tensor) -> torch.Tensor:
        for func, args in self._view:
            base = func(base, *args)
        return base

    def handed_over(self, owner):
        """(q, scale) of these rows if `owner` issued them and nothing else has touched them; else None."""
        rows = self._rows
        if rows.owner is not owner or rows.float is not None:
            return None
        q = self._apply(rows.q)
        scale = rows.scale
        for func, args in (() if rows.offset is not None else self._view):  # a static scale has no rows to view
            if func is not _aten.detach.default and func is not _aten.alias.default:
                scale = func(scale, *args)  # row views only: the same view of the per-row scales
        return q, scale

    def __deepcopy__(self, memo):
        """Independent rows from the same norm (a rewrite's first-call check runs copies of a layer's inputs):
        the int8 rows, scales and any escaped float cloned, the owner and the smooth scale shared."""
        rows = self._rows
        twin = _Rows(rows.q.clone(), rows.scale.clone(), rows.smooth, rows.dtype, rows.owner, rows.offset)
        twin.float = None if rows.float is None else rows.float.clone()
        return QuantRows(twin, self._view)

    def value(self) -> torch.Tensor:
        """The float tensor this stands for (escapes the rows)."""
        return self._apply(self._rows.escape())

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if isinstance(first, QuantRows) and first._rows.float is None and not kwargs:
            if func in _ALIASES:
                return QuantRows(first._rows, first._view + ((func, ()),))
            dim = args[1] if len(args) > 1 else 0
            if func in _ROW_VIEWS and first.dim() > 1 and dim % first.dim() != first.dim() - 1:
                rest = (dim % first.dim(), *args[2:])  # a non-negative dim: the same on the per-row scales
                return QuantRows(first._rows, first._view + ((func, rest),))

        def unwrap(t):
            return t.value() if isinstance(t, QuantRows) else t

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


class TracedRows(torch.Tensor):
    """The hand-over while torch.compile traces: the same int8 rows and scales as a traceable tensor subclass
    (`__tensor_flatten__`), so a compiled graph hands them to the linears exactly as eager does (same codes,
    same tokens) and needs no guard on per-call state. It is made and consumed inside one graph: any op but
    a consumer's read computes the float tensor it stands for; an in-place op on it is refused (the edit
    would be lost, and eager's QuantRows would have seen it), never silently dropped."""

    @staticmethod
    def __new__(cls, q, scale, smooth, dtype, owner: int, offset=None):
        t = torch.Tensor._make_wrapper_subclass(cls, q.shape, strides=q.stride(), storage_offset=q.storage_offset(),
                                                dtype=dtype, device=q.device, requires_grad=False)
        t.q, t.scale, t.smooth, t.owner, t.offset = q, scale, smooth, owner, offset
        return t

    def __init__(self, q, scale, smooth, dtype, owner: int, offset=None):
        super().__init__()

    def __repr__(self):
        return f"TracedRows({tuple(self.shape)}, {self.dtype})"

    def __tensor_flatten__(self):
        names = ["q", "scale"] + (["smooth"] if self.smooth is not None else []) + \
            (["offset"] if self.offset is not None else [])
        return names, (self.dtype, self.owner)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return TracedRows(inner["q"], inner["scale"], inner.get("smooth"), *ctx, offset=inner.get("offset"))

    def value(self) -> torch.Tensor:
        return dequantize(self.q, self.scale, self.offset, self.smooth, self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.is_mutable and any(isinstance(a, TracedRows) for a in args):
            raise RuntimeError(f"pypto-gym W8A8: {func} edits a norm's int8 output in place inside a torch.compile "
                               f"graph; this is not supported (run eagerly, or patch without quant='w8a8')")

        def unwrap(t):
            return t.value() if isinstance(t, TracedRows) else t

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


def dequantize(q, scale, offset, smooth, dtype) -> torch.Tensor:
    """The float tensor int8 rows stand for, in fp32 then rounded once to `dtype`: q * scale (per row) * smooth, or
    in the static scheme (q - offset) * scale (one value each) * smooth."""
    if offset is None:
        y = q.to(torch.float32) * scale.unsqueeze(-1)
    else:
        y = (q.to(torch.float32) - offset.to(torch.float32)) * scale.to(torch.float32)
    return (y if smooth is None else y * smooth).to(dtype)


def issue(q: torch.Tensor, scale: torch.Tensor, smooth, dtype, owner, offset=None):
    """The output of a quant op: int8 rows `q` [..., D], per-row `scale`, standing for q * scale * smooth (static:
    one `scale` and `offset`, standing for (q - offset) * scale * smooth); a QuantRows eagerly, a TracedRows while
    torch.compile traces."""
    if torch.compiler.is_compiling():
        return TracedRows(q, scale, smooth, dtype, owner.key, offset)
    return QuantRows(_Rows(q, scale, smooth, dtype, owner, offset))


def handed_over(x, owner):
    """(q, scale) of the int8 rows `x` stands for if `owner` issued them and nothing else touched them, else None
    (x is then a plain tensor, or rows that escaped: the caller quantises x's float values)."""
    if type(x) is TracedRows:
        return (x.q, x.scale) if x.owner == owner.key else None
    if type(x) is QuantRows:
        return x.handed_over(owner)
    return None


class Producer:
    """What every producer of int8 rows for int8 linears shares (a quant norm, a quant MLP): its consumers,
    the smooth scale its rows stand for, the calls it could not hand over and why, and the hand-over.

    `inv_smooth` is what the fused quant op multiplies its rows by (1/s of SmoothQuant) or None without
    calibration; `smooth` = exactly 1/inv_smooth in fp32: the rows are scaled back by it, and the
    consumers' weights scaled by it.
    """

    _keys = itertools.count(1)

    def __init__(self, inv_smooth: torch.Tensor | None, static=None):
        self.key = next(Producer._keys)  # what a TracedRows names its producer by (a graph holds no objects)
        self.inv_smooth = inv_smooth
        self.static = static  # the static scheme: (scale [1], offset [1]) of its rows, in the model dtype
        self.smooth = None if inv_smooth is None else 1.0 / inv_smooth.float()
        self.consumers: list[str] = []
        self.consumer_modules: list[torch.nn.Module] = []
        self.bypassed: dict[str, int] = {}

    def row(self) -> dict:
        row = {"int8_to": list(self.consumers), "smoothed": self.inv_smooth is not None,
               "bypassed": dict(self.bypassed)}
        if self.static is not None:
            row["static"] = {"scale": float(self.static[0]), "offset": float(self.static[1])}
        return row

    def count(self, reason: str) -> None:
        """Count a call that could not hand its rows over (eager calls: a counter changed inside a compiled graph
        would be a guard that recompiles it)."""
        if not torch.compiler.is_compiling():
            self.bypassed[reason] = self.bypassed.get(reason, 0) + 1

    def hand_over(self, q, scale, dtype, *hooked_modules) -> torch.Tensor:
        """The rows for the consumers (`issue`), or as the float tensor they stand for where a hand-over could not
        be exact: with hooks on the producer or a consumer (they see, and may change, a real float tensor).
        Static producers pass scale None: their rows stand under `self.static`."""
        if self.static is not None:
            y = issue(q, self.static[0], self.smooth, dtype, self, self.static[1])
        else:
            y = issue(q, scale, self.smooth, dtype, self)
        if any(has_hooks(m) for m in (*hooked_modules, *self.consumer_modules)):
            self.count("hooks on the producer or a consumer: float rows handed on")
            return y.value()
        return y
