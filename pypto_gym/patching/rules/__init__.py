"""The site rules: one module per kind of site, each registering its Rule (site.register), found by import like
ops/defs. A rule says as data which op its sites run, how the report names them (`labels`) and which rules it
comes after (`after`): RULES is kept in that order, whatever order the modules are imported in.
"""
import importlib
import pkgutil

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    importlib.import_module(f"{__name__}.{_info.name}")
