"""BatchLoader(workers=N): batches made in forked worker processes are bit-identical to the
thread's, in the same order, over a grid of settings (shuffle, seeds, rank slices, drop_last,
epochs, resume positions, multi-hot expansion, id policy); errors and a killed worker reach the
consumer naming the worker, without a hang; no worker outlives its iterator."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dlrmctl.cli import report_failure
from dlrmctl.data.loader import BatchLoader
from dlrmctl.data.loader_workers import WorkerError, auto_workers
from dlrmctl.sparse.validation import EmbeddingIdError, IdBound
from tests.data.test_data_loader import make_dataset

REPO = Path(__file__).resolve().parents[2]


def digest(b) -> str:
    """Every byte of a batch: dense, labels, KJT keys / stride / values / lengths / weights."""
    k = b.sparse_features
    h = hashlib.sha256(repr((k.keys(), k.stride(), k.length_per_key(), b.dense_features.shape)).encode())
    for t in (b.dense_features, b.labels, k.values(), k.lengths(), k.weights_or_none()):
        if t is not None:
            h.update(repr((t.dtype, tuple(t.shape))).encode() + t.contiguous().numpy().tobytes())
    return h.hexdigest()


def epoch_digests(d, **kw) -> list[str]:
    return [digest(b) for b in BatchLoader(d, "train", **kw)]


def child_pids() -> set[int]:
    """Live children of this process (any thread's)."""
    pids = set()
    for t in os.listdir("/proc/self/task"):
        try:
            pids |= {int(x) for x in Path(f"/proc/self/task/{t}/children").read_text().split()}
        except OSError:
            pass
    return pids


@pytest.fixture
def no_leftovers():
    """No worker process nor /dev/shm entry outlives the test."""
    before_pids, shm = child_pids(), set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    yield
    deadline = time.monotonic() + 30
    while child_pids() - before_pids and time.monotonic() < deadline:
        time.sleep(0.05)
    assert child_pids() - before_pids == set()
    if os.path.isdir("/dev/shm"):
        assert not {f for f in set(os.listdir("/dev/shm")) - shm if f.startswith(("torch_", "psm_", "wnsm_", "sem."))}


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_worker_batches_are_bit_identical_and_in_order_over_settings(tmp_path, shuffle, drop_last, no_leftovers):
    d = make_dataset(tmp_path, n=61, files=3, chunks=2)
    for seed, (window, block) in ((4, (8, 3)), (11, (1000, 4))):
        kw = dict(batch_size=7, shuffle=shuffle, seed=seed, drop_last=drop_last, shuffle_window_rows=window,
                  shuffle_block_rows=block)
        for world in (1, 3):
            for rank in range(world):
                ref = epoch_digests(d, rank=rank, world_size=world, **kw)
                assert len(set(ref)) == len(ref)  # the batches differ: a reordering would show
                for workers in (1, 2, 5):
                    got = epoch_digests(d, rank=rank, world_size=world, workers=workers, **kw)
                    assert got == ref, (seed, world, rank, workers)
        if not shuffle:
            break  # the seed and window do not matter unshuffled


def test_batches_held_by_the_consumer_are_never_overwritten(tmp_path, no_leftovers):
    # every batch kept: the workers run out of free slots and send the rest pickled; none changes
    d = make_dataset(tmp_path, n=90, files=2, chunks=3)
    kw = dict(batch_size=3, shuffle=True, seed=5, shuffle_window_rows=16, shuffle_block_rows=4)
    held = list(BatchLoader(d, "train", workers=2, **kw))
    assert len(held) == 30 and [digest(b) for b in held] == epoch_digests(d, **kw)


def test_a_worker_as_far_ahead_as_allowed_blocks_instead_of_polling(tmp_path, no_leftovers):
    """While the consumer holds off, a worker with its batches ahead sleeps on its semaphore (a
    wake-up per parent check, 10 a second) instead of polling the ring every half millisecond:
    counted by its voluntary context switches over a second (the rate, not a time, is asserted)."""
    d = make_dataset(tmp_path, n=200, files=2, chunks=2)
    it = iter(BatchLoader(d, "train", batch_size=4, workers=1, prefetch=2))
    next(it)
    workers = sorted(child_pids())
    assert len(workers) == 1

    def switches() -> int:
        status = Path(f"/proc/{workers[0]}/status").read_text()
        return int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("voluntary_ctxt_switches")))

    time.sleep(0.5)  # it fills its depth
    before = switches()
    time.sleep(1.0)
    assert switches() - before < 100  # polling every 0.5 ms: hundreds to 2,000 a second
    rest = list(it)
    assert len(rest) == 49


