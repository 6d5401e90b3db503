"""Which linears read which producer's rows, from the model family's W8A8 tables: the base calibration, fold and plan
all read (none of them imports another for it, so the quant modules import in one direction)."""
from __future__ import annotations

import torch

from .. import models


def _resolve(model, site, relative: str):
    """(path, linear) or (path, reason) for one named consumer of `site`."""
    parent = site.path.rpartition(".")[0]
    path = f"{parent}.{relative}" if parent else relative
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return path, "not found"
    D = site.module.weight.shape[0]
    if not isinstance(module, torch.nn.Linear) or module.in_features != D:
        return path, f"not an nn.Linear with in_features={D}"
    return path, module


def w8a8_family(model):
    """The model family (models/<family>.py: its w8a8_linears and w8a8_own_input); a model of none is refused."""
    family = models.family_of(model)
    if family is None:
        name = getattr(getattr(model, "config", None), "model_type", None)
        raise ValueError(f"quant: model_type {name!r} has no W8A8 linear table (families with one: "
                         f"{', '.join(models.FAMILIES)})")
    return family


def linears_after(model, site):
    """([(path, linear)], [(path, reason)]) of the linears the model family names for the site's kind."""
    found, missing = [], []
    for relative in w8a8_family(model).w8a8_linears.get(site.kind, ()):
        path, got = _resolve(model, site, relative)
        (found if isinstance(got, torch.nn.Module) else missing).append((path, got))
    return found, missing


def own_input_suffix(path: str, table) -> str | None:
    """The longest of the table's path suffixes `path` ends with (whole components), else None: "mlp.linear_fc1"
    before "linear_fc1", so one table can name a block's linear and, by a shorter suffix, every other one."""
    hits = [s for s in table if path == s or path.endswith("." + s)]
    return max(hits, key=len) if hits else None


def own_input_linears(model):
    """[(path, linear)]: the nn.Linears the family names (by path suffix) as quantising their own input."""
    suffixes = w8a8_family(model).w8a8_own_input
    return [(p, m) for p, m in model.named_modules() if isinstance(m, torch.nn.Linear)
            and own_input_suffix(p, suffixes) is not None]
