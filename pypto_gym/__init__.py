"""pypto-gym: fused kernels for HuggingFace models on Ascend NPUs (and CPUs), without editing transformers.

    report = pypto_gym.patch_model(model)          # every site -> fused kernel
    pypto_gym.set_enabled(False)                   # original math, without unpatching
    pypto_gym.unpatch_model(model)                 # exact restore

The switches (`config`) load at once; the rest (ops, patching, quant, capture: torch and transformers) on the
first use of any of it, so `pypto-gym` starts, parses its flags and refuses bad ones, or is interrupted,
before seconds of imports.
"""
from . import config
from .config import is_enabled, is_strict, set_enabled, set_strict

__version__ = "0.2.0"
__all__ = ["ops", "config", "ShapeRecorder", "patch_model", "unpatch_model", "patched", "patch_report",
           "set_enabled", "is_enabled", "set_strict", "is_strict", "PatchError", "NoSitesError"]
_LAZY = {"ops": "ops", "quant": "quant", "ShapeRecorder": "capture", "NoSitesError": "patching",
         "PatchError": "patching", "patch_model": "patching", "patch_report": "patching", "patched": "patching",
         "unpatch_model": "patching"}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'pypto_gym' has no attribute {name!r}")
    import importlib

    importlib.import_module(".quant", __name__)  # registers the w8a8 mode before anything patches
    module = importlib.import_module(f".{_LAZY[name]}", __name__)
    value = module if _LAZY[name] == name else getattr(module, name)
    globals()[name] = value
    return value
