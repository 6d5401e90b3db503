"""pypto-gym: fused RMSNorm kernels for HuggingFace models on Ascend NPUs (and CPUs)."""
__version__ = "0.1.0"
