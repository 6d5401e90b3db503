"""Patch a loaded model: site rules (norm.py, mlp.py, rope.py, attention.py, text_attention.py, patch_embed.py),
layer rewrites (rewrite.py: residual.py and the rotary rule use it), exact unpatch (api.py), the report
(report.py). Importing it registers the rules."""
from ..config import is_enabled, set_enabled
from . import norm  # noqa: F401, I001  (registers the rule; rules apply in import order)
from . import mlp  # noqa: F401
from . import rope  # noqa: F401
from . import attention  # noqa: F401  (after rope: a vision attention site joins its rope site's rewrite)
from . import text_attention  # noqa: F401
from . import patch_embed  # noqa: F401
from .api import NoSitesError, PatchError, patch_model, patch_report, patched, unpatch_model
from .options import PatchConfig, register_quant_mode

__all__ = ["patch_model", "unpatch_model", "patched", "patch_report", "set_enabled", "is_enabled", "PatchError",
           "NoSitesError", "PatchConfig", "register_quant_mode"]
