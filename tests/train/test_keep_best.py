"""Issue 14 item 4: train.keep_best (auc | ne | none) keeps the best validation checkpoint as
checkpoints/BEST (never pruned), and --checkpoint best|last|<step> selects it on evaluate, export,
checkpoint reshard and train --resume."""

import json
import os

import pytest
import torch
from typer.testing import CliRunner

from dlrmctl.cli import app
from dlrmctl.train import checkpoint as ckpt

runner = CliRunner()


def cli(*args):
    r = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
    return r


def test_pruning_keeps_the_best_checkpoint(tmp_path):
    run = str(tmp_path)
    ckpt.save_checkpoint(run, 1, {"w": torch.zeros(2)}, keep_last=1, best=True)
    for step in (2, 3, 4):
        ckpt.save_checkpoint(run, step, {"w": torch.full((2,), float(step))}, keep_last=1)
    names = sorted(d for d in os.listdir(os.path.join(run, "checkpoints")) if d.startswith("step_"))
    assert names == ["step_00000001", "step_00000004"]
    assert ckpt.best_checkpoint(run).endswith("step_00000001")
    assert ckpt.latest_checkpoint(run).endswith("step_00000004")
    # a new best moves BEST; the old best is then pruned like any other
    ckpt.save_checkpoint(run, 5, {"w": torch.ones(2)}, keep_last=1, best=True)
    assert sorted(d for d in os.listdir(os.path.join(run, "checkpoints")) if d.startswith("step_")) == ["step_00000005"]


def test_resolve_checkpoint(tmp_path):
    run = str(tmp_path)
    for step in (10, 20, 30):
        ckpt.save_checkpoint(run, step, {"w": torch.zeros(1)}, keep_last=0, best=step == 20)
    assert ckpt.resolve_checkpoint(run, "best") == (os.path.join(run, "checkpoints", "step_00000020"), "best (step 20)")
    assert ckpt.resolve_checkpoint(run, None)[1] == "best (step 20)"  # the default when the run kept one
    assert ckpt.resolve_checkpoint(run, "last")[1] == "last (step 30)"
    assert ckpt.resolve_checkpoint(run, "10")[0].endswith("step_00000010")
    with pytest.raises(ckpt.CheckpointError, match=r"no checkpoint of step 15; it has steps 10, 20 \(best\), 30 \(last\)"):
        ckpt.resolve_checkpoint(run, "15")
    with pytest.raises(ckpt.CheckpointError, match="expected best, last, a step number or a checkpoint name"):
        ckpt.resolve_checkpoint(run, "newest")
    os.remove(os.path.join(run, "checkpoints", "BEST"))
    assert ckpt.resolve_checkpoint(run, None)[1] == "last (step 30)"
    with pytest.raises(ckpt.CheckpointError, match="no best checkpoint.*keep_best: none"):
        ckpt.resolve_checkpoint(run, "best")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from dlrmctl.data.synthetic import generate_synthetic

    d = tmp_path_factory.mktemp("kb")
    generate_synthetic(d, rows=6000, seed=3, num_embeddings=[50] * 26)
    return d


def _train(data, runs, name, *extra):
    r = cli("train", "configs/demo.yaml", "--set", f"data.path={data}", "--set", f"train.run_dir={runs}",
            "--set", f"name={name}", "--set", "train.progress=false", "--set", "data.batch_size=256",
            "--set", "train.eval_every=2", "--set", "train.log_every=1", "--set", "train.max_steps=12",
            "--set", "model.compute_kernel=dense", "--set", "optimizer.dense.lr=0.3", *extra)
    assert r.exit_code == 0, r.output
    return r.output


def _evals(run):
    return [json.loads(x) for x in open(run / "metrics.jsonl") if '"eval"' in x]


