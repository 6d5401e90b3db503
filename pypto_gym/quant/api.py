"""`quantize(model, W8A8(...))`: W8A8 as a pass over a patched model, configured by one value (as torchao's
`quantize_(model, config)`): the scheme and every W8A8 option in a `W8A8`, checked when it is made.

    report = pypto_gym.patch_model(model)                      # the float sites
    report = pypto_gym.quant.quantize(model, W8A8("static", calibration="smooth.safetensors"))

On a patched model the pass keeps that patch's options (backend, sites, residual fusion, cast mode, strictness)
and adds the int8 linears, the producers of their rows and their hand-over (plan.py decides, install.py's
`install` applies); on an unpatched model it patches with the defaults first. `unpatch_model(model)` restores the
float model exactly, as for any patch. `patch_model(..., quant="w8a8" | "w8a8_static", calibration=..., ...)` and
the CLI's `--quant` are the same pass spelled as patch options.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..patching import patch_model, unpatch_model
from ..patching.api import patch_options
from ..patching.options import PatchConfig

SCHEMES = {"dynamic": "w8a8", "static": "w8a8_static"}  # a W8A8 scheme -> the patch option's quant mode


@dataclass(frozen=True)
class W8A8:
    """int8 weights and activations for the linears a norm or an MLP feeds.

    scheme: "dynamic" (per-token activation scales, made at run time) or "static" (msModelSlim's: one scale and
      offset per linear input from the calibration file's ranges).
    calibration: a file from `pypto-gym calibrate` (smooth scales, and the ranges "static" needs).
    float_linears: globs over linear kinds or paths kept in the model dtype ("text.o_proj", or a list).
    int8_lm_head: lm_head int8 too (off: vLLM serves a compressed-tensors lm_head float).
    release_float_weights: a deployment: the int8 linears drop their float weights (no unpatch afterwards)."""

    scheme: str = "dynamic"
    calibration: str | None = None
    float_linears: tuple | str | None = None
    int8_lm_head: bool = False
    release_float_weights: bool = False

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme: got {self.scheme!r}; expected one of {', '.join(map(repr, SCHEMES))}")

    @property
    def mode(self) -> str:
        """The patch option this scheme is (`quant=`)."""
        return SCHEMES[self.scheme]


def quantize(model, config: W8A8):
    """Apply `config` to `model` (patched or not; see the module docstring); returns the live patch report."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: got {type(model).__name__}; expected a torch.nn.Module")
    if not isinstance(config, W8A8):
        raise TypeError(f"config: got {type(config).__name__}; expected a pypto_gym.quant.W8A8")
    kept = patch_options(model)
    if kept is not None and kept.quant is not None:
        raise ValueError(f"model: already quantised ({kept.quant}); unpatch_model(model) first to quantise it "
                         f"differently")
    options = {} if kept is None else {"backend": kept.backend, "sites": kept.sites,
                                       "fuse_residual": kept.fuse_residual, "cast_mode": kept.cast_mode,
                                       "strict": kept.strict}
    quant = dict(quant=config.mode, calibration=config.calibration, float_linears=config.float_linears,
                 int8_lm_head=config.int8_lm_head, release_float_weights=config.release_float_weights)
    if kept is not None:
        PatchConfig.make(**options, **quant)  # refuse a bad option before the float patch is taken off
        unpatch_model(model)
    return patch_model(model, **options, **quant)
