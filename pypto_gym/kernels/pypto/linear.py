"""linear: no PyPTO kernel, and why."""
from ...ops.defs.linear import LINEAR

LINEAR.not_on("pypto", "linear has no PyPTO kernel: its K (1280 and more) is beyond one cube tile, where pypto.matmul "
                       "0.2.0 verifies")
