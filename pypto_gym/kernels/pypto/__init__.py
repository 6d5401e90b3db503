"""The `pypto` backend: its machinery (backend.py) and one module per op it provides (see kernels/__init__.py)."""
from .. import import_package

import_package(__name__, __path__, lazy=("lib",))  # lib.py imports pypto: only a kernel being built needs it
