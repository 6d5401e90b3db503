"""layer_norm: no PyPTO kernel yet, and why."""
from ...ops.defs.layer_norm import LAYER_NORM

LAYER_NORM.not_on("pypto", "layer_norm has no PyPTO kernel yet (the Qwen3-VL work continues: kernels/pypto/lib.py has the "
                           "row reductions it needs)")
