"""The `pypto` backend: its machinery (backend.py) and one module per op it provides (see kernels/__init__.py)."""
from .. import import_package

import_package(__name__, __path__)
