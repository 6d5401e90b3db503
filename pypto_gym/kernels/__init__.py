"""The providers: each backend's kernels, one folder per backend, one module per op definition.

    kernels/cpu/    backend.py (build and load the C++), <op>.py (the glue) beside <op>.cpp, csrc/ (shared C++)
    kernels/npu/    backend.py (torch_npu, imported lazily; chip series), <op>.py (the mapping onto torch_npu's API)
    kernels/pypto/  backend.py (compile, SIM run, cache), lib.py, attention.py, <op>.py (the JIT kernels and tiling)

A backend's `backend.py` registers the Backend; each `<op>.py` registers `@OP.impl(<backend>, supports=...)` on the
op its definition (ops/defs/<op>.py) made. Nothing imports these modules by name: the op registry loads this package
once, when `pypto_gym.ops` is first imported (ops/registry.py `load_providers`), as vLLM's platforms import their
kernels; a new backend is a new folder, a new op's kernel a new module in each backend's folder.
"""
import importlib
import pkgutil


def import_package(package: str, path, lazy: tuple = ()) -> None:
    """Import every module of a package, `backend` first (the Backend the others' kernels run on), then by name;
    not the `lazy` ones (helpers that import their backend's package, imported when a kernel is first built)."""
    names = sorted((m.name for m in pkgutil.iter_modules(path)), key=lambda n: (n != "backend", n))
    for name in names:
        if name not in lazy:
            importlib.import_module(f"{package}.{name}")


import_package(__name__, __path__)
