"""The suite does not depend on where the checkout lives or what its directory is called.

The case of issue 23: a clone in a directory named ``dlrmctl`` with its virtual environment
inside it (``dlrmctl/.venv``), so torch's and FBGEMM's own files have ``/dlrmctl/`` in their
paths too.  A copy of this checkout is made in ``<tmp>/x/dlrmctl`` with a ``.venv`` that is a
symlink to the environment running these tests, and the path-sensitive parts run there: the
ownership predicate of the host-sync counter, and the host-sync test itself, started from
another working directory (``tests/``) than the checkout's root.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO

_PROBE = textwrap.dedent("""
    import os, sys
    import dlrmctl, fbgemm_gpu, torch
    from fbgemm_gpu import split_table_batched_embeddings_ops_training as tbe
    from dlrmctl.train import trainer as loop
    from tests.train.test_host_sync import owned_by_dlrmctl, package_dir

    clone = os.path.realpath(sys.argv[1])
    assert package_dir() == os.path.join(clone, "dlrmctl"), (dlrmctl.__file__, clone)
    # the issue's case: the environment's files have /dlrmctl/ in their path
    for mod in (torch, tbe):
        assert mod.__file__.startswith(sys.argv[1] + os.sep), mod.__file__
        assert os.sep + "dlrmctl" + os.sep in mod.__file__, mod.__file__
        assert not owned_by_dlrmctl(mod.__file__), mod.__file__
    assert owned_by_dlrmctl(loop.__file__) and owned_by_dlrmctl(os.path.join(sys.argv[1], "dlrmctl", "x.py"))
    assert not owned_by_dlrmctl(os.path.join(sys.argv[1], "dlrmctl_extra", "x.py"))
    print("probe ok")
""")


def _copy_checkout(dst: Path) -> None:
    """The checkout's files (tracked and untracked, not ignored ones: no venv, no runs) copied to ``dst``."""
    try:
        names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                               capture_output=True, timeout=60).stdout.decode().split("\0")
    except (OSError, subprocess.SubprocessError):  # not a git checkout (an sdist / a tarball): the package and tests
        names = [str(p.relative_to(REPO)) for top in ("dlrmctl", "tests", "configs", "pyproject.toml")
                 for p in ([REPO / top] if (REPO / top).is_file() else (REPO / top).rglob("*"))
                 if p.is_file() and "__pycache__" not in p.parts]
    for name in filter(None, names):
        src = REPO / name
        if src.is_file() and not src.is_symlink():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)


@pytest.fixture(scope="module")
def clone_named_dlrmctl(tmp_path_factory) -> tuple[Path, str, dict]:
    """``(<tmp>/x/dlrmctl, its python, env)``: a copy of this checkout whose environment lives inside it."""
    import torch

    clone = tmp_path_factory.mktemp("clones") / "x" / "dlrmctl"
    clone.mkdir(parents=True)
    _copy_checkout(clone)
    env = dict(os.environ, PYTHONPATH=str(clone), PYTHONDONTWRITEBYTECODE="1")
    env.pop("DLRMCTL_SHARED_DATA", None)
    if sys.prefix != sys.base_prefix:  # a venv: the clone's .venv is (a symlink to) it, run its python
        (clone / ".venv").symlink_to(os.path.realpath(sys.prefix), target_is_directory=True)
        python = str(clone / ".venv" / "bin" / os.path.basename(sys.executable))
    else:  # no venv: the site-packages holding torch, reached through the clone's .venv
        site = clone / ".venv" / "lib" / "site-packages"
        site.parent.mkdir(parents=True)
        site.symlink_to(os.path.dirname(os.path.dirname(os.path.realpath(torch.__file__))), target_is_directory=True)
        env["PYTHONPATH"] = os.pathsep.join([str(clone), str(site)])
        python = sys.executable
    return clone, python, env


def test_host_sync_counter_owns_only_the_packages_files_in_a_clone_named_dlrmctl(clone_named_dlrmctl):
    clone, python, env = clone_named_dlrmctl
    p = subprocess.run([python, "-c", _PROBE, str(clone)], cwd=clone, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and "probe ok" in p.stdout, p.stdout + p.stderr


@pytest.mark.slow  # a nested pytest that imports torch and runs a 2-rank job
@pytest.mark.multiprocess
def test_host_sync_test_passes_from_a_clone_named_dlrmctl_started_in_another_directory(clone_named_dlrmctl):
    clone, python, env = clone_named_dlrmctl
    # table_row_mix: FBGEMM's TBE (whose training op reads .item() itself) on every sharded table
    p = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "../tests/train/test_host_sync.py",
                        "-k", "table_row_mix"], cwd=clone / "tests", env=env, capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0 and "1 passed" in p.stdout, p.stdout[-4000:] + p.stderr[-2000:]
