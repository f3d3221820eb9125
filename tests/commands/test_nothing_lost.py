"""Issue 23 group B: nothing is deleted or replaced unless it is dlrmctl's and the replacement is
complete; every artifact read is verified against its manifest's hashes; size options refuse < 1.

Each test goes through the CLI (typer's CliRunner) and asserts one error line, no traceback.
"""

import errno
import shutil
import json
import os
import subprocess
import tempfile
import sys

import pytest
import yaml
from typer.testing import CliRunner

from dlrmctl import HAS_FBGEMM
from dlrmctl.cli import app
from tests.conftest import REPO

needs_fbgemm = pytest.mark.skipif(not HAS_FBGEMM, reason="export needs fbgemm_gpu")


def _criteo_lines(path, n=120, seed=0):
    """``n`` raw Criteo lines (label, I1-I13, C1-C26 as 8 hex digits; some fields missing)."""
    import random

    g = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            dense = ["" if g.random() < 0.1 else str(g.randint(0, 50)) for _ in range(13)]
            sparse = ["" if g.random() < 0.1 else f"{g.randint(0, 7) * 0x1111111:08x}" for _ in range(26)]
            f.write("\t".join([str(g.randint(0, 1)), *dense, *sparse]) + "\n")
    return path


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    return _criteo_lines(tmp_path_factory.mktemp("raw") / "day.tsv")


def _cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _one_error(r, *needles):
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output, r.output
    errs = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert len(errs) == 1, r.output
    for n in needles:
        assert n in errs[0], r.output
    return errs[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory, raw):
    """A run trained for one short epoch on 120 raw Criteo lines, and its int8 export."""
    if not HAS_FBGEMM:
        pytest.skip("export needs fbgemm_gpu")
    root = tmp_path_factory.mktemp("lost")
    data = root / "data"
    r = _cli("preprocess", "criteo", "--input", raw, "--out", data, "--frequency-threshold", 2, "--val-ratio", 0.3,
             "-q")
    assert r.exit_code == 0, r.output
    cfg = {
        "name": "tiny",
        "data": {"path": str(data), "batch_size": 16, "eval_batch_size": 64, "prefetch": 0},
        "model": {"embedding_dim": 8, "dense_arch_layer_sizes": [16, 8], "over_arch_layer_sizes": [16, 1]},
        "train": {"epochs": 1, "run_dir": str(root / "runs"), "progress": False, "pipeline": "none", "device": "cpu"},
    }
    (root / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    r = _cli("train", root / "tiny.yaml")
    assert r.exit_code == 0, r.output
    run_dir = root / "runs" / "tiny"
    r = _cli("export", run_dir, "--int8", "--out", root / "m")
    assert r.exit_code == 0, r.output
    return root, data, run_dir, root / "m"


# ----------------------------------------------------------------------------- item 5, 14: export --force
@pytest.mark.slow
@needs_fbgemm
def test_export_force_replaces_only_an_export_of_ours(run, tmp_path, monkeypatch):
    root, data, run_dir, m = run
    notes = tmp_path / "syncopy"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    _one_error(_cli("export", run_dir, "--int8", "--out", notes, "--force"), str(notes), "not a dlrmctl export")
    assert (notes / "todo.txt").read_text() == "mine"
    _one_error(_cli("export", run_dir, "--int8", "--out", data, "--force"), "dlrmctl dataset")
    assert (data / "meta.json").is_file()
    monkeypatch.chdir(tmp_path)  # the working directory, even when it is an export, is never replaced
    r = _cli("export", run_dir, "--int8", "--out", tmp_path / "e")
    assert r.exit_code == 0, r.output
    monkeypatch.chdir(tmp_path / "e")
    _one_error(_cli("export", run_dir, "--int8", "--out", ".", "--force"), "working directory")
    _one_error(_cli("export", run_dir, "--int8", "--out", "..", "--force"), "holds the working directory")
    monkeypatch.chdir(tmp_path)
    r = _cli("export", run_dir, "--fp16", "--out", tmp_path / "e", "--force")  # an export of ours: replaced
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "e" / "manifest.json").read_text())["quantization"]["embeddings"] == "fp16"
    assert json.loads((tmp_path / "e" / ".dlrmctl").read_text())["kind"] == "export"
    assert sorted(os.listdir(tmp_path)) == ["e", "syncopy"]


