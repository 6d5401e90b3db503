"""W8A8: int8 weights and activations for the linears that read a norm's output (SmoothQuant-style).

`quantize(model, W8A8(scheme="dynamic" | "static", calibration=FILE, ...))` (api.py), or the same as patch options,
`patch_model(model, quant="w8a8", calibration=FILE)`, makes each norm before such linears run
`rms_norm_dynamic_quant` / `add_rms_norm_dynamic_quant` (norm.py), hands their int8 rows and
per-row scales to the linears (activations.py), whose forwards run `ops.quant_matmul` on int8
copies of their weights (linear.py); each patched SwiGLU MLP hands its down_proj int8 rows the same
way (mlp.py), and the linears no fused op feeds quantise their input themselves. plan.py decides
which producers and linears (a Plan value, checked before anything changes) and install.py applies it;
calibration.py makes and checks the smooth scales; fold.py says where each scale goes in a checkpoint,
which export/ writes and loads (one module per format: compressed-tensors, msModelSlim).
Unpatching restores the float model exactly: the float weights are never modified (unless released).
`quant="w8a8_static"` is msModelSlim's W8A8: the same producers and linears, static per-tensor activation
scales and offsets from the calibration file's ranges (plan.py).
"""
import functools

from ..patching import register_quant_mode
from . import install
from .api import SCHEMES, W8A8, quantize
from .install import QuantPlan, apply
from .plan import Plan, decide

for _scheme, _mode in SCHEMES.items():  # patch_model(quant="w8a8" | "w8a8_static") is this pass (api.py)
    register_quant_mode(_mode, functools.partial(install.install, scheme=_scheme))

__all__ = ["W8A8", "quantize", "Plan", "decide", "QuantPlan", "apply"]
