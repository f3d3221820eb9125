"""Issue 23 (group D): ordinary conditions never end in a Python traceback.

CLI-level: every case runs ``python -m dlrmctl.cli ...`` (what the ``dlrmctl`` script runs) in a
subprocess on tiny synthetic data made here, with a bounded time, and checks the exit code, that
stderr holds exactly one ``error: ...`` / ``interrupted ...`` line with the expected words, that
no ``Traceback`` appears anywhere, and what the case leaves on disk (the last good checkpoint
intact, no partial output).  The runs that only prepare a case or show that a run still works
afterwards go in-process (``invoke``): a subprocess would only add a torch import.

Real small file systems, no fault injection in the product: a full disk is a small tmpfs, a
read-only directory a tmpfs remounted read-only (``mount``: root only; skipped with the reason
otherwise).  Interrupts are real SIGINT / SIGTERM sent to the process.

More cases: add a :class:`Case` to :data:`CASES` (argv built by ``setup``, expected exit code and
substring, an optional ``check`` of what is left on disk).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import pytest

from tests.commands.test_cli_e2e import invoke
from tests.conftest import REPO

TIMEOUT_S = 180
#: a tiny, fast training run on the module's data (overrides go after these)
TRAIN = ["--set", "train.progress=false", "--set", "data.batch_size=64", "--set", "model.compute_kernel=dense",
         "--set", "train.log_every=1"]


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _default_sigint() -> None:  # a child of a shell's background job inherits SIGINT ignored
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(argv: list[str], cwd: Path) -> subprocess.Popen:
    """``dlrmctl ARGV`` in a subprocess (stdout / stderr captured)."""
    return subprocess.Popen([sys.executable, "-m", "dlrmctl.cli", *argv], cwd=cwd, env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_default_sigint)


def run(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    p = start(argv, cwd)
    try:
        out, err = p.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"dlrmctl {' '.join(argv)} ran over {TIMEOUT_S} s\n{err[-3000:]}")
    return p.returncode, out, err


def assert_one_line(rc: int, out: str, err: str, code: int, words: str) -> str:
    """Exit code ``code``, exactly one ``error:`` / ``interrupted`` line on stderr holding
    ``words``, and no traceback anywhere; returns that line."""
    assert "Traceback" not in out + err, err[-4000:]
    lines = [x for x in err.splitlines() if x.startswith(("error:", "interrupted"))]
    assert len(lines) == 1, err[-4000:]
    assert rc == code, (rc, err[-4000:])
    assert words in lines[0], lines[0]
    return lines[0]


def mount_tmpfs(path: Path, size: str) -> Path:
    """A fresh tmpfs of ``size`` at ``path`` (unmounted at the end of the test by :func:`mounts`)."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {r.stderr.strip()}")
    _MOUNTED.append(path)
    return path


