"""Building and caching the cpu kernels safely: the package's ninja, stale locks, CPU-keyed caches."""
import os
import shutil
import subprocess
import sys

import pytest

from pypto_gym import hardware
from pypto_gym.kernels.cpu import backend as cpu


def test_the_build_uses_the_ninja_this_package_depends_on(monkeypatch):
    import ninja

    monkeypatch.setenv("PATH", "/nonexistent")  # no system ninja at all, as on a fresh machine
    assert shutil.which("ninja") is None
    with cpu._package_ninja():
        assert shutil.which("ninja") == os.path.join(ninja.BIN_DIR, "ninja")
    assert os.environ["PATH"] == "/nonexistent"  # restored


def test_a_stale_lock_is_removed_before_torch_builds(tmp_path, monkeypatch, capsys):
    """build(): a folder without its completion mark and with torch's FileBaton `lock` (a killed build) has the lock
    removed, said on stderr, before torch's load() runs (which would wait on it forever); the mark is written after
    the module loads. torch's load is replaced here (the real build in a subprocess: the integration test below)."""
    import types

    import torch.utils.cpp_extension

    isa = hardware.best_isa()
    monkeypatch.setattr(cpu.config, "cache_dir", lambda: tmp_path)
    folder = cpu.build_dir(isa)
    folder.mkdir(parents=True)
    (folder / "lock").write_text("")
    calls = []

    def load(name, sources, build_directory, **kwargs):
        calls.append(not (folder / "lock").exists())
        return types.SimpleNamespace(isa=lambda: isa)

    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    monkeypatch.delitem(sys.modules, f"pypto_gym_cpu_{isa}", raising=False)
    assert cpu.build(isa).isa() == isa and calls == [True]
    assert "left by a build that was killed" in capsys.readouterr().err
    assert (folder / cpu.COMPLETE).is_file()


@pytest.mark.integration
def test_a_stale_lock_from_a_killed_build_is_removed_not_waited_on(tmp_path):
    """torch's FileBaton `lock` left by a killed build used to make every later first use hang. The damage is
    done to a copy of the built kernels in a cache of the test's own: the suite's cache, which other tests and
    their processes use, is never the one damaged. (A minute: the copy is rebuilt, its paths being new; the test
    above guards the same sequence in command 2.)"""
    isa = hardware.best_isa()
    cpu.build(isa)  # make sure the kernels exist, so the run below only loads them
    built = cpu.build_dir(isa)
    folder = tmp_path / "cache" / built.name
    shutil.copytree(built, folder)
    (folder / cpu.COMPLETE).unlink()  # a killed build never wrote its completion mark
    (folder / "lock").write_text("")
    code = "from pypto_gym.ops import registry; print(registry.get('cpu').unavailable_reason())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYPTO_GYM_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0 and proc.stdout.strip() == "None", proc.stderr
    assert "left by a build that was killed" in proc.stderr
    assert not (folder / "lock").exists()
    assert (built / cpu.COMPLETE).is_file() and not (built / "lock").exists()  # the suite's own build untouched


def test_the_suite_runs_in_a_home_and_a_cache_of_its_own():
    """Nothing the tests run reads or writes the user's ~/.cache/pypto_gym, ~/.pypto or torch.compile's
    /tmp/torchinductor_$USER (conftest.py), in any pytest -n worker."""
    from pathlib import Path

    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache

    from conftest import SESSION_DIR
    from pypto_gym import config

    assert Path.home() == SESSION_DIR / "home" and Path(inductor_cache()) == SESSION_DIR / "torchinductor"
    cache = config.cache_dir()
    assert cache == SESSION_DIR / "cache" or os.environ.get("PYPTO_GYM_TEST_CACHE")
    code = ("from pathlib import Path; from pypto_gym import config\n"
            "from torch._inductor.runtime.cache_dir_utils import cache_dir\n"
            "print(Path.home(), config.cache_dir(), cache_dir())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == [str(SESSION_DIR / "home"), str(cache), str(SESSION_DIR / "torchinductor")]


def test_builds_are_keyed_by_instruction_set_and_refused_on_a_cpu_without_it(monkeypatch):
    assert len({cpu.build_dir(isa) for isa, _ in hardware.ISA_LEVELS}) == len(hardware.ISA_LEVELS)
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    assert hardware.best_isa() == "avx2"
    backend = cpu.CpuBackend(isa="avx512bf16", name="cpu_test")
    assert "this CPU does not run avx512bf16 code" in backend.unavailable_reason()


@pytest.mark.parametrize("flags,level", [({"avx2", "fma", "f16c"}, "avx2"), (set(), "generic"),
                                         ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl"},
                                          "avx512")])
def test_the_level_follows_the_cpu(monkeypatch, flags, level):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset(flags))
    assert hardware.best_isa() == level
    assert hardware.native_bf16() is False


@pytest.mark.parametrize("granted,level", [(True, "avx512amx"), (False, "avx512bf16")])
def test_amx_tiles_need_the_cpu_and_the_os(monkeypatch, granted, level):
    """AMX is a level only where the CPU has the tiles and Linux grants this process their state (without the
    grant the first tile instruction kills the process): otherwise the same CPU runs avx512bf16."""
    avx512bf16 = dict(hardware.ISA_LEVELS)["avx512bf16"]
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({*avx512bf16, "amx_tile", "amx_bf16"}))
    monkeypatch.setattr(hardware, "amx_permitted", lambda: granted)
    monkeypatch.setattr(hardware.platform, "machine", lambda: "x86_64")
    assert hardware.best_isa() == level


def test_a_complete_build_loads_from_a_read_only_cache():
    """A pre-built cache on a read-only volume: loading must not open the lock (or anything) for writing."""
    cpu.build(hardware.best_isa())
    code = ("import pypto_gym.kernels.cpu.backend as cpu\n"
            "def read_only(*a, **k):\n"
            "    raise OSError(30, 'Read-only file system')\n"
            "cpu.build_lock = read_only\n"
            "from pypto_gym.ops import registry\n"
            "print(registry.get('cpu').unavailable_reason())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "None", proc.stdout + proc.stderr


def test_the_build_folder_is_keyed_by_content_not_by_install_path(monkeypatch):
    import torch

    here = cpu.build_dir("avx2")
    monkeypatch.setattr(torch, "__file__", "/another/clone/.venv/lib/torch/__init__.py")
    assert cpu.build_dir("avx2") == here


def test_an_unusable_kernel_cache_is_blamed_on_pypto_gym_cache(tmp_path):
    """A PYPTO_GYM_CACHE that cannot hold the kernels fell back to torch with a reason that did not say where the
    folder came from."""
    (tmp_path / "a_file").write_text("x")
    code = "from pypto_gym.ops import registry; print(registry.get('cpu').unavailable_reason())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYPTO_GYM_CACHE": str(tmp_path / "a_file" / "cache")})
    assert "must be a writable folder: set PYPTO_GYM_CACHE" in proc.stdout, proc.stdout + proc.stderr