def test_epochs_and_resume_positions_match_the_thread_path(tmp_path, no_leftovers):
    d = make_dataset(tmp_path, n=45, files=2, chunks=2)
    kw = dict(batch_size=4, shuffle=True, seed=9, shuffle_window_rows=8, shuffle_block_rows=3)
    thread, procs = BatchLoader(d, "train", **kw), BatchLoader(d, "train", workers=3, **kw)
    for _ in range(2):  # two epochs, each its own order
        assert [digest(b) for b in procs] == [digest(b) for b in thread]
    assert procs.state_dict() == thread.state_dict() == {"epoch": 2, "batches_yielded": 0}
    want = epoch_digests(d, **kw)
    for k in (1, 5, 11):  # 11: the last, partial batch
        first = BatchLoader(d, "train", workers=2, **kw)
        it = iter(first)
        got = [digest(next(it)) for _ in range(k)]
        state = json.loads(json.dumps(first.state_dict()))
        it.close()
        assert state == {"epoch": 0, "batches_yielded": k}
        for workers in (0, 2, 4):  # saved with workers, resumed with a thread or other workers
            again = BatchLoader(d, "train", workers=workers, **kw)
            again.load_state_dict(state)
            assert got + [digest(b) for b in again] == want


def test_multi_hot_expansion_and_zeroed_ids_match_the_thread_path(tmp_path, no_leftovers):
    d = make_dataset(tmp_path, n=40, files=2, chunks=2)
    bounds = {"C1": [IdBound("C1@big", "C1", "big", 400), IdBound("C1@small", "C1", "small", 150)],
              "M1": ("m", 30)}  # ids >= 150 of C1, >= 30 of M1 dropped: keys feature@table
    kw = dict(batch_size=6, shuffle=True, seed=2, shuffle_window_rows=16, shuffle_block_rows=4,
              multi_hot_sizes={"C1": 3}, multi_hot_distribution="pareto", id_bounds=bounds, on_invalid_id="zero")
    ref = [b for b in BatchLoader(d, "train", **kw)]
    assert "C1@small" in ref[0].sparse_features.keys()
    assert epoch_digests(d, workers=2, **kw) == [digest(b) for b in ref]


def test_a_stuck_worker_is_killed_and_named_after_the_stall_limit(tmp_path, monkeypatch, no_leftovers):
    import dlrmctl.data.loader_workers as workers

    monkeypatch.setattr(workers, "WORKER_STALL_S", 0.5)
    before = child_pids()
    it = iter(BatchLoader(make_dataset(tmp_path, n=40), "train", 2, workers=2, prefetch=0))
    next(it)
    stuck = sorted(child_pids() - before)
    for pid in stuck:
        os.kill(pid, signal.SIGSTOP)  # alive, never sends again
    with pytest.raises(WorkerError, match=r"loader worker \d of 2 \(pid \d+\) made no batch in 0.5 s \(stuck; killed\)"):
        for _ in it:
            pass


def test_a_stopped_worker_is_named_after_the_stall_timeout_of_ranks(tmp_path, monkeypatch, no_leftovers):
    monkeypatch.setenv("DLRMCTL_STALL_TIMEOUT_S", "1")  # WORKER_STALL_S stays 600 s
    before = child_pids()
    it = iter(BatchLoader(make_dataset(tmp_path, n=400), "train", 2, workers=2, prefetch=0))  # 200 batches
    next(it)
    victim = max(child_pids() - before)
    os.kill(victim, signal.SIGSTOP)
    with pytest.raises(WorkerError, match=rf"loader worker \d of 2 \(pid {victim}\) has been stopped \(SIGSTOP or a "
                                          r"debugger\) for \d+ s; .*DLRMCTL_STALL_TIMEOUT_S"):
        for _ in it:
            pass


def test_a_bad_stall_timeout_is_one_error_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DLRMCTL_STALL_TIMEOUT_S", "soon")
    with pytest.raises(Exception) as e:
        next(iter(BatchLoader(make_dataset(tmp_path, n=10), "train", 2, workers=1)))
    assert report_failure(e.value) == 2 and "DLRMCTL_STALL_TIMEOUT_S" in capsys.readouterr().err


