"""The `torch` backend: the reference formulas themselves. Always available, never falls back."""
from .. import reference
from ..registry import Backend, register


class TorchBackend(Backend):
    name = "torch"
    devices = ("cpu", "cuda", "npu", "meta", "xpu", "mps")

    def supports(self, op, args):
        return None

    rms_norm = staticmethod(reference.rms_norm)
    add_rms_norm = staticmethod(reference.add_rms_norm)
    rms_norm_dynamic_quant = staticmethod(reference.rms_norm_dynamic_quant)
    add_rms_norm_dynamic_quant = staticmethod(reference.add_rms_norm_dynamic_quant)
    quant_matmul = staticmethod(reference.quant_matmul)


register(TorchBackend())
