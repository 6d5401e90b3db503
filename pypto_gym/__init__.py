"""pypto-gym: fused RMSNorm kernels for HuggingFace models on Ascend NPUs (and CPUs).

    report = pypto_gym.patch_model(model)          # every RMSNorm -> fused kernel
    pypto_gym.set_enabled(False)                   # original math, without unpatching
    pypto_gym.unpatch_model(model)                 # exact restore
"""
from . import config, ops, quant  # noqa: F401  (quant registers the w8a8 mode)
from .capture import ShapeRecorder
from .config import is_enabled, is_strict, set_enabled, set_strict
from .patching import NoSitesError, PatchError, patch_model, patch_report, patched, unpatch_model

__version__ = "0.2.0"
__all__ = ["ops", "config", "ShapeRecorder", "patch_model", "unpatch_model", "patched", "patch_report",
           "set_enabled", "is_enabled", "set_strict", "is_strict", "PatchError", "NoSitesError"]
