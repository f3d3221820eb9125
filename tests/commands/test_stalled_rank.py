"""A stalled rank of a local ``train --nproc 2`` (SIGSTOP, a process frozen on I/O) hung the job
silently for the whole collective timeout (30 min), and a lowered timeout named the healthy peer:
the launcher's watchdog (:mod:`dlrmctl.stall_watch`) names the stalled rank within
``$DLRMCTL_STALL_TIMEOUT_S`` and stops the job, one error line, exit 1."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from dlrmctl.procs import proc_stat
from dlrmctl.stall_watch import StallWatch, forked_by_rank, rank_of, stall_limit_s
from tests.conftest import REPO

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")


def _wait_state(pid: int, stopped: bool) -> None:
    """Wait until /proc shows ``pid`` stopped (state ``T``) or not (a SIGSTOP / SIGCONT takes effect
    when the process is next scheduled: on a loaded machine, not within a fixed sleep)."""
    deadline = time.monotonic() + 60
    while (proc_stat(pid)[0] == "T") != stopped:
        assert time.monotonic() < deadline, f"pid {pid} not {'stopped' if stopped else 'running'} within 60 s"
        time.sleep(0.02)


def test_the_watchdog_names_a_stopped_rank_and_never_a_sleeping_one(monkeypatch):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={**os.environ, "RANK": "0"})
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={**os.environ, "RANK": "1"})
    try:
        assert rank_of(stopped.pid) == 1
        os.kill(stopped.pid, signal.SIGSTOP)
        _wait_state(stopped.pid, True)
        w = StallWatch(lambda: [sleeper.pid, stopped.pid], lambda *a: None, limit_s=5)
        assert w.check(100.0) is None  # first seen stopped at t=100
        assert w.check(104.0) is None
        rank, pid, what, secs = w.check(105.5)
        assert (rank, pid, secs) == (1, stopped.pid, 5.5) and "stopped" in what
        os.kill(stopped.pid, signal.SIGCONT)
        _wait_state(stopped.pid, False)
        assert w.check(200.0) is None  # running again: the count starts over
    finally:
        for p in (sleeper, stopped):
            p.kill()
            p.wait()
    monkeypatch.setenv("DLRMCTL_STALL_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="DLRMCTL_STALL_TIMEOUT_S"):
        stall_limit_s()


def test_the_watchdog_takes_a_process_forked_by_a_rank_for_no_rank():
    # a loader worker is a fork of its rank: it inherits RANK; stopped, the rank names it itself
    script = "import os, sys, time\npid = os.fork()\nif pid == 0:\n    time.sleep(60)\n    os._exit(0)\n" \
             "print(pid, flush=True)\ntime.sleep(60)\n"
    rank = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "RANK": "1"}, stdout=subprocess.PIPE,
                            text=True)
    try:
        child = int(rank.stdout.readline())
        assert rank_of(child) == 1
        os.kill(child, signal.SIGSTOP)
        _wait_state(child, True)
        w = StallWatch(lambda: [rank.pid, child], lambda *a: None, limit_s=5)
        assert w.check(100.0) is None and w.check(200.0) is None  # the stopped fork is not a rank
        os.kill(rank.pid, signal.SIGSTOP)
        _wait_state(rank.pid, True)
        assert w.check(300.0) is None
        assert w.check(306.0)[:2] == (1, rank.pid)  # the rank itself still is
    finally:
        rank.kill()
        rank.wait()
        try:
            os.kill(child, signal.SIGKILL)
        except (OSError, NameError):
            pass


def _workers(text: str) -> dict[int, int]:
    """rank -> pid of the rank processes whose command line mentions ``text`` (not their forks)."""
    out = {}
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                with open(f"/proc/{e}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            st = proc_stat(int(e))
            if (text.encode() in cmd and b"dlrmctl.train.worker" in cmd and rank_of(int(e)) is not None
                    and st is not None and not forked_by_rank(int(e), int(st[1]))):
                out[rank_of(int(e))] = int(e)
    return out


def _forks(pid: int) -> list[int]:
    """The children of ``pid`` forked by it (its loader workers: same command line)."""
    out = []
    for e in os.listdir("/proc"):
        st = proc_stat(int(e)) if e.isdigit() else None
        if st is not None and int(st[1]) == pid and forked_by_rank(int(e), pid):
            out.append(int(e))
    return sorted(out)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("stop", ["rank", "loader worker"])
def test_a_sigstopped_rank_or_loader_worker_is_named_and_the_job_stopped(tmp_path, stop):
    from dlrmctl.data.synthetic import generate_synthetic

    generate_synthetic(tmp_path / "data", rows=3000, seed=0, num_embeddings=[50] * 26)
    env = {**os.environ, "PYTHONPATH": REPO, "DLRMCTL_STALL_TIMEOUT_S": "5"}
    cmd = [sys.executable, "-m", "dlrmctl.cli", "train", "configs/demo.yaml", "--nproc", "2",
           "--set", f"data.path={tmp_path / 'data'}", "--set", f"train.run_dir={tmp_path / 'runs'}",
           "--set", "data.batch_size=8", "--set", "train.epochs=100", "--set", "train.progress=false",
           "--set", "train.log_every=1", "--set", f"data.workers={2 if stop == 'loader worker' else 0}"]
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        ranks: dict[int, int] = {}
        while time.monotonic() < deadline and len(ranks) < 2:
            time.sleep(1)
            ranks = _workers(str(tmp_path))
        assert len(ranks) == 2, p.poll()
        metrics = tmp_path / "runs" / "demo" / "metrics.jsonl"
        while not (metrics.exists() and '"train"' in metrics.read_text()):  # past start-up: training
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.2)
        victim = ranks[1]
        while stop == "loader worker":  # a worker of rank 1 that is stopped while it has batches to make
            forks = _forks(ranks[1])
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            if len(forks) == 2:
                victim = forks[-1]
                os.kill(victim, signal.SIGSTOP)
                while (proc_stat(victim) or ["gone"])[0] not in ("T", "Z", "gone"):
                    time.sleep(0.02)
                if (proc_stat(victim) or ["gone"])[0] == "T":
                    break  # else the epoch's workers had finished: the next epoch's
            time.sleep(0.05)
        if stop == "rank":
            os.kill(victim, signal.SIGSTOP)
        out, err = p.communicate(timeout=180)
    finally:
        for pid in [*_workers(str(tmp_path)).values(), *_forks(ranks.get(1, -1))]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if p.poll() is None:
            p.kill()
    assert p.returncode == 1, (p.returncode, err)
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    want = (rf"rank 1 \(pid {victim}\) has been stopped" if stop == "rank" else
            rf"rank 1 failed: WorkerError: loader worker \d of 2 \(pid {victim}\) has been stopped \(SIGSTOP or a debugger\)")
    assert len(errors) == 1 and re.search(want, errors[0]), err
