"""Every child process dlrmctl starts ends with its parent (issue 23 item 11): SIGKILL of the parent
leaves no orphan; SIGTERM stops the children and is reported in one line with a non-zero exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and PR_SET_PDEATHSIG: Linux")


def _children(pid: int) -> list[int]:
    out = []
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                with open(f"/proc/{e}/stat") as f:
                    text = f.read()
            except OSError:
                continue
            fields = text[text.rindex(")") + 2:].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(e))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return False
    return text[text.rindex(")") + 2:].split()[0] != "Z"


def _wait_gone(pids: list[int], timeout_s: float = 120.0) -> list[int]:
    """The ``pids`` still alive after up to ``timeout_s`` (a child spawned just before its parent died
    arms its death signal only once it runs: on a loaded machine that can take many seconds)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


@pytest.fixture(scope="module")
def two_big_files(tmp_path_factory):
    """Two Criteo TSVs of 400,000 rows each (a few seconds of work per worker, on an idle machine too)."""
    d = tmp_path_factory.mktemp("big")
    rng = np.random.default_rng(0)
    n = 10_000
    ints = rng.integers(0, 100, size=(n, 13))
    cats = rng.integers(0, 2**32, size=(n, 26), dtype=np.uint64)
    block = "".join("\t".join([str(i % 2), *map(str, ints[i]), *(f"{c:08x}" for c in cats[i])]) + "\n"
                    for i in range(n))
    paths = []
    for name in ("a.tsv", "b.tsv"):
        with open(d / name, "w") as f:
            for _ in range(40):
                f.write(block)
        paths.append(str(d / name))
    return paths


def _start_preprocess(files, out):
    cmd = [sys.executable, "-m", "dlrmctl.cli", "preprocess", "criteo", *(a for p in files for a in ("--input", p)),
           "--out", str(out), "--workers", "2", "--num-embeddings", "100", "-q"]
    p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    workers: list[int] = []
    while time.monotonic() < deadline and p.poll() is None:
        workers = _children(p.pid)
        if len(workers) >= 2:
            break
        time.sleep(0.05)
    if len(workers) < 2:
        p.kill()
        pytest.fail(f"preprocess did not start 2 workers (exit {p.poll()}): {p.communicate()}")
    time.sleep(0.1)  # the workers are inside their tasks (and the work is far from done)
    return p, workers


def test_sigkill_of_preprocess_leaves_no_worker_behind(two_big_files, tmp_path):
    p, workers = _start_preprocess(two_big_files, tmp_path / "out")
    p.kill()
    p.wait(timeout=30)
    left = _wait_gone(workers)
    for pid in left:  # do not leak them into the rest of the suite
        os.kill(pid, signal.SIGKILL)
    assert not left, f"workers {left} outlived their SIGKILLed parent"


def test_sigterm_of_preprocess_stops_the_workers_and_says_so_in_one_line(two_big_files, tmp_path):
    p, workers = _start_preprocess(two_big_files, tmp_path / "out")
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    left = _wait_gone(workers)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"workers {left} outlived the SIGTERMed preprocess"
    assert p.returncode == 128 + signal.SIGTERM, (p.returncode, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: interrupted (SIGTERM)") and "resume" in lines[0], err
    assert "Traceback" not in err
    # and it resumes: the same command finishes the job
    r = subprocess.run([sys.executable, "-m", "dlrmctl.cli", "preprocess", "criteo",
                        *(a for f in two_big_files for a in ("--input", f)), "--out", str(tmp_path / "out"),
                        "--workers", "2", "--num-embeddings", "100", "-q"], cwd=REPO, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0 and "train 800,000" in r.stdout, r.stdout + r.stderr


_RANKS_PARENT = """
import sys, time
from dlrmctl.distributed.local_ranks import run_local_ranks
from tests.commands.test_child_processes import sleep_rank
print("started", flush=True)
run_local_ranks(sleep_rank, 2, (float(sys.argv[1]),), what="probe")
"""


def sleep_rank(env, seconds: float) -> int:
    """A rank that outlives the test unless it ends with its parent."""
    import time

    time.sleep(seconds)
    return env.rank


def test_local_ranks_end_with_a_sigkilled_parent():
    """run_local_ranks (checkpoint reshard --nproc, the planner's calibration) spawns ranks: they
    end with the process that spawned them."""
    p = subprocess.Popen([sys.executable, "-c", _RANKS_PARENT, "600"], cwd=REPO, stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        deadline = time.monotonic() + 120
        ranks: list[int] = []
        while time.monotonic() < deadline and p.poll() is None:
            ranks = [c for c in _children(p.pid) if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read()]
            if len(ranks) == 2:
                break
            time.sleep(0.1)
        assert len(ranks) == 2, (p.poll(), ranks)
    finally:
        p.kill()
        p.wait(timeout=30)
    left = _wait_gone(ranks)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"ranks {left} outlived their SIGKILLed parent"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_train_nproc_ranks_and_torchrun_end_with_a_sigkilled_launcher(tmp_path):
    """torchrun runs in its own session (torchx): a SIGKILLed `dlrmctl train --nproc 2` takes its
    ranks with it (they watch the launcher), and torchrun ends with its ranks."""
    from dlrmctl.data.synthetic import generate_synthetic

    generate_synthetic(tmp_path / "data", rows=3000, seed=0, num_embeddings=[50] * 26)
    name = f"orphan{os.getpid()}"
    cmd = [sys.executable, "-m", "dlrmctl.cli", "train", "configs/demo.yaml", "--nproc", "2",
           "--set", f"data.path={tmp_path / 'data'}", "--set", f"train.run_dir={tmp_path / 'runs'}",
           "--set", f"name={name}", "--set", "data.batch_size=2", "--set", "train.epochs=50"]
    p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), start_new_session=True)
    metrics = tmp_path / "runs" / name / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and '"train"' in metrics.read_text()) and time.monotonic() < deadline:
        assert p.poll() is None
        time.sleep(0.2)
    job = [pid for pid in _procs_with(name) if pid != p.pid]
    assert len(job) >= 3, job  # torchrun and 2 ranks
    p.kill()
    p.wait(timeout=30)
    left = _wait_gone(job, timeout_s=30)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"{left} outlived the SIGKILLed launcher"


def _procs_with(marker: str) -> list[int]:
    out = []
    for e in os.listdir("/proc"):
        if e.isdigit() and int(e) != os.getpid():
            try:
                cmd = open(f"/proc/{e}/cmdline", "rb").read().decode(errors="replace")
            except OSError:
                continue
            if marker in cmd and _alive(int(e)):
                out.append(int(e))
    return out