def remount_ro(path: Path) -> None:
    r = subprocess.run(["mount", "-o", "remount,ro", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot remount read-only: {r.stderr.strip()}")


def fill(path: Path, leave: int) -> None:
    """Fill the file system of ``path`` until ``leave`` bytes are free."""
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    with open(path / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - leave))


_MOUNTED: list[Path] = []


@pytest.fixture(autouse=True)
def mounts():
    yield
    while _MOUNTED:
        subprocess.run(["umount", "-l", str(_MOUNTED.pop())], capture_output=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from dlrmctl.data.synthetic import generate_synthetic

    d = tmp_path_factory.mktemp("nt_data")
    generate_synthetic(d, rows=6000, seed=0, num_embeddings=[40] * 26)
    return d


def train_argv(data: Path, runs: Path, *extra: str, name: str = "r") -> list[str]:
    return ["train", str(REPO / "configs" / "demo.yaml"), "--set", f"data.path={data}", "--set",
            f"train.run_dir={runs}", "--set", f"name={name}", *TRAIN, *extra]


def checkpoints_intact(run: Path, step_name: str | None = None) -> None:
    """LATEST names a complete checkpoint (``step_name`` when given); no partial directory is left."""
    root = run / "checkpoints"
    latest = (root / "LATEST").read_text().strip()
    if step_name is not None:
        assert latest == step_name
    assert (root / latest / "meta.json").is_file()
    assert not glob.glob(str(root / ".step_*.tmp")), os.listdir(root)


@dataclasses.dataclass
class Case:
    """One CLI condition: ``setup(tmp_path, data) -> argv`` prepares the files and returns the
    command; ``check(tmp_path)`` inspects what is left afterwards."""

    id: str
    setup: Callable[[Path, Path], list[str]]
    code: int
    words: str
    check: Optional[Callable[[Path], None]] = None


def _out_is_file(tmp: Path, data: Path) -> list[str]:
    (tmp / "f").write_text("mine")
    return ["preprocess", "synthetic", "--out", str(tmp / "f"), "--rows", "100"]


def _out_under_file(tmp: Path, data: Path) -> list[str]:
    (tmp / "f").write_text("mine")
    return ["preprocess", "synthetic", "--out", str(tmp / "f" / "d"), "--rows", "100"]


def _preprocess_disk_full(tmp: Path, data: Path) -> list[str]:
    mount_tmpfs(tmp / "small", "256k")
    return ["preprocess", "synthetic", "--out", str(tmp / "small" / "d"), "--rows", "20000"]


def _no_partial_shards(tmp: Path) -> None:
    assert not glob.glob(str(tmp / "small" / "d" / "**" / "*.tmp"), recursive=True)


def _preprocess_read_only(tmp: Path, data: Path) -> list[str]:
    mount_tmpfs(tmp / "ro", "1m")
    remount_ro(tmp / "ro")
    return ["preprocess", "synthetic", "--out", str(tmp / "ro" / "d"), "--rows", "100"]


def _run_dir_is_file(tmp: Path, data: Path) -> list[str]:
    (tmp / "runs").write_text("not a directory")
    return train_argv(data, tmp / "runs")


def _run_dir_read_only(tmp: Path, data: Path) -> list[str]:
    runs = mount_tmpfs(tmp / "runs", "8m")
    invoke(*train_argv(data, runs, "--set", "train.max_steps=2"))  # in-process: only the resume is the case
    remount_ro(runs)
    return train_argv(data, runs, "--set", "train.max_steps=4", "--resume")


def _checkpoint_disk_full(tmp: Path, data: Path) -> list[str]:
    runs = mount_tmpfs(tmp / "runs", "4m")
    invoke(*train_argv(data, runs, "--set", "train.max_steps=2"))  # in-process: only the resume is the case
    fill(runs, 24 * 1024)  # logs still fit, the next checkpoint (~60 kB) does not
    return train_argv(data, runs, "--set", "train.max_steps=4", "--resume")


def _checkpoint_kept(tmp: Path) -> None:
    checkpoints_intact(tmp / "runs" / "r", "step_00000002")


CASES = [
    Case("preprocess-out-is-a-file", _out_is_file, 2, "is a file, expected a directory"),
    Case("preprocess-out-under-a-file", _out_under_file, 2, "lies under the file"),
    Case("preprocess-disk-full", _preprocess_disk_full, 2, "no space left on device", _no_partial_shards),
    Case("preprocess-read-only", _preprocess_read_only, 2, "read-only file system"),
    Case("train-run-dir-is-a-file", _run_dir_is_file, 2, "is a file, expected a directory"),
    Case("train-resume-read-only", _run_dir_read_only, 2, "read-only file system"),
    Case("train-checkpoint-disk-full", _checkpoint_disk_full, 2, "no space left on device", _checkpoint_kept),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_one_line_no_traceback(case: Case, tmp_path: Path, data: Path) -> None:
    argv = case.setup(tmp_path, data)
    assert_one_line(*run(argv, tmp_path), case.code, case.words)
    if case.check is not None:
        case.check(tmp_path)


# ----------------------------------------------------------------------------- interrupts


def _wait_for(pred: Callable[[], bool], p: subprocess.Popen, what: str, timeout: float = TIMEOUT_S) -> None:
    t0 = time.monotonic()
    while not pred():
        if p.poll() is not None:
            pytest.fail(f"dlrmctl ended ({p.returncode}) before {what}: {p.stderr.read()[-3000:]}")
        if time.monotonic() - t0 > timeout:
            p.kill()
            pytest.fail(f"no {what} within {timeout} s")
        time.sleep(0.05)


def _interrupt(p: subprocess.Popen, sig: int) -> tuple[int, str, str]:
    p.send_signal(sig)
    try:  # (a checkpoint being written is finished first: tens of seconds on a loaded machine)
        out, err = p.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"still running 150 s after {signal.Signals(sig).name}: {err[-3000:]}")
    return p.returncode, out, err


def _trained(run: Path) -> Callable[[], bool]:
    def pred() -> bool:
        try:
            return '"train"' in (run / "metrics.jsonl").read_text()
        except OSError:
            return False
    return pred


def test_ctrl_c_before_the_first_checkpoint_keeps_the_attempt_and_a_plain_train_starts_over(tmp_path, data):
    runs = tmp_path / "runs"
    p = start(train_argv(data, runs, "--set", "train.epochs=1000"), tmp_path)
    _wait_for(_trained(runs / "r"), p, "a logged training step")
    assert_one_line(*_interrupt(p, signal.SIGINT), 130, "error: interrupted (SIGINT) before the first checkpoint: nothing saved")
    assert (runs / "r" / "config.yaml").is_file()  # the directory did not vanish
    assert not (runs / "r" / "checkpoints").exists()
    invoke(*train_argv(data, runs, "--set", "train.max_steps=2"))  # not refused as "already holds a run"
    checkpoints_intact(runs / "r", "step_00000002")


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), pytest.param(signal.SIGTERM, 143, marks=pytest.mark.slow)],
                         ids=["SIGINT", "SIGTERM"])
