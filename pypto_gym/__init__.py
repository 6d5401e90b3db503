"""pypto-gym: fused RMSNorm kernels for HuggingFace models on Ascend NPUs (and CPUs).

    report = pypto_gym.patch_model(model)          # every RMSNorm -> fused kernel
    pypto_gym.set_enabled(False)                   # original math, without unpatching
    pypto_gym.unpatch_model(model)                 # exact restore
"""
from . import ops
from .capture import ShapeRecorder
from .patching import is_enabled, patch_model, patch_report, patched, set_enabled, unpatch_model

__version__ = "0.1.0"
__all__ = ["ops", "ShapeRecorder", "patch_model", "unpatch_model", "patched", "patch_report", "set_enabled", "is_enabled"]
