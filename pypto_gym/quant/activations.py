"""The hand-over of a quant norm's int8 rows to the int8 linears that read its output.

Between a norm and its linears the model's own code (attention, MLP) passes a float tensor
around, so a quant norm returns the float tensor its int8 rows stand for (q * scale * s in the
model dtype) and records (q, scale) against that tensor object. A QuantLinear given that tensor,
or a view of whole rows of it (lm_head reads a slice of the last positions), takes the int8 rows
as they are. Anything else reaching a QuantLinear (a tensor a hook replaced, a reshaped one, the
output of another norm) is quantised per row in the linear: a missed hand-over costs time,
never correctness. Entries live as long as the float tensor does (weak references).
"""
from __future__ import annotations

import weakref

import torch

# storage address -> (weak reference to the issued float tensor, q, scale, owner, version). Keyed by
# storage, not by tensor: under torch.inference_mode (generate) views do not record their `_base`.
# The version counter catches a float tensor modified in place after it was issued (outside
# inference mode; inference tensors have no counter).
_ISSUED: dict[int, tuple] = {}


def _forget(ptr: int, ref) -> None:
    entry = _ISSUED.get(ptr)
    if entry is not None and entry[0] is ref:
        del _ISSUED[ptr]


def issue(y: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, owner) -> None:
    """Record that the float tensor `y` (fresh, contiguous) stands for int8 rows `q` with per-row `scale`."""
    ptr = y.untyped_storage().data_ptr()
    ref = weakref.ref(y, lambda r, ptr=ptr: _forget(ptr, r))
    version = None if y.is_inference() else y._version  # inference tensors keep no version counter
    _ISSUED[ptr] = (ref, q.contiguous(), scale.contiguous(), owner, version)


def find(x: torch.Tensor, owner):
    """(q, scale) for `x` if `owner` issued it, or issued the tensor whose whole rows `x` views; else None."""
    entry = _ISSUED.get(x.untyped_storage().data_ptr())
    if entry is None or entry[3] is not owner:
        return None
    y = entry[0]()
    if y is None or (entry[4] is not None and y._version != entry[4]):  # gone, or modified in place since
        return None
    if x is y:
        return entry[1], entry[2]
    return _rows_view(x, y, entry[1], entry[2])


def _rows_view(x, base, q, scale):
    """The same view of q and scale as `x` is of `base`, when `x` keeps whole rows; else None."""
    D = base.shape[-1]
    if x.dim() == 0 or x.shape[-1] != D or x.stride(-1) != 1 or not base.is_contiguous() or x.dtype != base.dtype:
        return None
    offset = x.storage_offset() - base.storage_offset()
    outer = [(stride, size) for stride, size in zip(x.stride()[:-1], x.shape[:-1])]
    if offset < 0 or offset % D or any(size > 1 and stride % D for stride, size in outer):
        return None
    row_strides = [stride // D if size > 1 else 0 for stride, size in outer]
    return (q.as_strided(x.shape, x.stride(), q.storage_offset() + offset),
            scale.as_strided(x.shape[:-1], row_strides, scale.storage_offset() + offset // D))