def test_interrupt_during_checkpoint_writes_keeps_the_last_good_checkpoint(tmp_path, data, sig, code):
    """A checkpoint every step: most of the run is spent in DCP's writes; the signal arrives in
    one of them or between them, and the run keeps a complete LATEST either way."""
    runs = tmp_path / "runs"
    p = start(train_argv(data, runs, "--set", "train.epochs=1000", "--set", "train.checkpoint_every=1",
                         "--set", "train.keep_last_checkpoints=1"), tmp_path)
    latest = runs / "r" / "checkpoints" / "LATEST"

    def saved_some() -> bool:
        try:
            return int(latest.read_text().strip().split("_")[1]) >= 3
        except (OSError, IndexError, ValueError):
            return False

    _wait_for(saved_some, p, "a third checkpoint")
    line = assert_one_line(*_interrupt(p, sig), code, f"error: interrupted ({signal.Signals(sig).name}): ")
    assert "kept its last checkpoint (step " in line and "--resume" in line, line
    checkpoints_intact(runs / "r")
    step = int((runs / "r" / "checkpoints" / "LATEST").read_text().strip().split("_")[1])
    assert f"(step {step})" in line
    invoke(*train_argv(data, runs, "--set", f"train.max_steps={step + 1}", "--resume"))  # the kept checkpoint loads


def test_ctrl_c_during_preprocess_is_one_line_and_leaves_no_partial_shard(tmp_path):
    out = tmp_path / "d"
    p = start(["preprocess", "synthetic", "--out", str(out), "--rows", "50000000"], tmp_path)
    _wait_for(lambda: bool(glob.glob(str(out / "parts" / "synthetic" / "*.tmp"))), p, "a shard being written")
    assert_one_line(*_interrupt(p, signal.SIGINT), 130, "error: interrupted (SIGINT): `dlrmctl preprocess synthetic`")
    assert not glob.glob(str(out / "**" / "*.tmp"), recursive=True)
    assert not (out / "meta.json").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals")
def test_sigterm_of_a_verb_without_its_own_handling_says_interrupted(tmp_path):
    """SIGTERM of export, predict, reshard, calibrate, evaluate or preprocess synthetic died silently
    (the default action); every verb but train, launch, sweep and serve now ends as on Ctrl-C."""
    from dlrmctl.cli import OWN_SIGTERM

    assert OWN_SIGTERM == {"train", "launch", "sweep", "serve"}
    out = tmp_path / "big"
    p = subprocess.Popen([sys.executable, "-m", "dlrmctl.cli", "preprocess", "synthetic", "--rows", "20000000",
                          "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / ".dlrmctl").exists() and time.monotonic() < deadline:  # past the imports, writing
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, (p.returncode, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: interrupted (SIGTERM): `dlrmctl preprocess synthetic` (--out "), err


@pytest.mark.parametrize("when", ["during the work", "after the dataset was complete"])
def test_an_interrupted_preprocess_says_resume_only_when_the_work_is_unfinished(tmp_path, monkeypatch, when):
    """A signal that lands after the dataset was committed (while the lock is dropped) said the
    preprocess had stopped and should be resumed although it was complete."""
    import dlrmctl.outputs
    from dlrmctl import errors
    from dlrmctl.commands.preprocess import build_interruptible, dataset_target_or_fail

    out = tmp_path / "d"
    target = dataset_target_or_fail(out, {"dataset": "logs", "inputs": []}, False)

    def work(d: Path) -> str:
        (d / "meta.json").write_text("{}")
        if when == "during the work":
            raise errors.Interrupted(signal.SIGINT)
        return "done"

    unlock = dlrmctl.outputs.unlock_output

    def unlock_then_signal(o) -> None:
        unlock(o)
        if when != "during the work":
            raise errors.Interrupted(signal.SIGINT)

    monkeypatch.setattr(dlrmctl.outputs, "unlock_output", unlock_then_signal)
    with pytest.raises(errors.CommandError) as e:
        build_interruptible(target, out, work)
    assert e.value.exit_code == 130
    if when == "during the work":
        assert "stopped" in str(e.value) and "resume it" in str(e.value), e.value
    else:
        assert "had finished: the dataset is complete" in str(e.value) and "resume" not in str(e.value), e.value


@pytest.mark.parametrize("finished", [False, True], ids=["during the export", "after it was in place"])
def test_an_interrupted_export_names_the_run_and_the_target_and_whether_it_finished(tmp_path, monkeypatch, finished):
    """`export RUN --out X` under SIGINT printed a bare `interrupted`: no path, no hint."""
    from typer.testing import CliRunner

    import dlrmctl.inference.export
    from dlrmctl.cli import app

    run, out = tmp_path / "run", tmp_path / "m"
    run.mkdir()
    (run / "config.yaml").write_text("name: r\n")

    def export_then_ctrl_c(*a, **k):
        if finished:  # the artifact renamed into place, the signal before export_run returned
            out.mkdir()
            (out / "manifest.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(dlrmctl.inference.export, "export_run", export_then_ctrl_c)
    r = CliRunner().invoke(app, ["export", str(run), "--fp32", "--out", str(out)])
    assert r.exit_code == 130, r.output
    lines = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert len(lines) == 1, r.output
    if finished:
        assert lines[0] == f"error: interrupted (SIGINT) after the export of {run} had finished: {out} is complete"
    else:
        assert lines[0].startswith(f"error: interrupted (SIGINT): the export of {run} to {out} stopped; an export is "
                                   "renamed into place only when complete"), lines[0]
