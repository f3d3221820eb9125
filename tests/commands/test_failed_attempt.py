"""Issue 14 item 11: a run that fails before it saved a checkpoint leaves nothing that blocks or
mixes into a retry (a --nproc launch: tests/commands/test_launch.py, the failing-rank test)."""

import json

from typer.testing import CliRunner

from dlrmctl.cli import app

runner = CliRunner()


def _args(data, runs, *extra):
    return ["train", "configs/demo.yaml", "--set", f"data.path={data}", "--set", f"train.run_dir={runs}",
            "--set", "name=a", "--set", "train.progress=false", "--set", "data.batch_size=256",
            "--set", "model.compute_kernel=dense", "--set", "train.max_steps=3", "--set", "train.log_every=1", *extra]


def test_a_run_failing_at_step_1_leaves_nothing_and_a_retry_starts_clean(tmp_path, monkeypatch):
    from dlrmctl.data.synthetic import generate_synthetic
    from dlrmctl.errors import UserError
    from dlrmctl.train.trainer import Trainer

    data = tmp_path / "data"
    generate_synthetic(data, rows=2000, seed=0, num_embeddings=[60] * 26)
    runs = tmp_path / "runs"

    def failing_step(self, batch, sparse_ctx, after_forward=None):  # the first batch fails, as bad data would
        raise UserError("step 1: the batch failed")

    with monkeypatch.context() as m:
        m.setattr(Trainer, "run_step", failing_step)
        r = runner.invoke(app, _args(data, runs))
    assert r.exit_code == 2 and "step 1: the batch failed" in r.output and "Traceback" not in r.output, r.output
    assert not (runs / "a").exists()  # config.yaml, data_meta.json and the directory are gone
    # an attempt killed before its first checkpoint (no cleanup ran) left files behind
    (runs / "a").mkdir(parents=True)
    (runs / "a" / "plan.yaml").write_text("kept: the user's, older than the attempt\n")
    import time

    time.sleep(0.05)
    (runs / "a" / ".dlrmctl_attempt").write_text("123\n")  # what a real attempt writes first
    (runs / "a" / "config.yaml").write_text("name: stale\n")
    (runs / "a" / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 99, "loss": 9.0}) + "\n")
    (runs / "a" / "logs").mkdir()
    (runs / "a" / "notes.txt").write_text("mine")  # not dlrmctl's: kept
    r = runner.invoke(app, _args(data, runs))
    assert r.exit_code == 0, r.output
    steps = [json.loads(x)["step"] for x in open(runs / "a" / "metrics.jsonl") if '"train"' in x]
    assert steps == [1, 2, 3]  # the stale record did not mix in
    assert "name: a" in (runs / "a" / "config.yaml").read_text()
    assert (runs / "a" / "logs").is_dir() and (runs / "a" / "notes.txt").read_text() == "mine"
    # a config the user keeps in the run directory is never overwritten or removed
    (tmp_path / "runs" / "b").mkdir()
    (tmp_path / "runs" / "b" / "config.yaml").write_text("# my experiment\nname: b\n")
    r = runner.invoke(app, _args(data, runs, "--set", "name=b"))
    assert r.exit_code == 2 and "was not written by dlrmctl" in r.output
    assert (tmp_path / "runs" / "b" / "config.yaml").read_text().startswith("# my experiment")


def test_a_failed_preprocess_does_not_block_a_rerun_with_other_options(tmp_path):
    """A preprocess that stopped at a bad line left its unfinished dataset, and the re-run with
    --on-bad-line skip (another recipe) was refused as "holds another dataset"."""
    good = "\t".join(["1"] + ["1"] * 13 + ["68fd1e64"] * 26) + "\n"
    src = tmp_path / "a.tsv"
    src.write_text(good * 300 + "1\t2\n" + good * 10)
    out = tmp_path / "o"
    r = runner.invoke(app, ["preprocess", "criteo", "--input", str(src), "--out", str(out), "-q",
                            "--frequency-threshold", "1"])
    assert r.exit_code == 2 and "a.tsv:301" in r.output, r.output
    r = runner.invoke(app, ["preprocess", "criteo", "--input", str(src), "--out", str(out), "-q",
                            "--frequency-threshold", "1", "--on-bad-line", "skip"])
    assert r.exit_code == 0, r.output
    meta = json.loads((out / "meta.json").read_text())
    assert meta["splits"]["train"]["rows"] == 310 and meta["bad_lines_skipped"] == 1
    # a finished dataset of other options is still refused without --force
    r = runner.invoke(app, ["preprocess", "criteo", "--input", str(src), "--out", str(out), "-q",
                            "--num-embeddings", "100", "--on-bad-line", "skip"])
    assert r.exit_code == 2 and "holds another dataset" in r.output, r.output