@pytest.mark.parametrize("metric", ["auc", "ne"])
def test_the_best_evaluation_is_kept_and_selected_by_default(data, tmp_path, metric):
    out = _train(data, tmp_path, "r", "--set", f"train.keep_best={metric}", "--set", "train.keep_last_checkpoints=1")
    run = tmp_path / "r"
    evals = _evals(run)
    pick = max if metric == "auc" else min
    best = pick(evals, key=lambda e: (e[metric], -e["step"]) if metric == "auc" else (e[metric], e["step"]))
    assert ckpt.best_checkpoint(str(run)).endswith(f"step_{best['step']:08d}")
    assert "kept as checkpoint 'best'" in out and f"at step {best['step']}" in out
    assert ckpt.load_checkpoint_meta(ckpt.best_checkpoint(str(run)))["eval"]["step"] == best["step"]
    # evaluate: the best by default (and --checkpoint best), the final one with --checkpoint last
    for args in ([], ["--checkpoint", "best"]):
        m = json.loads(cli("evaluate", run, "--json", *args).output.strip().splitlines()[-1])
        assert m["auc"] == pytest.approx(best["auc"], abs=1e-6) and m["checkpoint"] == f"best (step {best['step']})"
    last = json.loads(cli("evaluate", run, "--json", "--checkpoint", "last").output.strip().splitlines()[-1])
    assert last["auc"] == pytest.approx(evals[-1]["auc"], abs=1e-6) and last["checkpoint"] == "last (step 12)"
    # keep_last 1 + best: at most two checkpoints on disk
    assert len([d for d in os.listdir(run / "checkpoints") if d.startswith("step_")]) <= 2


def test_keep_best_none_keeps_no_best_and_evaluate_uses_the_last(data, tmp_path):
    _train(data, tmp_path, "n", "--set", "train.keep_best=none")
    run = tmp_path / "n"
    assert ckpt.best_checkpoint(str(run)) is None
    m = json.loads(cli("evaluate", run, "--json").output.strip().splitlines()[-1])
    assert m["checkpoint"] == "last (step 12)"
    r = runner.invoke(app, ["evaluate", str(run), "--checkpoint", "best"])
    assert r.exit_code == 2 and "no best checkpoint" in r.output


def test_resume_export_and_reshard_take_the_chosen_checkpoint(data, tmp_path):
    _train(data, tmp_path, "b", "--set", "train.checkpoint_every=4")
    run = tmp_path / "b"
    best_step = ckpt.load_checkpoint_meta(ckpt.best_checkpoint(str(run)))["step"]
    r = cli("checkpoint", "reshard", run, "--nproc", 1, "--checkpoint", "best", "--out", tmp_path / "rs")
    assert r.exit_code == 0 and f"resharded step {best_step} " in r.output, r.output
    # the copy of the best checkpoint is the new run's BEST too: evaluate / export there keep using it
    rs_best = ckpt.best_checkpoint(str(tmp_path / "rs"))
    assert rs_best is not None and ckpt.load_checkpoint_meta(rs_best)["step"] == best_step
    assert ckpt.load_checkpoint_meta(rs_best)["eval"]["step"] == best_step
    # a copy of the last (not the best) checkpoint has no BEST; training resumed there must not claim
    # that a checkpoint holds the best step it remembers from before the copy
    r = cli("checkpoint", "reshard", run, "--nproc", 1, "--checkpoint", "last", "--out", tmp_path / "rl")
    assert r.exit_code == 0 and ckpt.best_checkpoint(str(tmp_path / "rl")) is None
    if best_step != 12:
        out = _train(data, tmp_path, "rl", "--set", "train.max_steps=13", "--resume")
        assert "kept as checkpoint 'best'" not in out and f"no checkpoint of {tmp_path / 'rl'} holds step" in out, out
    # a reshard of an older kept step (the newest two and BEST are kept; which steps those are
    # depends on where the best evaluation fell) into the same run leaves LATEST on 12
    latest = ckpt.latest_checkpoint(str(run))
    assert latest.endswith("step_00000012")
    older = [s for s, _ in ckpt.list_checkpoints(str(run)) if s < 12]
    assert older, ckpt.list_checkpoints(str(run))
    r = cli("checkpoint", "reshard", run, "--nproc", 1, "--checkpoint", str(older[0]))
    assert r.exit_code == 0 and "LATEST still names" in r.output, r.output
    assert ckpt.latest_checkpoint(str(run)) == latest
    r = runner.invoke(app, ["checkpoint", "reshard", str(run), "--nproc", "1", "--checkpoint", "99"])
    assert r.exit_code == 2 and "no checkpoint of step 99" in r.output
    from dlrmctl import HAS_FBGEMM

    if HAS_FBGEMM:
        r = cli("export", run, "--fp32", "--out", tmp_path / "e")
        assert r.exit_code == 0 and f"checkpoint best (step {best_step})" in r.output, r.output
        src = json.loads((tmp_path / "e" / "manifest.json").read_text())["source"]
        assert src["checkpoint"].endswith(f"step_{best_step:08d}") and src["metrics"]["step"] == best_step
        r = cli("export", run, "--fp32", "--checkpoint", "last", "--out", tmp_path / "e2")
        assert "checkpoint last (step 12)" in r.output
        assert oct((tmp_path / "e").stat().st_mode & 0o777) == oct(0o777 & ~_umask())  # like a run directory
    # --resume --checkpoint best continues from the best step
    r = runner.invoke(app, ["train", "configs/demo.yaml", "--checkpoint", "best"])
    assert r.exit_code == 2 and "needs --resume" in r.output
    _train(data, tmp_path, "b", "--set", "train.checkpoint_every=4", "--set", "train.max_steps=14", "--resume",
           "--checkpoint", "best")
    steps = [json.loads(x)["step"] for x in open(run / "metrics.jsonl") if '"train"' in x]
    # the first run's records past the best step are dropped on --resume; the resumed ones start right after it:
    # every step once
    assert steps == list(range(1, 15)), steps


