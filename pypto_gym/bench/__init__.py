"""Benchmarks (never timed tests): op-level, per captured case, PyPTO's NPU estimate, end to end."""
