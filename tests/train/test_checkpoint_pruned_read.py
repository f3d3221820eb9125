"""Issue 23 item 17: a checkpoint that training prunes (keep_last) while evaluate / export / checkpoint
reshard read it was reported as "not a complete checkpoint" (reads as corruption).  Now best / last
are resolved again and read once more, and a fixed step that went is named as pruned."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from dlrmctl import HAS_FBGEMM
from dlrmctl.cli import app
from dlrmctl.train import checkpoint as ckpt

runner = CliRunner()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from dlrmctl.data.synthetic import generate_synthetic

    d = tmp_path_factory.mktemp("pr")
    generate_synthetic(d / "data", rows=1500, seed=5, num_embeddings=[30] * 26)
    r = runner.invoke(app, [
        "train", "configs/demo.yaml", "--set", f"data.path={d / 'data'}", "--set", f"train.run_dir={d / 'runs'}",
        "--set", "name=r", "--set", "train.progress=false", "--set", "data.batch_size=256", "--set", "train.max_steps=4",
        "--set", "train.checkpoint_every=2", "--set", "train.keep_last_checkpoints=1", "--set", "train.keep_best=none",
        "--set", "train.eval_every=0", "--set", "model.compute_kernel=dense"])
    assert r.exit_code == 0, r.output
    return d / "runs" / "r"


def _run(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    return run


def _prune_while_reading(monkeypatch, times: int = 1) -> list[str]:
    """The first ``times`` reads of a checkpoint's .metadata happen while the training run publishes
    the next step and prunes the one being read (what save_checkpoint with keep_last=1 does)."""
    from dlrmctl.train.checkpoint import load as ckpt_load

    real = ckpt_load.read_metadata
    pruned: list[str] = []

    def racing(path, *a, **k):
        if len(pruned) < times:
            meta = ckpt.load_checkpoint_meta(path)
            root = ckpt.checkpoint_root(str(path).rsplit("/checkpoints/", 1)[0])
            name = f"step_{int(meta['step']) + 1:08d}"
            shutil.copytree(path, f"{root}/{name}")
            with open(f"{root}/{name}/meta.json", "w") as f:
                json.dump(dict(meta, step=int(meta["step"]) + 1), f)
            with open(f"{root}/{ckpt.LATEST}", "w") as f:
                f.write(name + "\n")
            shutil.rmtree(path)  # the pruning
            pruned.append(str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(ckpt_load, "read_metadata", racing)  # what reload, layout and reshard call
    return pruned


def _error_line(r, pruned: bool = True) -> str:
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    if pruned:
        assert "not a complete checkpoint" not in r.output and "corrupt" not in r.output, r.output
    lines = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert len(lines) == 1, r.output
    return lines[0]


def test_evaluate_last_reads_the_newer_checkpoint_when_its_choice_is_pruned(trained, tmp_path, monkeypatch):
    run = _run(trained, tmp_path)
    pruned = _prune_while_reading(monkeypatch)
    r = runner.invoke(app, ["evaluate", str(run), "--json", "--checkpoint", "last"])
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    assert len(pruned) == 1 and pruned[0].endswith("step_00000004")
    assert json.loads(r.output.strip().splitlines()[-1])["checkpoint"] == "last (step 5)"


def test_evaluate_of_a_fixed_step_that_is_pruned_says_so(trained, tmp_path, monkeypatch):
    run = _run(trained, tmp_path)
    _prune_while_reading(monkeypatch)
    line = _error_line(runner.invoke(app, ["evaluate", str(run), "--checkpoint", "4"]))
    assert "checkpoint step 4" in line and "removed by the run's pruning (train.keep_last_checkpoints)" in line
    assert "while it was being read" in line and "--checkpoint last" in line


def test_a_second_pruning_during_the_retry_is_named_not_corruption(trained, tmp_path, monkeypatch):
    run = _run(trained, tmp_path)
    pruned = _prune_while_reading(monkeypatch, times=2)
    line = _error_line(runner.invoke(app, ["evaluate", str(run)]))
    assert len(pruned) == 2 and "checkpoint last (step 5)" in line and "removed by the run's pruning" in line
    assert "retry" in line


def test_reshard_of_last_follows_the_pruning(trained, tmp_path, monkeypatch):
    run = _run(trained, tmp_path)
    _prune_while_reading(monkeypatch)
    r = runner.invoke(app, ["checkpoint", "reshard", str(run), "--nproc", "1", "--out", str(tmp_path / "rs")])
    assert r.exit_code == 0 and "resharded step 5 " in r.output, r.output
    # the copy's config.yaml names the source run: the hint says how to resume the copy, not the source
    assert f"--resume --nproc 1 --set name=rs --set train.run_dir={tmp_path}`" in r.output, r.output


@pytest.mark.skipif(not HAS_FBGEMM, reason="export needs fbgemm_gpu")
def test_export_of_last_follows_the_pruning(trained, tmp_path, monkeypatch):
    run = _run(trained, tmp_path)
    _prune_while_reading(monkeypatch)
    r = runner.invoke(app, ["export", str(run), "--fp32", "--out", str(tmp_path / "e")])
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    src = json.loads((tmp_path / "e" / "manifest.json").read_text())["source"]
    assert src["checkpoint"].endswith("step_00000005") and src["checkpoint_choice"] == "last (step 5)"


def test_a_damaged_checkpoint_is_still_reported_as_damaged(trained, tmp_path):
    run = _run(trained, tmp_path)
    (run / "checkpoints" / "step_00000004" / ".metadata").write_bytes(b"garbage")
    line = _error_line(runner.invoke(app, ["evaluate", str(run)]), pruned=False)
    assert "pruning" not in line and ".metadata" in line
