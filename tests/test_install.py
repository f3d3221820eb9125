"""``pip install -e .[cpu,test]`` resolves, from wheels only, for every Python that ``requires-python``
admits beyond the one this suite runs on (3.12 and 3.13), with the tested pair torch 2.13.0 +
fbgemm-gpu-cpu 1.8.0 in the resolution.  Asks the package index through pip (``--dry-run``: nothing is
installed); skips with the reason when the index cannot be reached.

With a working ``python3.12`` / ``python3.13`` (on ``PATH``, or a pyenv version) that interpreter's pip
resolves ``.[cpu,test]`` itself.
Otherwise this interpreter's pip does, with ``--python-version``, in two parts: pip evaluates
environment markers against the interpreter that runs it, not against ``--python-version``, so the
project's own requirements (dependencies and the two extras) are listed with their markers evaluated
for the target Python; and the project alone (``--no-deps``) is checked against ``requires-python``."""

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

from tests.conftest import REPO

#: what pip prints when it cannot reach the index at all (not a resolution failure)
#: one resolution fetched torch's wheels in about 3 minutes here (2-core VM, load ~15)
PIP_TIMEOUT_S = 900
UNREACHABLE = re.compile(r"NewConnectionError|Max retries exceeded|Temporary failure in name resolution|"
                         r"Network is unreachable|ConnectTimeoutError|No route to host|ProxyError")


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def requirements_for(python: str, extras: tuple[str, ...] = ("cpu", "test")) -> list[str]:
    """The project's dependencies and ``extras``' requirements whose markers hold on ``python`` (X.Y),
    without their markers."""
    from packaging.requirements import Requirement

    proj = _project()
    env = {"python_version": python, "python_full_version": python + ".0"}
    out = []
    for r in proj["dependencies"] + [r for e in extras for r in proj["optional-dependencies"][e]]:
        req = Requirement(r)
        if req.marker is None or req.marker.evaluate(env):
            req.marker = None
            out.append(str(req))
    return out


def interpreter(python: str) -> str | None:
    """A ``pythonX.Y`` that runs and has pip (``PATH``, then ``~/.pyenv/versions``), or None."""
    found = [shutil.which(f"python{python}")]
    found += sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{python}*/bin/python{python}")))
    for exe in filter(None, found):
        p = subprocess.run([exe, "-c", "import sys, pip; print('%d.%d' % sys.version_info[:2])"],
                           capture_output=True, text=True, timeout=60)
        if p.returncode == 0 and p.stdout.strip() == python:
            return exe
    return None


def _pip(args: list[str], python: str = sys.executable) -> subprocess.CompletedProcess:
    try:
        p = subprocess.run([python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                            "--only-binary=:all:", *args], capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # a slow index must not hold CI (90 minutes in all) for an hour: the resolution is then unknown, not wrong
        pytest.skip(f"the package index did not answer within {PIP_TIMEOUT_S} s")
    if p.returncode != 0 and UNREACHABLE.search(p.stdout + p.stderr):
        pytest.skip(f"the package index cannot be reached: {UNREACHABLE.search(p.stdout + p.stderr).group(0)}")
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    return p


def test_requires_python_admits_3_11_to_3_13():
    from packaging.specifiers import SpecifierSet

    s = SpecifierSet(_project()["requires-python"])
    assert all(v in s for v in ("3.11.7", "3.12.3", "3.13.0")) and "3.14.0" not in s, s


def test_tritonclient_is_left_out_of_the_extras_from_python_3_12():
    # torchx 0.7 needs urllib3 < 1.27, which leaves tritonclient 2.41 (geventhttpclient <= 2.0.2: no wheel
    # for 3.12+); the serve tests skip without it
    assert any(r.startswith("tritonclient") for r in requirements_for("3.11"))
    assert not any(r.startswith("tritonclient") for r in requirements_for("3.12"))


@pytest.mark.slow
@pytest.mark.timeout(2 * PIP_TIMEOUT_S + 120)
@pytest.mark.skipif(os.environ.get("DLRMCTL_CHECK_INSTALL") != "1",
                    reason="set DLRMCTL_CHECK_INSTALL=1 to resolve against the index (.ci/run does): pip fetches the "
                           "wheels of torch and its CUDA libraries to read their metadata, several GB per Python")
@pytest.mark.parametrize("python", ["3.12", "3.13"])
def test_cpu_and_test_extras_resolve_from_wheels_for_python(tmp_path, python):
    report = tmp_path / "report.json"
    exe = interpreter(python)
    if exe:
        _pip(["--target", str(tmp_path / "t"), "--report", str(report), f"{REPO}[cpu,test]"], python=exe)
    else:
        target = ["--python-version", python, "--target", str(tmp_path / "t")]
        _pip([*target, "--no-deps", str(REPO)])  # requires-python admits it
        _pip([*target, "--report", str(report), *requirements_for(python)])
    got = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
           for i in json.loads(report.read_text())["install"]}
    assert got.get("torch") == "2.13.0" and got.get("fbgemm-gpu-cpu") == "1.8.0", got
    assert "torchx" in got and "pytest" in got, got
