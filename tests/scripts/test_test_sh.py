"""scripts/test.sh, the README's test command: it leaves out the tests marked ``slow`` unless given
``--slow`` or ``DLRMCTL_TEST_SLOW=1``, passes the other arguments to pytest, and CI's .ci/run calls
exactly it with the slow tests included.  Driven through a stand-in venv whose ``python`` records
its arguments (nothing is installed, no suite runs)."""

import os
import subprocess

import pytest

from tests.conftest import REPO


@pytest.fixture
def fake_venv(tmp_path):
    venv, log = tmp_path / "venv", tmp_path / "calls"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text(f'#!/bin/sh\nprintf "%s\\037" "$@" >> {log}\nprintf "\\n" >> {log}\n')
    py.chmod(0o755)
    (venv / "bin" / "activate").write_text(f'PATH="{venv / "bin"}:$PATH"\nexport PATH\n')
    return venv, log


def _pytest_args(fake_venv, *args, slow_env=None):
    venv, log = fake_venv
    env = {k: v for k, v in os.environ.items() if k != "DLRMCTL_TEST_SLOW"}
    env["DLRMCTL_VENV"] = str(venv)
    if slow_env is not None:
        env["DLRMCTL_TEST_SLOW"] = slow_env
    p = subprocess.run(["bash", str(REPO / "scripts" / "test.sh"), *args], capture_output=True, text=True,
                       timeout=60, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    calls = [line.split("\037")[:-1] for line in log.read_text().splitlines()]
    assert any(c[:3] == ["-m", "pip", "install"] and "-e" in c for c in calls), calls  # set-up first
    assert calls[-1][:4] == ["-m", "pytest", "-q", "-p"], calls
    log.unlink()
    return calls[-1][5:]


def test_the_default_run_leaves_out_the_slow_tests_and_passes_the_other_arguments(fake_venv):
    assert _pytest_args(fake_venv) == ["-m", "not slow"]
    assert _pytest_args(fake_venv, "tests/config", "-x") == ["-m", "not slow", "tests/config", "-x"]
    assert _pytest_args(fake_venv, slow_env="0") == ["-m", "not slow"]


def test_slow_or_the_environment_variable_runs_every_test(fake_venv):
    assert _pytest_args(fake_venv, "--slow") == []
    assert _pytest_args(fake_venv, "--slow", "-k", "launch") == ["-k", "launch"]
    assert _pytest_args(fake_venv, slow_env="1") == []


def test_ci_runs_exactly_the_readme_test_command_with_the_slow_tests():
    readme = (REPO / "README.md").read_text()
    assert "scripts/test.sh" in readme and "scripts/test.sh --slow" in readme
    lines = [x.strip() for x in (REPO / ".ci" / "run").read_text().splitlines() if x.strip() and not x.startswith("#")]
    assert lines[-1] == "exec bash scripts/test.sh" and "export DLRMCTL_TEST_SLOW=1" in lines
