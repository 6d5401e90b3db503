"""linear: no npu mapping of its own, and why."""
from ...ops.defs.linear import LINEAR

LINEAR.not_on("npu", "a linear on the NPU is torch_npu's own matmul (F.linear adds the bias there); the epilogue "
                     "linears are the cpu backend's")
