"""scripts/gpu_check.sh on a CPU-only machine, as it must run on the device image: in an environment
where torchx, tritonclient and fbgemm_gpu cannot be imported, with ``TMPDIR`` pointing at a directory
that does not exist yet.  It passes (CUDA-only steps skipped with their reason), writes at most 8 files
under its output directory, and a kill partway leaves the finished steps' records."""

import json
import os
import signal
import subprocess
import time

import pytest

from tests.conftest import REPO
from tests.helpers.clean_venv import venv_without

#: per-step limits x this on a loaded CPU machine (the limits are sized for the GPU)
LIMIT_SCALE = "8"


@pytest.fixture(scope="module")
def clean_python(tmp_path_factory):
    py = venv_without(tmp_path_factory.mktemp("venv") / "v")
    probe = ("import importlib.util as u; import torch, numpy, pyarrow, yaml, typer, tqdm, pytest; "
             "print([m for m in ('torchx', 'tritonclient', 'fbgemm_gpu') if u.find_spec(m)])")
    out = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
    return py


def _start(py, out):
    env = dict(os.environ, PYTHON=py, TMPDIR=str(out / "w"), GPU_CHECK_LIMIT_SCALE=LIMIT_SCALE)
    env.pop("OUT", None)
    return subprocess.Popen(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--out", str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _ended(out) -> set:
    """The steps whose end is recorded in ``out/steps.jsonl`` so far."""
    try:
        lines = (out / "steps.jsonl").read_text().split("\n")[:-1]  # (after the last newline: half-written)
    except OSError:
        return set()
    recs = [json.loads(line) for line in lines if line.strip()]
    return {r["step"] for r in recs if r["status"] != "started"}


def _files(out):
    return sorted(os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs)


@pytest.fixture(scope="module")
def full_run(clean_python, tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "out"
    t0 = time.time()
    p = _start(clean_python, out)
    log = p.communicate(timeout=1800)[0].decode()
    return out, p.returncode, log, time.time() - t0


@pytest.mark.slow
def test_passes_without_the_optional_packages_and_a_missing_tmpdir_in_at_most_8_files(full_run):
    out, rc, log, _ = full_run
    assert rc == 0, log[-4000:]
    files = _files(out)
    assert len(files) <= 8 and "gpu_check.json" in files and "steps.jsonl" in files, files
    assert len([f for f in files if f.startswith("logs")]) <= 6, files
    steps = json.loads((out / "gpu_check.json").read_text())["steps"]
    assert {s: r["status"] for s, r in steps.items()} == {
        "env": "passed", "data": "passed", "pytest": "skipped", "demo": "passed", "bf16": "passed",
        "fp16": "skipped", "resume": "passed", "parity": "passed", "pt2": "passed",
        "serve": steps["serve"]["status"]}, log[-4000:]
    assert steps["serve"]["status"] in ("passed", "skipped"), steps["serve"]
    assert steps["env"]["fbgemm"] == "dense fallback (no fbgemm_gpu)"
    assert "samples/s of the dense fallback" in steps["demo"]["samples_per_s_label"]
    assert steps["demo"]["peak_memory_mib"] > 0 and steps["resume"]["steps"] == 60
    assert steps["parity"]["identical"] and steps["parity"]["max_rel_diff"] == 0.0
    assert "needs CUDA" in steps["fp16"]["reason"]
    # every record was appended as the step started and again as it ended
    recs = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    for step in set(steps) - {"pytest"}:
        mine = [r["status"] for r in recs if r["step"] == step]
        assert mine[0] == "started" and mine[-1] == steps[step]["status"] and len(mine) == 2, (step, mine)
    assert not os.listdir(out / "w"), "the scratch directory is removed at the end"


@pytest.mark.slow
def test_a_kill_at_60_percent_of_the_run_leaves_the_finished_steps_records(clean_python, full_run, tmp_path):
    duration = full_run[3]
    out = tmp_path / "out"
    p = _start(clean_python, out)
    try:
        # 60% of the full run's time, and not before env and data have ended: a machine more loaded now
        # than during the full run is slower to get there (a fixed sleep then killed it before them)
        t0, limit = time.monotonic(), 10 * duration + 120
        while (time.monotonic() - t0 < 0.6 * duration or not {"env", "data"} <= _ended(out)) and p.poll() is None:
            assert time.monotonic() - t0 < limit, f"env and data did not end within {limit:.0f} s"
            time.sleep(0.2)
        os.killpg(p.pid, signal.SIGKILL)  # the slot ends: everything is killed at once
        p.wait(30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    recs = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines() if line.strip()]
    last = {}
    for r in recs:
        last[r["step"]] = r
    finished = [s for s, r in last.items() if r["status"] != "started"]
    running = [s for s, r in last.items() if r["status"] == "started"]
    assert {"env", "data"} <= set(finished) and len(running) <= 1, last
    assert all(last[s]["status"] in ("passed", "skipped") for s in finished), last
    summary = json.loads((out / "gpu_check.json").read_text())["steps"]
    assert {s: r["status"] for s, r in summary.items()} == {s: r["status"] for s, r in last.items()}
    # scratch files under TMPDIR (inside out here) are left by a kill; what the check writes stays <= 8
    assert len([f for f in _files(out) if not f.startswith("w" + os.sep)]) <= 8, _files(out)


def test_stops_at_once_when_the_scratch_directory_cannot_be_made(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")  # TMPDIR below a regular file: cannot be created
    env = dict(os.environ, TMPDIR=str(blocker / "w"), PYTHON="/bin/false")
    env.pop("OUT", None)
    p = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--out", str(tmp_path / "out")], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "cannot create the scratch directory" in p.stderr, p.stdout + p.stderr
    assert _files(tmp_path / "out") == []