# ----------------------------------------------------------------------------- item 14: disk full, read-only
@needs_fbgemm
def test_export_disk_full_or_read_only_is_one_line_and_keeps_the_old_export(run, tmp_path, monkeypatch):
    import dlrmctl.inference.artifact as files

    root, data, run_dir, m = run
    out = tmp_path / "m"
    assert _cli("export", run_dir, "--int8", "--out", out).exit_code == 0
    before = (out / "model.pt2").read_bytes()
    real = files.write_bytes

    def full(path, data):
        real(path, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(files, "write_bytes", full)
    _one_error(_cli("export", run_dir, "--int4", "--out", out, "--force"), "disk is full", "model.pt")
    assert (out / "model.pt2").read_bytes() == before  # the last good export is intact
    assert sorted(os.listdir(tmp_path)) == ["m"]  # no temporary left behind
    monkeypatch.setattr(files, "write_bytes", real)

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system", str(run_dir))

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    _one_error(_cli("export", run_dir, "--int8", "--force"), "read-only", "--out a writable directory")


# ----------------------------------------------------------------------------- item 13: stale temporaries
@needs_fbgemm
def test_export_reclaims_temporaries_of_killed_exports_only(run, tmp_path):
    from dlrmctl import outputs

    root, data, run_dir, m = run
    out = tmp_path / "m"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / ".m.tmp-killed"
    stale.mkdir()
    outputs.write_marker(stale, "export", temp=True, pid=int(dead.stdout), host=__import__("socket").gethostname())
    (stale / "model.pt").write_bytes(b"x" * 1000)
    legacy = tmp_path / ".m.tmp-old"  # made by a dlrmctl before the marker, untouched for a day
    (legacy / "vocab").mkdir(parents=True)
    os.utime(legacy, (0, 0))
    live = tmp_path / ".m.tmp-live"
    live.mkdir()
    outputs.write_marker(live, "export", temp=True, pid=os.getpid(), host=__import__("socket").gethostname())
    foreign = tmp_path / ".m.tmp-notes"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("x")
    os.utime(foreign, (0, 0))
    r = _cli("export", run_dir, "--int8", "--out", out)
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    assert not stale.exists() and not legacy.exists()
    assert live.exists() and (foreign / "mine.txt").exists()  # in use, or not ours: kept


# ----------------------------------------------------------------------------- item 8: verified reads
@needs_fbgemm
def test_a_damaged_model_file_is_refused_naming_both_hashes(run, raw, tmp_path):
    root, data, run_dir, m = run
    bad = tmp_path / "m"
    assert _cli("export", run_dir, "--int8", "--out", bad).exit_code == 0
    blob = bytearray((bad / "model.pt2").read_bytes())
    for i in range(len(blob) // 2, len(blob) // 2 + 64):
        blob[i] ^= 0xFF  # same size: the size check does not see it
    (bad / "model.pt2").write_bytes(bytes(blob))
    want = json.loads((bad / "manifest.json").read_text())["model_sha256"]
    line = _one_error(_cli("predict", bad, "--input", raw, "--output", tmp_path / "s.csv"), "model.pt", want,
                      "export the run again")
    assert "SHA-256" in line
    assert not (tmp_path / "s.csv").exists()
    _one_error(_cli("evaluate", bad, "--data", data), want)


# ----------------------------------------------------------------------------- item 9: sizes < 1
@needs_fbgemm
def test_sizes_below_one_are_refused(run, raw, tmp_path):
    root, data, run_dir, m = run
    for v in (-1, 0):
        _one_error(_cli("predict", m, "--input", raw, "--output", tmp_path / "s.csv", "--batch-rows", v),
                   "--batch-rows must be >= 1")
        _one_error(_cli("evaluate", m, "--data", data, "--batch-size", v), "--batch-size must be a finite number > 0")
    assert not (tmp_path / "s.csv").exists()


# ----------------------------------------------------------------------------- item 6: preprocess
def test_preprocess_refuses_another_dataset_and_force_swaps_it_in(tmp_path):
    d = tmp_path / "data"
    r = _cli("preprocess", "synthetic", "--out", d, "--rows", 2000, "--num-embeddings", 30)
    assert r.exit_code == 0, r.output
    meta = (d / "meta.json").read_text()
    _one_error(_cli("preprocess", "synthetic", "--out", d, "--rows", 100, "--num-embeddings", 30),
               str(d), "another dataset", "--force")
    assert (d / "meta.json").read_text() == meta  # 2000 rows still
    r = _cli("preprocess", "synthetic", "--out", d, "--rows", 2000, "--num-embeddings", 30)
    assert r.exit_code == 0 and "already complete" in r.output and "0 rows/s" not in r.output, r.output
    stamp = (d / "meta.json").stat().st_mtime_ns
    r = _cli("preprocess", "synthetic", "--out", d, "--rows", 2000, "--num-embeddings", 30, "--force")
    assert r.exit_code == 0 and "already complete" not in r.output, r.output  # --force rebuilds the same recipe
    assert (d / "meta.json").stat().st_mtime_ns != stamp and sorted(os.listdir(tmp_path)) == ["data"]
    r = _cli("preprocess", "synthetic", "--out", d, "--rows", 100, "--num-embeddings", 30, "--force")
    assert r.exit_code == 0, r.output
    assert sum(s["rows"] for s in json.loads((d / "meta.json").read_text())["splits"].values()) == 100
    assert sorted(os.listdir(tmp_path)) == ["data"]  # built beside it, swapped in, old one deleted
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "a.txt").write_text("mine")
    _one_error(_cli("preprocess", "synthetic", "--out", notes, "--rows", 100, "--force"), "not a dlrmctl dataset")
    assert os.listdir(notes) == ["a.txt"]


def test_preprocess_force_that_fails_keeps_the_old_dataset(tmp_path, monkeypatch):
    import dlrmctl.data.synthetic as syn

    d = tmp_path / "data"
    assert _cli("preprocess", "synthetic", "--out", d, "--rows", 500).exit_code == 0
    meta = (d / "meta.json").read_text()

    def boom(out, **k):
        (out / "parts").mkdir()
        raise ValueError("--rows: simulated failure half-way")

    monkeypatch.setattr(syn, "generate_synthetic", boom)
    r = _cli("preprocess", "synthetic", "--out", d, "--rows", 100, "--force")
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert (d / "meta.json").read_text() == meta
    assert sorted(os.listdir(tmp_path)) == ["data"]


def test_criteo_rerun_says_already_complete(tmp_path, raw):
    d = tmp_path / "c"
    assert _cli("preprocess", "criteo", "--input", raw, "--out", d, "--num-embeddings", 50, "-q").exit_code == 0
    r = _cli("preprocess", "criteo", "--input", raw, "--out", d, "--num-embeddings", 50, "-q")
    assert r.exit_code == 0 and "already complete" in r.output and "rows/s" not in r.output, r.output
    _one_error(_cli("preprocess", "criteo", "--input", raw, "--out", d, "--num-embeddings", 40, "-q"),
               "another dataset", raw.name)


# ----------------------------------------------------------------------------- item 7: train --overwrite
def _train_args(data, runs, *extra):
    return ["train", "configs/demo.yaml", "--set", f"data.path={data}", "--set", f"train.run_dir={runs}",
            "--set", "name=a", "--set", "train.progress=false", "--set", "data.batch_size=256",
            "--set", "model.compute_kernel=dense", "--set", "train.max_steps=3", "--set", "train.log_every=1", *extra]


def _snapshot(d):
    return {os.path.relpath(os.path.join(p, f), d): open(os.path.join(p, f), "rb").read()
            for p, _, fs in os.walk(d) for f in fs if f != ".lock"}


def test_train_overwrite_keeps_the_old_run_until_the_new_one_has_a_checkpoint(tmp_path, monkeypatch):
    from dlrmctl.data.synthetic import generate_synthetic
    from dlrmctl.train.run_dir import REPLACED_DIR, set_aside

    data = tmp_path / "data"
    generate_synthetic(data, rows=2000, seed=0, num_embeddings=[60] * 26)
    runs = tmp_path / "runs"
    r = CliRunner().invoke(app, _train_args(data, runs))
    assert r.exit_code == 0, r.output
    old = _snapshot(runs / "a")
    assert any(k.startswith("checkpoints") for k in old)
    # a replacement failing at its first batch (as bad data would): the old run is as it was
    from dlrmctl.errors import UserError
    from dlrmctl.train.trainer import Trainer

    def failing_step(self, batch, sparse_ctx, after_forward=None):
        raise UserError("step 1: the batch failed")

    with monkeypatch.context() as m:
        m.setattr(Trainer, "run_step", failing_step)
        r = CliRunner().invoke(app, _train_args(data, runs, "--overwrite"))
    assert r.exit_code == 2 and "step 1: the batch failed" in r.output and "Traceback" not in r.output, r.output
    assert _snapshot(runs / "a") == old
    # a replacement killed after it set the old run aside (no cleanup ran): the next train restores it
    set_aside(str(runs / "a"))
    assert (runs / "a" / REPLACED_DIR).is_dir()
    r = CliRunner().invoke(app, _train_args(data, runs, "--resume", "--set", "train.max_steps=4"))
    assert r.exit_code == 0, r.output
    steps = [json.loads(x)["step"] for x in open(runs / "a" / "metrics.jsonl") if '"train"' in x]
    assert steps == [1, 2, 3, 4]  # the old run came back and was continued
    # a replacement that succeeds: the old run is gone, nothing set aside is left
    r = CliRunner().invoke(app, _train_args(data, runs, "--overwrite", "--set", "train.max_steps=2"))
    assert r.exit_code == 0, r.output
    assert not (runs / "a" / REPLACED_DIR).exists()
    steps = [json.loads(x)["step"] for x in open(runs / "a" / "metrics.jsonl") if '"train"' in x]
    assert steps == [1, 2]
    # --overwrite of a directory that is not a dlrmctl run is refused, nothing removed
    (runs / "b").mkdir()
    (runs / "b" / "notes.txt").write_text("mine")
    (runs / "b" / "checkpoints").mkdir()
    _one_error(CliRunner().invoke(app, _train_args(data, runs, "--overwrite", "--set", "name=b")),
               "not a dlrmctl run")
    assert (runs / "b" / "notes.txt").read_text() == "mine"


def test_a_killed_overwrite_never_lets_a_plain_train_mix_two_runs(tmp_path):
    """After an --overwrite killed before its first checkpoint, a plain `train` passed the "already
    holds a run" check (the old run was still set aside), then the old run came back and the new one
    trained into it: old and new checkpoints side by side, metrics appended."""
    from dlrmctl.data.synthetic import generate_synthetic
    from dlrmctl.train.run_dir import REPLACED_DIR, set_aside

    data = tmp_path / "data"
    generate_synthetic(data, rows=2000, seed=0, num_embeddings=[60] * 26)
    runs = tmp_path / "runs"
    assert CliRunner().invoke(app, _train_args(data, runs)).exit_code == 0
    old = _snapshot(runs / "a")
    set_aside(str(runs / "a"))  # the --overwrite attempt, SIGKILLed before anything else happened
    (runs / "a" / "logs").mkdir()
    (runs / "a" / "logs" / "attempt.log").write_text("the killed attempt's record")
    _one_error(CliRunner().invoke(app, _train_args(data, runs, "--set", "train.max_steps=2")), "already holds a run")
    assert not (runs / "a" / REPLACED_DIR).exists()
    now = _snapshot(runs / "a")
    assert now.pop(os.path.join("logs", "attempt.log")) == b"the killed attempt's record"  # kept, beside the old run
    assert now == old


def test_an_overwrite_killed_while_moving_the_old_run_loses_none_of_it(tmp_path):
    """A kill inside set_aside's (or the restore's) rename loop left part of the old run in place: the
    next train took the old checkpoints still there for the new run's and deleted the rest of the old
    run with the set-aside directory."""
    from dlrmctl.data.synthetic import generate_synthetic
    from dlrmctl.train.run_dir import REPLACED_DIR, RESTORING, set_aside

    data = tmp_path / "data"
    generate_synthetic(data, rows=2000, seed=0, num_embeddings=[60] * 26)
    runs = tmp_path / "runs"
    assert CliRunner().invoke(app, _train_args(data, runs)).exit_code == 0
    run = runs / "a"
    old = _snapshot(run)
    # killed in set_aside after two of its renames: checkpoints/ still in place, no "complete" mark
    (run / REPLACED_DIR).mkdir()
    for n in ("metrics.jsonl", "config.yaml"):
        os.rename(run / n, run / REPLACED_DIR / n)
    _one_error(CliRunner().invoke(app, _train_args(data, runs)), "already holds a run")
    assert _snapshot(run) == old and not (run / REPLACED_DIR).exists()
    # killed in the restore after it moved checkpoints/ back but before the rest
    set_aside(str(run))
    (run / REPLACED_DIR / RESTORING).write_text("")
    os.rename(run / REPLACED_DIR / "checkpoints", run / "checkpoints")
    _one_error(CliRunner().invoke(app, _train_args(data, runs)), "already holds a run")
    assert _snapshot(run) == old and not (run / REPLACED_DIR).exists()


def test_overwrite_replaces_only_what_a_run_writes(tmp_path):
    """--overwrite set aside, then deleted, everything in the run directory: the user's notes and an
    export written into it (the default place of `dlrmctl export RUN`) went with the old run."""
    from dlrmctl.data.synthetic import generate_synthetic
    from dlrmctl.train.run_dir import clear_unsaved_attempt, set_aside

    data = tmp_path / "data"
    generate_synthetic(data, rows=2000, seed=0, num_embeddings=[60] * 26)
    runs = tmp_path / "runs"
    assert CliRunner().invoke(app, _train_args(data, runs)).exit_code == 0
    (runs / "a" / "notes.txt").write_text("mine")
    (runs / "a" / "export-int8").mkdir()
    (runs / "a" / "export-int8" / "model.pt2").write_bytes(b"x")
    r = CliRunner().invoke(app, _train_args(data, runs, "--overwrite", "--set", "train.max_steps=2"))
    assert r.exit_code == 0, r.output
    assert (runs / "a" / "notes.txt").read_text() == "mine"
    assert (runs / "a" / "export-int8" / "model.pt2").read_bytes() == b"x"
    steps = [json.loads(x)["step"] for x in open(runs / "a" / "metrics.jsonl") if '"train"' in x]
    assert steps == [1, 2]
    # a failed replacement gives the old run back and leaves the user's files as they were
    set_aside(str(runs / "a"))
    (runs / "a" / "config.yaml").write_text("the attempt's")
    assert clear_unsaved_attempt(str(runs / "a"))
    assert (runs / "a" / "notes.txt").read_text() == "mine" and (runs / "a" / "export-int8").is_dir()
    assert (runs / "a" / "config.yaml").read_text() != "the attempt's"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_train_nproc_overwrite_replaces_the_run_and_keeps_the_jobs_logs(tmp_path):
    """`train --nproc 2 --overwrite` of an existing run: the launcher set the old run aside, then rank 0
    set the run directory up again, which gave the old run back (its checkpoints mixed into the new
    run's) and deleted the job's log directory under torchx: the run ended in `error: [Errno 2] No such
    file or directory: '.../logs/dlrmctl/<app>/SUCCESS'` after training."""
    from dlrmctl.data.synthetic import generate_synthetic
    from dlrmctl.train.run_dir import REPLACED_DIR

    data = tmp_path / "data"
    generate_synthetic(data, rows=2000, seed=0, num_embeddings=[60] * 26)
    runs = tmp_path / "runs"
    r = CliRunner().invoke(app, _train_args(data, runs, "--set", "train.max_steps=5"))
    assert r.exit_code == 0, r.output
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-m", "dlrmctl.cli", *_train_args(data, runs, "--overwrite", "--nproc", "2",
                                                                         "--set", "train.max_steps=2")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "error" not in p.stderr, p.stdout + p.stderr
    run = runs / "a"
    assert not (run / REPLACED_DIR).exists()
    steps = [json.loads(x)["step"] for x in open(run / "metrics.jsonl") if '"train"' in x]
    assert steps == [1, 2]  # the new run's, not the old run's five
    ckpts = sorted(n for n in os.listdir(run / "checkpoints") if n.startswith("step"))
    assert ckpts and all(int(n.split("_")[-1]) <= 2 for n in ckpts), ckpts
    assert list((run / "logs").rglob("SUCCESS")), "the job's torchx logs are gone"