def _umask():
    m = os.umask(0)
    os.umask(m)
    return m


def test_an_undefined_score_is_never_kept_as_best():
    from dlrmctl.train.evaluator import is_better, is_defined

    nan, one_class, good, better = ({"auc": float("nan"), "ne": float("nan"), "ctr": 0.2},
                                    {"auc": 0.5, "ne": float("nan"), "ctr": 0.0},
                                    {"auc": 0.7, "ne": 0.9, "ctr": 0.2}, {"auc": 0.8, "ne": 0.8, "ctr": 0.2})
    assert not is_defined(nan, "auc") and not is_defined(one_class, "auc") and is_defined(good, "auc")
    for undefined in (nan, one_class):
        assert is_better(good, undefined, "auc") and not is_better(undefined, good, "auc")
    assert is_better(better, good, "auc") and is_better(better, good, "ne") and not is_better(good, better, "ne")


def test_a_run_whose_every_score_is_undefined_says_why_no_best_is_kept(data, tmp_path, monkeypatch):
    """Every val evaluation of one class (AUC 0.5 by convention): the end line said no checkpoint
    held the best step because it was found before this run's checkpoints, which was false."""
    import dlrmctl.train.evaluator as evaluator

    real = evaluator.compute_metrics_from_logits

    def one_class(*a, **k):
        return dict(real(*a, **k), auc=0.5, ctr=0.0)

    monkeypatch.setattr(evaluator, "compute_metrics_from_logits", one_class)
    out = _train(data, tmp_path, "u", "--set", "train.keep_best=auc")
    line = [x for x in out.splitlines() if x.startswith("best val")][0]
    assert line.startswith("best val AUC 0.5000 at step 2 (undefined: every val row has label 0, and AUC needs "
                           "both classes (0.5 is reported by convention); no evaluation of this run had a defined "
                           "score, so no checkpoint is kept as 'best'"), line
    assert ckpt.best_checkpoint(str(tmp_path / "u")) is None
    note = evaluator.undefined_best_note({"auc": float("nan"), "ne": float("nan"), "ctr": 0.3}, "ne", "val")
    assert note is not None and note.startswith(" (undefined: the NE of val is NaN;")
    assert evaluator.undefined_best_note({"auc": 0.7, "ne": 0.9, "ctr": 0.2}, "auc", "val") is None
    # NE on a split of one class: its denominator, the CTR prior's log loss, is 0 (not "NE is NaN")
    note = evaluator.undefined_best_note({"auc": 0.5, "ne": float("nan"), "ctr": 1.0}, "ne", "val")
    assert note is not None and note.startswith(
        " (undefined: every val row has label 1, so the log loss of predicting its CTR (1) is 0 and NE, the log "
        "loss divided by it, has no value; a split with both labels gives one (or train.keep_best: auc | none);"), note


