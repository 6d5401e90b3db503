"""Backends: `torch` (reference), `cpu` (fused C++), `npu` (torch_npu), `pypto` (PyPTO JIT)."""
