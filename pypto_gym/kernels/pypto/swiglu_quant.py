"""swiglu_dynamic_quant and dequant_swiglu_quant: no PyPTO kernels, and why."""
from ...ops.defs.swiglu_quant import DEQUANT_SWIGLU_QUANT, SWIGLU_DYNAMIC_QUANT

SWIGLU_DYNAMIC_QUANT.not_on("pypto", "no PyPTO kernel yet: swiglu's whole-row tiles at 11008 wide already take "
                                     "172 KB of the 192 KB unified buffer, and the quantised row needs more live "
                                     "buffers")

DEQUANT_SWIGLU_QUANT.not_on("pypto", "no PyPTO kernel: its input is a GEMM's int32 output, and this backend has no "
                                     "int8 GEMM (quant_matmul) yet")
