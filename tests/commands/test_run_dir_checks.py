"""A mistyped or wrong run directory is one error line, before torch is imported, naming the runs
that are there (evaluate, export, checkpoint inspect, checkpoint reshard)."""

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import sys
from typer.testing import CliRunner
from dlrmctl.cli import app
r = CliRunner().invoke(app, sys.argv[1:])
print(repr(r.output))
print(r.exit_code)
print('torch' in sys.modules)
"""


def _run(cwd, *args):
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=300)
    out, code, torch_loaded = p.stdout.strip().splitlines()[-3:]
    return eval(out), int(code), torch_loaded == "True"


@pytest.fixture()
def runs(tmp_path):
    for name in ("criteo_sample", "avazu"):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "config.yaml").write_text(json.dumps({"name": name}))
    return tmp_path


@pytest.mark.parametrize("verb", [["evaluate"], ["export", "--int8"], ["checkpoint", "inspect"],
                                  ["checkpoint", "reshard", "--nproc", "2"]])
def test_a_mistyped_run_is_one_line_before_torch_suggesting_the_near_run(runs, verb):
    args = [verb[0], *verb[1:2], "runs/criteo_smple", *verb[2:]] if verb[0] == "checkpoint" else \
        [verb[0], "runs/criteo_smple", *verb[1:]]
    out, code, torch_loaded = _run(runs, *args)
    assert code == 2 and not torch_loaded, out
    assert out.count("error:") == 1 and len(out.strip().splitlines()) == 1, out
    assert "runs/criteo_smple: no such run directory" in out and "did you mean runs/criteo_sample?" in out


def test_the_directory_of_runs_given_for_one_run_names_the_runs_it_holds(runs):
    out, code, torch_loaded = _run(runs, "evaluate", "runs")
    assert code == 2 and not torch_loaded
    assert "runs: no config.yaml; not a dlrmctl run directory" in out
    assert "runs/avazu" in out and "runs/criteo_sample" in out


def test_a_file_given_for_a_run_is_one_line(runs):
    (runs / "notes.txt").write_text("x")
    out, code, torch_loaded = _run(runs, "checkpoint", "inspect", "notes.txt")
    assert code == 2 and not torch_loaded and "notes.txt: not a directory" in out, out
