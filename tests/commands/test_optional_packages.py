"""Without torchx, tritonclient and fbgemm_gpu (the GPU image has none of them) every dlrmctl module
imports, except the one that subclasses torchx's Slurm scheduler, and a command that needs a missing
package says so in one ``error:`` line naming it and how to install it."""

import subprocess

import pytest

from dlrmctl.errors import OPTIONAL_PACKAGES, user_error_message
from tests.conftest import REPO
from tests.helpers.clean_venv import venv_without


@pytest.mark.parametrize("name", ["torchx", "torchx.specs", "fastapi", "fbgemm_gpu.split_table_batched_embeddings_ops"])
def test_a_missing_optional_package_is_one_line_naming_it_and_its_install(name):
    msg = user_error_message(ModuleNotFoundError(f"No module named '{name}'", name=name))
    top = name.split(".")[0]
    assert msg == f"this command needs {top}, which is not installed here: {OPTIONAL_PACKAGES[top]}"
    assert user_error_message(ModuleNotFoundError("No module named 'nope'", name="nope")) is None  # a bug


@pytest.mark.slow
def test_every_module_imports_and_jobs_says_torchx_is_missing_in_one_line(tmp_path):
    py = venv_without(tmp_path / "v")
    walk = ("import importlib, pkgutil, dlrmctl\n"
            "bad = []\n"
            "for m in pkgutil.walk_packages(dlrmctl.__path__, 'dlrmctl.'):\n"
            "    if m.name == 'dlrmctl.launch.slurm':  # torchx's Slurm scheduler, subclassed: launch imports it lazily\n"
            "        continue\n"
            "    try:\n"
            "        importlib.import_module(m.name)\n"
            "    except Exception as e:\n"
            "        bad.append((m.name, repr(e)))\n"
            "print('BAD', bad)\n")
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    p = subprocess.run([py, "-c", walk], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0 and "BAD []" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    cli = "import sys; sys.argv[0] = 'dlrmctl'; from dlrmctl.cli import main; main()"
    p = subprocess.run([py, "-c", cli, "jobs", "status", "42"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0, p.stdout + p.stderr
    assert p.stderr.startswith("error: this command needs torchx, which is not installed here"), p.stderr
