"""Where a SmoothQuant scale goes when a checkpoint is written: into whatever writes the rows it scales.

Inside pypto-gym each producer's fused quant op multiplies its rows by 1/s (torch_npu's smooth scale)
and the linears reading them hold W * s. A checkpoint (compressed-tensors, msModelSlim W8A8_DYNAMIC)
has no tensor for 1/s: its consumers quantise the rows the model gives them. So export multiplies 1/s
into the module that writes those rows, which leaves every product the model computes unchanged in
exact arithmetic (what llm-compressor's SmoothQuant does to a checkpoint):
- a norm: its weight (and bias): gamma * 1/s;
- a SwiGLU MLP (down_proj reads silu(gate) * up): up_proj's output rows; for an int8 up_proj only its
  per-channel weight_scale and bias change, the int8 codes stay as they are;
- a linear that quantises its own input: the module whose output channels its input channels are, by
  the family's table (its Family.w8a8_own_input, models/<family>.py). o_proj's input channel h*d + c is v_proj's
  output channel (h // groups)*d + c (attention mixes positions, not channels); the vision attn.proj's
  is its qkv's v third; the merger's mlp.0 reads ln_q's rows regrouped (channel j is ln_q's j % D); Qwen3-VL's
  vision qkv and linear_fc1 read their LayerNorm's rows as they are (weight and bias take the factor).
  Where one source channel feeds several input channels (GQA's query heads, the regrouping) they must
  share one scale: calibration gives them that (`group_max`). A linear with no such source (the
  merger's mlp.2 reads GELU's output) is not smoothed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .topology import own_input_linears, own_input_suffix, w8a8_family


@dataclass
class Fold:
    """A linear's input channel j is channel `index[j]` of `source`'s output (a linear's rows or a norm's D)."""

    path: str
    source_path: str
    source: torch.nn.Module
    index: torch.Tensor  # int64 [in_features]

    @property
    def width(self) -> int:
        """How many output channels the source has."""
        w = self.source.weight
        return w.shape[0]


def _index(kind: str, model, path: str, linear, source_path: str, source) -> torch.Tensor:
    """index[j] for the fold kinds of the family tables; a model whose shapes do not fit its kind is refused."""
    n_in, j = linear.in_features, torch.arange(linear.in_features)
    width = source.weight.shape[0]
    if kind == "kv_heads":
        attn = model.get_submodule(source_path.rpartition(".")[0])
        d = getattr(attn, "head_dim", None)
        if isinstance(d, int) and d > 0 and n_in % d == 0 and width % d == 0 and (n_in // d) % (width // d) == 0:
            groups = (n_in // d) // (width // d)
            return (j // d // groups) * d + j % d
    elif kind == "v_third":
        if width == 3 * n_in:
            return 2 * n_in + j
    elif kind == "tiled":
        if n_in % width == 0:
            return j % width
    elif kind == "same":
        if n_in == width:
            return j
    else:
        raise ValueError(f"w8a8_own_input: fold kind {kind!r} for {path}; expected 'kv_heads', 'v_third', 'tiled' "
                         f"or 'same'")
    raise ValueError(f"{path}: its input does not fit fold kind {kind!r} from {source_path} (in_features {n_in}, "
                     f"{source_path} has {width} output channels)")


def folds(model) -> dict:
    """{path: Fold} of every linear that quantises its own input and whose smooth scale has a source to fold
    into; the others (a None in the family table) are not smoothed."""
    table = w8a8_family(model).w8a8_own_input
    out = {}
    for path, linear in own_input_linears(model):
        suffix = own_input_suffix(path, table)
        if table[suffix] is None:
            continue
        relative, kind = table[suffix]
        source_path = path[:len(path) - len(suffix)] + relative
        source = model.get_submodule(source_path)
        out[path] = Fold(path, source_path, source, _index(kind, model, path, linear, source_path, source))
    return out


def group_max(values: torch.Tensor, fold: Fold) -> torch.Tensor:
    """values [in_features] -> the max over the input channels each source channel feeds, back at [in_features]:
    equal on every channel one source channel feeds, so a scale made from it folds."""
    per_source = torch.zeros(fold.width, dtype=values.dtype).scatter_reduce(0, fold.index, values, "amax")
    return per_source[fold.index]


def source_factor(inv_smooth: torch.Tensor, fold: Fold) -> torch.Tensor:
    """The fp32 factor of each of the source's output channels (1 where it feeds none of the linear's input);
    refused where the channels one source channel feeds do not share a scale (nothing single to fold)."""
    inv = inv_smooth.detach().float().cpu()
    f = torch.ones(fold.width).scatter_(0, fold.index, inv)
    if not torch.equal(f[fold.index], inv):
        j = int((f[fold.index] != inv).nonzero()[0, 0])
        raise ValueError(f"export: {fold.path}'s smooth scale differs across the input channels that channel "
                         f"{int(fold.index[j])} of {fold.source_path} feeds (e.g. channel {j}): it cannot be folded "
                         f"into the checkpoint; calibrate again (pypto-gym calibrate makes such scales foldable)")
    return f
