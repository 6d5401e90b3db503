"""Patch a loaded model: discovery, per-site wrappers, fused residual rewrites, exact unpatch."""
from .api import patch_model, patch_report, patched, unpatch_model
from .switch import is_enabled, set_enabled

__all__ = ["patch_model", "unpatch_model", "patched", "patch_report", "set_enabled", "is_enabled"]
