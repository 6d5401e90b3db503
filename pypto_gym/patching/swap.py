"""SwappedForward: the one mechanism by which pypto-gym changes a module, and undoes it exactly.

Only the module's instance `forward` is replaced (accelerate's inner `_old_forward` when the model
was dispatched with device_map/offload, so its hooks keep moving weights and activations), by a
`functools.partial` of a module-level function, so a patched model pickles and deep-copies. The
object itself is kept in the module's `__dict__` under `SLOT`, where the installed function finds
it. Norm sites (wrapper.py), fused layers (fusion.py) and int8 linears (quant/linear.py) are
SwappedForwards.
"""
from __future__ import annotations

import functools


class SwappedForward:
    SLOT = "_pypto_gym_swapped"  # each subclass names its own
    FORWARD = None  # the module-level function installed as forward(module, *args, **kwargs)

    def __init__(self, module):
        self.module = module
        self._attr = "_old_forward" if "_old_forward" in module.__dict__ else "forward"
        self._saved = module.__dict__.get(self._attr)  # accelerate's inner forward, or None

    def original(self, *args, **kwargs):
        """The module's own forward (accelerate's inner forward, or its class's)."""
        if self._saved is not None:
            return self._saved(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def install(self) -> None:
        setattr(self.module, self._attr, functools.partial(type(self).FORWARD, self.module))
        self.module.__dict__[self.SLOT] = self

    def uninstall(self) -> None:
        if self._saved is None:
            self.module.__dict__.pop(self._attr, None)
        else:
            setattr(self.module, self._attr, self._saved)
        self.module.__dict__.pop(self.SLOT, None)