# ------------------------------------------------- breaker trial: other outputs that replaced what is not ours
@needs_fbgemm
def test_a_manifest_pointing_at_an_unhashed_model_file_is_refused(run, raw, tmp_path):
    """A manifest whose model_file is not one of the files it hashes (an edited manifest pointing at
    other weights) was loaded and scored silently."""
    root, data, run_dir, m = run
    d = tmp_path / "m"
    assert _cli("export", run_dir, "--int8", "--out", d).exit_code == 0
    shutil.copy(d / "model.pt2", d / "other.pt2")
    man = json.loads((d / "manifest.json").read_text())
    man["model_file"] = "other.pt2"
    (d / "manifest.json").write_text(json.dumps(man))
    _one_error(_cli("predict", d, "--input", raw, "--output", tmp_path / "s.csv"), "model_file", "other.pt2",
               "export the run again")
    assert not (tmp_path / "s.csv").exists()


@needs_fbgemm
def test_predict_output_never_replaces_a_file_without_force_nor_its_input_or_model(run, raw, tmp_path):
    root, data, run_dir, m = run
    inp = tmp_path / "in.tsv"
    shutil.copy(raw, inp)
    before = inp.read_bytes()
    _one_error(_cli("predict", m, "--input", inp, "--output", inp, "--force"), "is the input")
    _one_error(_cli("predict", m, "--input", inp, "--output", m / "model.pt2", "--force"), "inside the exported model")
    assert inp.read_bytes() == before
    notes = tmp_path / "notes.csv"
    notes.write_text("mine\n")
    _one_error(_cli("predict", m, "--input", inp, "--output", notes, "--force"), "is not a scores CSV")
    assert notes.read_text() == "mine\n"
    scores = tmp_path / "scores.csv"
    assert _cli("predict", m, "--input", inp, "--output", scores).exit_code == 0
    _one_error(_cli("predict", m, "--input", inp, "--output", scores), "exists", "pass --force")
    assert _cli("predict", m, "--input", inp, "--output", scores, "--force").exit_code == 0
    assert scores.read_text().startswith("row,")
    assert sorted(os.listdir(tmp_path)) == ["in.tsv", "notes.csv", "scores.csv"]  # no temporary left


