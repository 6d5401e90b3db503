"""The op definitions: one module per op (or per pair of ops sharing a formula), semantics only (golden, argument
roles, outputs, backward, examples); the kernels are in kernels/<backend>/<op>.py.

Importing this package imports every module in it, in name order, which registers each op (op.Op);
nothing else lists them.
"""
import importlib
import pkgutil

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    importlib.import_module(f"{__name__}.{_info.name}")
