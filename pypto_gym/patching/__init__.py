"""Patch a loaded model: discovery, per-site wrappers, fused residual rewrites, exact unpatch."""
from ..config import is_enabled, set_enabled
from .api import NoSitesError, PatchError, patch_model, patch_report, patched, unpatch_model

__all__ = ["patch_model", "unpatch_model", "patched", "patch_report", "set_enabled", "is_enabled", "PatchError", "NoSitesError"]
