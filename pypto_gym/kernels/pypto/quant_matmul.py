"""quant_matmul, quant_matmul_static and int32_gemm: no PyPTO kernels, and why."""
from ...ops.defs.quant_matmul import INT32_GEMM, QUANT_MATMUL, QUANT_MATMUL_STATIC

INT32_GEMM.not_on("pypto", "int32_gemm is not provided: PyPTO 0.2.0's int8 pypto.matmul is not wired in yet")
QUANT_MATMUL_STATIC.not_on("pypto", "quant_matmul_static is not provided: PyPTO 0.2.0's int8 pypto.matmul verifies "
                                    "only with the whole K in one cube tile, which a hidden size of 2048 overflows")
QUANT_MATMUL.not_on("pypto", "quant_matmul is not provided: PyPTO 0.2.0's int8 pypto.matmul runs on the cube unit, "
                             "whose tiling and SIM verification this backend does not have yet")
