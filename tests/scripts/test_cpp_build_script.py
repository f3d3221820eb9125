"""scripts/cpp_inference/build.sh run with a Python that has no torch (no venv active): one line
naming what to activate, exit 2, no traceback (before cmake)."""

import os
import subprocess

import pytest

from tests.conftest import REPO


def _python_without_torch():
    for exe in ("/usr/bin/python3", "/bin/python3"):
        if os.path.exists(exe) and subprocess.run([exe, "-c", "import torch"], capture_output=True).returncode != 0:
            return exe
    pytest.skip("no Python without torch on this machine")


def test_build_without_the_venv_says_in_one_line_what_to_activate(tmp_path):
    exe = _python_without_torch()
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHON")}
    env["DLRMCTL_VENV"] = str(tmp_path / "no_venv")  # no project venv to fall back on
    env["PYTHON"] = exe
    p = subprocess.run(["bash", str(REPO / "scripts" / "cpp_inference" / "build.sh"), str(tmp_path / "b")],
                       capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 2, p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith(f"error: {exe} has no torch: activate the project's venv") and "Traceback" not in line
    assert not (tmp_path / "b").exists()