def test_an_error_in_a_worker_is_raised_in_the_consumer_naming_the_worker(tmp_path, no_leftovers):
    d = make_dataset(tmp_path, n=40)
    loader = BatchLoader(d, "train", 4, workers=2, id_bounds={"C1": ("t", 200)})  # row 20 has C1 = 200
    it = iter(loader)
    got = [next(it) for _ in range(5)]  # batches 1-5: rows 0-19, ids < 200
    with pytest.raises(EmbeddingIdError, match="batch 6") as e:
        next(it)
    assert len(got) == 5 and any("loader worker 1 of 2" in n for n in e.value.__notes__)


def test_a_user_error_in_a_worker_is_the_same_error_line_as_without_workers(tmp_path, capsys, no_leftovers):
    d = make_dataset(tmp_path, n=40)
    lines = []
    for workers in (0, 2):
        with pytest.raises(EmbeddingIdError) as e:
            list(BatchLoader(d, "train", 4, workers=workers, id_bounds={"C1": ("t", 200)}))
        assert report_failure(e.value) == 2  # a user error: exit 2, no traceback
        lines.append(capsys.readouterr().err.splitlines())
    assert len(lines[0]) == 1 and lines[0][0].startswith("error: ") and lines[1] == lines[0]


def test_a_killed_worker_is_one_error_line_naming_it_not_a_hang(tmp_path, capsys, no_leftovers):
    d = make_dataset(tmp_path, n=400)
    before = child_pids()
    it = iter(BatchLoader(d, "train", 2, workers=2, prefetch=0))  # 200 batches, 2 ahead per worker
    next(it)
    victim = max(child_pids() - before)
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(WorkerError, match=rf"loader worker \d of 2 \(pid {victim}\) was killed by signal 9 \(SIGKILL\)") as e:
        for _ in it:
            pass
    assert report_failure(e.value) == 1  # not the user's input, not a bug: one line, as a failed rank
    assert capsys.readouterr().err == f"error: {e.value}\n"


def test_closing_or_dropping_the_iterator_reaps_the_workers(tmp_path, no_leftovers):
    d = make_dataset(tmp_path, n=100)
    before = child_pids()
    it = iter(BatchLoader(d, "train", 2, shuffle=True, workers=3))
    next(it)
    assert len(child_pids() - before) == 3
    it.close()
    assert child_pids() - before == set()
    loader = BatchLoader(d, "train", 2, workers=2)
    try:
        for _ in loader:
            raise KeyboardInterrupt  # what Ctrl-C in the step does
    except KeyboardInterrupt:
        pass
    assert child_pids() - before == set()


@pytest.mark.slow  # a Python process importing torch
def test_ctrl_c_of_the_process_group_stops_the_run_and_its_workers(tmp_path):
    d = make_dataset(tmp_path, n=2000)
    script = textwrap.dedent(f"""
        import os, sys, time
        from dlrmctl.data.loader import BatchLoader
        it = iter(BatchLoader({str(d)!r}, "train", 2, shuffle=True, workers=2))
        next(it)
        kids = set()
        for t in os.listdir("/proc/self/task"):
            kids |= set(open(f"/proc/self/task/{{t}}/children").read().split())
        print(" ".join(sorted(kids)), flush=True)
        for b in it:
            time.sleep(0.01)  # the step
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    try:
        kids = [int(x) for x in p.stdout.readline().split()]
        assert len(kids) == 2
        os.killpg(p.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode != 0 and "KeyboardInterrupt" in err
    deadline = time.monotonic() + 60
    alive = kids
    while alive and time.monotonic() < deadline:
        alive = [k for k in alive if Path(f"/proc/{k}").exists() and "Z" not in _state(k)]
        time.sleep(0.05)
    assert alive == []


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def test_auto_workers_is_none_on_cpu_and_the_rank_share_of_cpus_less_one_on_cuda():
    assert auto_workers("cpu", cpus=64) == 0
    assert auto_workers("cuda", cpus=16) == 4  # at most 4
    assert auto_workers("cuda:0", 1, cpus=3) == 2
    assert auto_workers("cuda", 8, cpus=16) == 1
    assert auto_workers("cuda", 8, cpus=8) == 0


def test_bad_worker_counts_are_refused(tmp_path):
    d = make_dataset(tmp_path, n=10)
    with pytest.raises(ValueError, match="workers must be >= 0"):
        BatchLoader(d, "train", 4, workers=-1)