def test_train_never_moves_into_a_directory_of_other_files(tmp_path):
    """`train` used to make any existing directory a run (and `--overwrite` then deleted the user's files)."""
    from dlrmctl.data.synthetic import generate_synthetic

    data = tmp_path / "data"
    generate_synthetic(data, rows=600, seed=0, num_embeddings=[20] * 26)
    runs = tmp_path / "runs"
    (runs / "a").mkdir(parents=True)
    (runs / "a" / "keep.txt").write_text("mine")
    for extra in ([], ["--overwrite"]):
        _one_error(_cli(*_train_args(data, runs, *extra)), "is not a dlrmctl run directory", "keep.txt")
    assert sorted(os.listdir(runs / "a")) == ["keep.txt"] and (runs / "a" / "keep.txt").read_text() == "mine"


def test_reshard_out_never_writes_into_a_directory_that_holds_anything(tmp_path):
    from dlrmctl.data.synthetic import generate_synthetic

    data = tmp_path / "data"
    generate_synthetic(data, rows=600, seed=0, num_embeddings=[20] * 26)
    runs = tmp_path / "runs"
    assert _cli(*_train_args(data, runs)).exit_code == 0
    other = tmp_path / "mine"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    _one_error(_cli("checkpoint", "reshard", runs / "a", "--nproc", 1, "--out", other), "exists and is not empty")
    assert os.listdir(other) == ["keep.txt"]


def test_a_run_set_aside_by_a_killed_overwrite_is_named_by_evaluate_inspect_and_report(tmp_path):
    """A `train --overwrite` killed before its first checkpoint hides the old run in .dlrmctl_replaced
    until the next train: evaluate, checkpoint inspect and report say so instead of only "no checkpoint"."""
    run = tmp_path / "r"
    (run / ".dlrmctl_replaced" / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("name: r\n")
    (run / ".dlrmctl_attempt").write_text("1\n")
    for args in (["evaluate", run], ["checkpoint", "inspect", run], ["report", run]):
        _one_error(_cli(*args), str(run / ".dlrmctl_replaced"), "interrupted `train --overwrite`", "puts it back")
