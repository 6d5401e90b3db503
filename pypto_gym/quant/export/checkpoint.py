"""What both formats' writer and reader share: the output folder checked and staged, a checkpoint's files read
(regular files only, damage named), older tensor names mapped to the current module paths, tied parameters."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

from ... import files

SIDECAR = "pypto_gym_export.json"  # what export wrote beyond the format: the tied linears quantised from a float table


def check_out_dir(out_dir) -> Path:
    """The export's folder, refused in one line before any work: not empty, a file, a missing parent (not created,
    as `cp` does not), an unwritable parent (the export is staged beside it). A symlink is followed: the export
    goes into the directory it names, staged beside that one (the link stays a link; staging beside the link and
    renaming over it failed with "Not a directory" after the whole export)."""
    out = Path(out_dir)
    if out.is_symlink():
        target = Path(os.path.realpath(out))
        if not target.exists():
            raise FileNotFoundError(f"export: {out} is a symlink to {target}, which does not exist; expected a new or "
                                    f"empty directory")
        out = target
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"export: {out} is a file; expected a new or empty directory")
    if out.is_dir() and any(out.iterdir()):
        raise FileExistsError(f"export: {out} exists and is not empty; expected a new or empty directory")
    parent = out.absolute().parent
    if not parent.is_dir():
        raise FileNotFoundError(f"export: directory {parent} does not exist (create it first)")
    if not os.access(parent, os.W_OK | os.X_OK) or (out.is_dir() and not os.access(out, os.W_OK | os.X_OK)):
        raise PermissionError(f"export: cannot write in {parent if not out.is_dir() else out}")
    return out


@contextlib.contextmanager
def staging(out: Path):
    """A temporary folder beside `out`, renamed to `out` once everything was written into it (the files get the
    mode a plain open() would give them: save_pretrained writes some 0600); removed if anything fails."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.absolute().parent))
    try:
        yield tmp
        mode = files.new_file_mode()
        for f in tmp.rglob("*"):
            if f.is_file():
                os.chmod(f, mode)
        os.chmod(tmp, 0o777 & ~files.umask())
        if out.is_dir():
            out.rmdir()  # the empty folder the user made: the staged one takes its place
        os.rename(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and not isinstance(e, (OSError, ValueError)):  # safetensors' own errors
            raise OSError(f"export: writing {out} failed ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
                          f"nothing written") from e
        raise


def _regular(path: Path) -> bool:
    """A regular file (os.stat): a FIFO or a device named like a checkpoint file is never opened (it would hang)."""
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except OSError:
        return False


def read_json(path: Path, where: str) -> dict:
    """A checkpoint's JSON file as a dict, or one line naming the file and what is wrong with it."""
    if not _regular(path):
        raise FileNotFoundError(f"{where}: {path.name} is missing or not a regular file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{where}: {path.name} is not valid JSON ({str(e).splitlines()[0][:100]})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: {path.name} holds a JSON {type(data).__name__}; expected an object")
    return data


def read_tensors(path: Path, where: str) -> dict:
    """Every tensor of the checkpoint's *.safetensors files (regular files only), a damaged one named."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    found = sorted(f for f in path.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"{where}: no *.safetensors file")
    out = {}
    for f in found:
        if not _regular(f):
            raise ValueError(f"{where}: {f.name} is not a regular file")
        try:
            out.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ValueError(f"{where}: {f.name} is not a readable safetensors file (truncated or damaged: "
                             f"{str(e).splitlines()[0][:100]})") from None
    return out


def module_names(tensors: dict, family) -> dict:
    """The tensors named by the module paths of the model transformers 5.x builds: a checkpoint in an older layout
    (family.legacy_names: Qwen2.5-VL's `model.layers.*` and `visual.*`, which 5.x's save_pretrained writes and
    llm-compressor writes back as it read them), none of whose names is in the current one, is renamed whole."""
    current = tuple(replacement for _, replacement in family.legacy_names)
    if not current or any(k.startswith(current) for k in tensors):
        return tensors
    renamed = {}
    for name, t in tensors.items():
        for pattern, replacement in family.legacy_names:
            name = re.sub(pattern, replacement, name, count=1)
        renamed[name] = t
    return renamed


def tied_keys(model) -> set:
    """State-dict keys of parameters tied to another (a tied lm_head): save_pretrained writes them once."""
    seen, tied = {}, set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(name)
        seen.setdefault(id(p), name)
    return tied
