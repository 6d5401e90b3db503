"""patch_embed: no PyPTO kernel, and why."""
from ...ops.defs.patch_embed import PATCH_EMBED

PATCH_EMBED.not_on("pypto", "patch_embed has no PyPTO kernel: its K (C*T*P*P = 1176 at Qwen2.5-VL) is beyond one "
                            "cube tile, where pypto.matmul 0.2.0 verifies")
