"""Patch a loaded model: the site machinery (site.py), one rule per kind of site (rules/: norm, mlp, rope, attention,
text_attention, patch_embed; each registers itself), layer rewrites (rewrite.py: residual.py and the rotary rule use
it), the epilogue linears (gemm.py), exact unpatch (api.py), the report (report.py). Importing it registers the rules."""
from ..config import is_enabled, set_enabled
from . import rules  # noqa: F401  (registers every rule)
from .api import NoSitesError, PatchError, patch_model, patch_report, patched, unpatch_model
from .options import PatchConfig, register_quant_mode

__all__ = ["patch_model", "unpatch_model", "patched", "patch_report", "set_enabled", "is_enabled", "PatchError",
           "NoSitesError", "PatchConfig", "register_quant_mode"]
