"""The layout holds: imports go one way (no cycle, function-level imports included; ops/ imports neither kernels/
nor bench/; patching/ does not import quant/), an op definition is semantics only, and docs/reference.md's layout
names every module there is."""
import ast
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pypto_gym"
OP_FOLDERS = ("ops/defs", "kernels/cpu", "kernels/npu", "kernels/pypto", "bench/specs")  # one module per op
RULE_FOLDER = "patching/rules"  # one module per kind of site, each registering itself: the folder is what is named


def modules() -> dict:
    """Dotted module name -> path, for every module of the package."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(mods: dict) -> dict:
    """Module -> the package's modules it imports anywhere in its body (function-level imports too)."""
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in mods)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = base[:len(base) - node.level + 1]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                subs = [f"{prefix}.{a.name}" for a in node.names if f"{prefix}.{a.name}" in mods]
                deps.update(subs if len(subs) == len(node.names) else [prefix, *subs])
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


GRAPH = imports(modules())


def test_no_import_cycle():
    state, cycles = {}, []

    def visit(m, path):
        state[m] = "open"
        for d in sorted(GRAPH[m]):
            if d == "pypto_gym":  # the package's lazy attributes (pypto_gym.patch_model): resolved on use
                continue
            if state.get(d) == "open":
                cycles.append(path[path.index(d):] + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = "done"
    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def _imports_from(folder: str, forbidden: str) -> list:
    return [(m, d) for m, deps in GRAPH.items() if m.startswith(f"pypto_gym.{folder}")
            for d in deps if d.startswith(f"pypto_gym.{forbidden}")]


def test_imports_run_one_way():
    assert not _imports_from("ops", "kernels")
    assert not _imports_from("ops", "bench")
    assert not _imports_from("ops", "patching")
    assert not _imports_from("patching", "quant")
    assert not _imports_from("kernels", "patching")
    assert not _imports_from("kernels", "bench")
    assert not _imports_from("patching", "kernels")  # patching and kernels are peers above ops (SPEC 1)
    assert not [(m, d) for m, deps in GRAPH.items() if m.startswith("pypto_gym.models")  # the families are data
                for d in deps if not d.startswith("pypto_gym.models")]


def test_an_op_definition_is_semantics_only():
    """No kernel glue in ops/defs: implementations, torch_npu, PyPTO and the compiled module live in kernels/."""
    for path in (PACKAGE / "ops" / "defs").glob("*.py"):
        with path.open("rb") as f:  # the code's names, not its docstrings (which may say what an NPU op computes)
            names = {t.string for t in tokenize.tokenize(f.readline) if t.type == tokenize.NAME}
        assert not names & {"impl", "not_on", "torch_npu", "pypto", "ext", "kernels"}, path.name


def test_the_reference_layout_names_every_module():
    """docs/reference.md's layout block names each module (an op folder's modules as `<op>.py`, each one an op
    definition's), so a newcomer finds every file from it."""
    text = (ROOT / "docs" / "reference.md").read_text()
    block = re.search(r"## Layout\n\n```\n(.*?)```", text, re.S).group(1)
    defs = {p.stem for p in (PACKAGE / "ops" / "defs").glob("*.py")} - {"__init__"}
    missing = []
    for name, path in modules().items():
        rel = path.relative_to(PACKAGE)
        folder = str(rel.parent)
        if path.name == "__init__.py":
            if folder not in block and f"{rel.parent.name}/" not in block:
                missing.append(folder)
            continue
        if folder in OP_FOLDERS and path.stem in defs or folder == RULE_FOLDER:
            continue
        if not re.search(rf"\b{re.escape(path.stem)}\b", block):
            missing.append(str(rel))
    assert not missing, f"docs/reference.md's layout does not name: {missing}"


def test_loading_every_backend_imports_neither_pypto_nor_torch_npu():
    """The registry loads every backend's kernel modules at import: none may import PyPTO (an extra a vLLM venv or a
    plain install does not have) or torch_npu (which breaks `import torch` without CANN); they are imported when a
    kernel is first built or the first NPU call is made."""
    import subprocess
    import sys

    code = ("import sys, pypto_gym.ops, pypto_gym.patching, pypto_gym.quant\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pypto', 'torch_npu')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]", out.stdout
