"""Every file pypto-gym writes (pypto_gym.files): atomic, with the mode `open(path, "w")` would give it."""
import os
import stat

import pytest

from pypto_gym import files


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_a_new_file_gets_0666_minus_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        files.write_text(tmp_path / "new.json", "{}")
        files.write_bytes(tmp_path / "new.bin", b"x")
    finally:
        os.umask(old)
    assert mode(tmp_path / "new.json") == mode(tmp_path / "new.bin") == 0o666 & ~umask


@pytest.mark.parametrize("existing", [0o644, 0o640, 0o600, 0o664])
def test_an_existing_file_keeps_its_mode(tmp_path, existing):
    path = tmp_path / "cases.json"
    path.write_text("old")
    os.chmod(path, existing)
    files.write_text(path, "new")
    assert path.read_text() == "new" and mode(path) == existing


def test_a_missing_parent_is_refused_like_cp_does(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"--report-file: directory .*/no/such does not exist"):
        files.check_writable(tmp_path / "no" / "such" / "r.json", "--report-file")
    assert not (tmp_path / "no").exists()


def _waiter(folder, wait_s):
    import subprocess
    import sys

    code = ("import sys\nfrom pathlib import Path\nfrom pypto_gym import files\n"
            "with files.exclusive(Path(sys.argv[1]), 'building X', float(sys.argv[2])):\n    print('built')\n")
    return subprocess.Popen([sys.executable, "-c", code, str(folder), str(wait_s)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_a_second_build_waits_for_the_first_and_says_so(tmp_path):
    """Two test workers (or two jobs) building into one cache: the second waits for the lock instead of racing."""
    import time

    with files.exclusive(tmp_path, "building X", 5):
        proc = _waiter(tmp_path, 60)
        time.sleep(3)
        assert proc.poll() is None  # still waiting
    out, err = proc.communicate(timeout=60)
    assert out == "built\n" and f"another process is building X in {tmp_path}; waiting..." in err


def test_a_lock_held_too_long_is_an_error_not_a_hang(tmp_path):
    with files.exclusive(tmp_path, "building X", 5):
        out, err = _waiter(tmp_path, 1).communicate(timeout=60)
    assert out == "" and f"TimeoutError: {tmp_path / '.pypto_gym.lock'} held for over 1.0 s" in err