def test_checkpoint_paths_of_another_run_and_odd_steps_are_refused(tmp_path):
    from dlrmctl.train.checkpoint import CheckpointError, resolve_checkpoint

    other = tmp_path / "other" / "checkpoints" / "step_00000010"
    other.mkdir(parents=True)
    (other / "meta.json").write_text("{}")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="not a checkpoint of"):
        resolve_checkpoint(str(tmp_path / "run"), str(other))
    for w in ("+24", "2_4", "-1"):
        with pytest.raises(CheckpointError, match="expected best, last, a step number or a checkpoint name"):
            resolve_checkpoint(str(tmp_path / "run"), w)


def test_reshard_with_a_dangling_best_and_of_an_in_place_copy_of_the_best(data, tmp_path):
    """A BEST naming a removed checkpoint does not fail a reshard of the last one (in place or --out)
    nor the end of a resumed run; a reshard --out of the in-place copy of the best step
    (step_S_wsN, what `--checkpoint S` selects once it exists) marks BEST in the new run."""
    import shutil
    from types import SimpleNamespace

    from dlrmctl.train.checkpoint import Checkpointer

    _train(data, tmp_path, "a", "--set", "train.checkpoint_every=4")
    run = tmp_path / "a"
    best = ckpt.best_checkpoint(str(run))
    best_step = ckpt.load_checkpoint_meta(best)["step"]
    assert cli("checkpoint", "reshard", run, "--nproc", 1, "--checkpoint", "best").exit_code == 0
    r = cli("checkpoint", "reshard", run, "--nproc", 1, "--checkpoint", best_step, "--out", tmp_path / "c")
    assert r.exit_code == 0 and f"step_{best_step:08d}_ws1" in ckpt.load_checkpoint_meta(
        ckpt.latest_checkpoint(str(tmp_path / "c")))["resharded_from"]["checkpoint"], r.output
    assert ckpt.best_checkpoint(str(tmp_path / "c")) is not None
    dangling = tmp_path / "d"
    shutil.copytree(run, dangling)
    for p in (dangling / "checkpoints").iterdir():
        if p.name.startswith(f"step_{best_step:08d}"):
            shutil.rmtree(p)
    if best_step != 12:
        for extra in ([], ["--out", tmp_path / "o"]):
            r = cli("checkpoint", "reshard", dangling, "--nproc", 1, "--checkpoint", "last", *extra)
            assert r.exit_code == 0, r.output
    note = Checkpointer.best_kept_note(SimpleNamespace(run_dir=str(dangling)), best_step)
    assert "unusable" in note and "does not exist" in note
    # the newest step resharded in place becomes the run's LATEST: the output says so (what --resume takes)
    r = cli("checkpoint", "reshard", run, "--nproc", 1)
    new = os.path.basename(ckpt.latest_checkpoint(str(run)))
    assert r.exit_code == 0 and f"LATEST of {run} now names {new}: `train --resume` continues from it" in r.output, r.output
    assert "--out DIR writes the copy to a new run directory" in r.output, r.output


def test_a_step_saved_twice_is_listed_and_selected_by_name(tmp_path):
    """A step saved twice (step_X and step_X.1, e.g. training on after an in-place reshard) is
    told apart by name: the listing names both, and --checkpoint <name> selects either."""
    run = str(tmp_path)
    ckpt.save_checkpoint(run, 5, {"w": torch.zeros(2)}, keep_last=0)
    ckpt.save_checkpoint(run, 8, {"w": torch.ones(2)}, keep_last=0)
    ckpt.save_checkpoint(run, 8, {"w": torch.full((2,), 2.0)}, keep_last=0)
    names = sorted(d for d in os.listdir(os.path.join(run, "checkpoints")) if d.startswith("step_"))
    assert names == ["step_00000005", "step_00000008", "step_00000008.1"]
    for name in names[1:]:
        path, label = ckpt.resolve_checkpoint(run, name)
        assert path.endswith(name) and label == f"step 8 ({name})"
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.resolve_checkpoint(run, "99")
    assert "5, 8 (step_00000008), 8 (step_00000008.1, last)" in str(e.value)
    with pytest.raises(ckpt.CheckpointError, match="no such checkpoint"):
        ckpt.resolve_checkpoint(run, "step_00000009")
