"""Backend machinery (build, load, devices, availability); importing it registers every backend.

`torch` is the goldens (registry.py); `cpu` fused C++ kernels (cpu.py); `npu` torch_npu (npu.py);
`pypto` PyPTO JIT kernels (pypto_backend.py, pypto_compat.py). No op list lives here: each op
definition registers its implementations.
"""
from . import cpu, npu, pypto_backend  # noqa: F401
