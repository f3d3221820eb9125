"""Issue 14b: a run holds an exclusive lock on runs/<name>/.lock; a second `train` of the same run
directory is refused (one line, nothing touched); a dead holder's lock file does not block."""

import fcntl
import os

import pytest
from typer.testing import CliRunner

from dlrmctl import run_lock
from dlrmctl.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from dlrmctl.data.synthetic import generate_synthetic

    d = tmp_path_factory.mktemp("lockdata") / "data"
    generate_synthetic(d, rows=1200, seed=0, num_embeddings=[40] * 26)
    return d


def _args(data, runs, *extra):
    return ["train", "configs/demo.yaml", "--set", f"data.path={data}", "--set", f"train.run_dir={runs}",
            "--set", "name=a", "--set", "train.progress=false", "--set", "data.batch_size=256",
            "--set", "model.compute_kernel=dense", "--set", "train.max_steps=2", *extra]


def _snapshot(d):
    return {str(p.relative_to(d)): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
            for p in sorted(d.rglob("*"))}


def _hold(run_dir, pid=4242):
    """Lock ``run_dir`` the way another dlrmctl process would (its own open file description)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.ftruncate(fd, 0)
    os.write(fd, f"{pid}\n".encode())
    return fd


@pytest.mark.parametrize("flags", [[], ["--resume"], ["--overwrite"]])
def test_a_second_train_of_a_locked_run_directory_is_refused_before_touching_it(data, tmp_path, flags):
    runs = tmp_path / "runs"
    run = runs / "a"
    # a first attempt that is still running, before its first checkpoint
    fd = _hold(run)
    (run / "config.yaml").write_text("name: a\n")
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    before = _snapshot(run)
    try:
        r = runner.invoke(app, _args(data, runs, *flags))
    finally:
        after = _snapshot(run)
        os.close(fd)
    assert r.exit_code == 2, r.output
    (line,) = r.output.strip().splitlines()
    assert line == (f"error: {run} is in use by a running dlrmctl (pid 4242); wait for it or --set name=<other>")
    assert after == before


def test_the_lock_is_held_during_a_run_and_released_after_it(data, tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    seen = {}
    import dlrmctl.train.trainer as trainer_mod

    real = trainer_mod.Trainer.train

    def train(self):  # while training: the lock is held by this process, with its pid in the file
        lock = runs / "a" / ".lock"
        seen["pid"] = lock.read_text().strip()
        fd = os.open(lock, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        return real(self)

    monkeypatch.setattr(trainer_mod.Trainer, "train", train)
    r = runner.invoke(app, _args(data, runs))
    assert r.exit_code == 0, r.output
    assert seen["pid"] == str(os.getpid())
    assert not (runs / "a" / ".lock").exists() and not run_lock._held
    # released: the next run of the same directory (here: --resume) is accepted
    monkeypatch.setattr(trainer_mod.Trainer, "train", real)
    r = runner.invoke(app, _args(data, runs, "--resume", "--set", "train.max_steps=3"))
    assert r.exit_code == 0, r.output


def test_a_lock_file_left_by_a_dead_process_does_not_block(data, tmp_path):
    runs = tmp_path / "runs"
    (runs / "a").mkdir(parents=True)
    (runs / "a" / ".lock").write_text("999999\n")  # no flock on it: its holder is gone
    r = runner.invoke(app, _args(data, runs))
    assert r.exit_code == 0, r.output
    assert (runs / "a" / "checkpoints").is_dir() and not (runs / "a" / ".lock").exists()


def test_a_failed_check_leaves_no_directory_behind(tmp_path):
    runs = tmp_path / "runs"
    r = runner.invoke(app, _args(tmp_path / "nodata", runs))
    assert r.exit_code == 2 and "has no meta.json" in r.output, r.output
    assert not runs.exists()


def test_acquire_refuses_a_live_holder_and_accepts_the_launcher_of_this_rank(tmp_path, monkeypatch):
    run = tmp_path / "r"
    fd = _hold(run, pid=31337)
    try:
        with pytest.raises(run_lock.RunInUseError, match=r"in use by a running dlrmctl \(pid 31337\)"):
            run_lock.acquire(str(run))
        with pytest.raises(run_lock.RunInUseError):
            run_lock.check_not_in_use(str(run))
        monkeypatch.setenv(run_lock.ENV_HOLDER, "31337")  # a rank of the launcher holding it
        assert run_lock.acquire(str(run)) is False
        run_lock.check_not_in_use(str(run))
    finally:
        os.close(fd)
    monkeypatch.delenv(run_lock.ENV_HOLDER)
    assert run_lock.acquire(str(run)) is True and run_lock.holds(str(run))
    run_lock.check_not_in_use(str(run))  # this process's own lock is no obstacle
    run_lock.release(str(run))
    assert not run.exists()
