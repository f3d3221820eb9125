"""End to end through the CLI: preprocess -> train -> evaluate (synthetic and real Criteo)."""

import json

import pytest
from typer.testing import CliRunner

from dlrmctl.cli import app
from tests.conftest import CRITEO_10K, require_shared

runner = CliRunner()


def invoke(*args):
    r = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.output


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module")
def synthetic_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("synthetic")
    invoke("preprocess", "synthetic", "--out", d, "--rows", 20000, "--seed", 1)
    return d


def _train_args(data, runs, name, *extra):
    return ["train", "configs/demo.yaml", "--set", f"data.path={data}", "--set", f"train.run_dir={runs}",
            "--set", f"name={name}", "--set", "train.progress=false", "--set", "data.batch_size=512", *extra]


def test_synthetic_preprocess_train_evaluate_reports_the_same_metrics(synthetic_dir, tmp_path):
    out = invoke(*_train_args(synthetic_dir, tmp_path, "e2e"))
    assert "AUC" in out
    summary = json.load(open(tmp_path / "e2e" / "summary.json"))
    ev = invoke("evaluate", tmp_path / "e2e", "--split", "val", "--json")
    m = json.loads(ev.strip().splitlines()[-1])
    assert m["auc"] == pytest.approx(summary["final"]["auc"], abs=1e-6)
    assert m["logloss"] == pytest.approx(summary["final"]["logloss"], abs=1e-6)
    assert m["auc"] > 0.6  # the planted signal is learnable
    evals = [r for r in read_jsonl(tmp_path / "e2e" / "metrics.jsonl") if r["kind"] == "eval"]
    assert evals and evals[-1]["num_samples"] == json.load(open(synthetic_dir / "meta.json"))["splits"]["val"]["rows"]


def test_resume_gives_the_same_per_step_losses_as_an_uninterrupted_run(synthetic_dir, tmp_path):
    common = ["--set", "train.log_every=1", "--set", "train.checkpoint_every=5"]
    invoke(*_train_args(synthetic_dir, tmp_path, "straight", *common, "--set", "train.max_steps=14"))
    invoke(*_train_args(synthetic_dir, tmp_path, "resumed", *common, "--set", "train.max_steps=7"))
    # the interrupted run saved at step 5 and (final) 7; resume from 7 and continue to 14
    invoke(*_train_args(synthetic_dir, tmp_path, "resumed", *common, "--set", "train.max_steps=14"), "--resume")
    straight = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "straight" / "metrics.jsonl") if r["kind"] == "train"}
    resumed = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "resumed" / "metrics.jsonl") if r["kind"] == "train"}
    assert sorted(straight) == list(range(1, 15))
    for step in range(8, 15):
        assert resumed[step] == straight[step], step
    # resuming the finished run: a plain line says so, nothing is trained (exit 0), the metrics stay as they were
    out = invoke(*_train_args(synthetic_dir, tmp_path, "resumed", *common, "--set", "train.max_steps=14"), "--resume")
    assert f"resumed from {tmp_path / 'resumed' / 'checkpoints'}" in out and "(step 14," in out, out
    assert "the run had already finished at step 14: nothing to train" in out and "INFO" not in out, out
    again = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "resumed" / "metrics.jsonl") if r["kind"] == "train"}
    assert again == resumed


def test_existing_run_directory_is_not_clobbered(synthetic_dir, tmp_path):
    invoke(*_train_args(synthetic_dir, tmp_path, "once", "--set", "train.max_steps=2"))
    r = runner.invoke(app, _train_args(synthetic_dir, tmp_path, "once", "--set", "train.max_steps=2"))
    assert r.exit_code == 2 and "already holds a run" in r.output


def test_missing_data_is_a_clear_error(tmp_path):
    r = runner.invoke(app, _train_args(tmp_path / "nodata", tmp_path, "x"))
    assert r.exit_code == 2 and "has no meta.json" in r.output and "dlrmctl preprocess" in r.output


def test_bad_override_is_a_clear_error(tmp_path):
    r = runner.invoke(app, ["train", "configs/demo.yaml", "--set", "model.embedding_dim=abc"])
    assert r.exit_code == 2 and "model.embedding_dim: expected int | 'auto', got 'abc'" in r.output


@pytest.mark.slow
def test_real_criteo_sample_preprocess_train_evaluate(tmp_path):
    tsv = require_shared(CRITEO_10K)
    data = tmp_path / "data" / "criteo_sample"  # not the run directory: a run never moves into a dataset
    invoke("preprocess", "criteo", "--input", tsv, "--out", data, "--val-ratio", 0.2)
    invoke("train", "configs/criteo_sample.yaml", "--set", f"data.path={data}", "--set", f"train.run_dir={tmp_path}",
           "--set", "train.progress=false", "--set", "train.epochs=1")
    summary = json.load(open(tmp_path / "criteo_sample" / "summary.json"))
    # evaluate uses the best checkpoint (train.keep_best: auc), --checkpoint last the end of the epoch
    m = json.loads(invoke("evaluate", tmp_path / "criteo_sample", "--split", "val", "--json").strip().splitlines()[-1])
    assert m["auc"] == pytest.approx(summary["best"]["auc"], abs=1e-6)
    assert m["checkpoint"] == f"best (step {summary['best']['step']})"
    last = json.loads(invoke("evaluate", tmp_path / "criteo_sample", "--checkpoint", "last",
                             "--json").strip().splitlines()[-1])
    assert last["auc"] == pytest.approx(summary["final"]["auc"], abs=1e-6)
    assert summary["best"]["auc"] >= summary["final"]["auc"]
    assert m["num_samples"] == json.load(open(data / "meta.json"))["splits"]["val"]["rows"]
    assert m["auc"] > 0.70


def test_single_process_train_prints_the_model_size_line(synthetic_dir, tmp_path):
    """Issue 23: `dlrmctl train` in one process prints the line a sharded run's rank 0 prints too:
    total parameters, embeddings (rows x dim over the tables) vs dense, and their weight bytes."""
    import re

    from dlrmctl.config import load_config, read_data_meta, resolve_tables
    from dlrmctl.train.factory import build_model

    out = invoke(*_train_args(synthetic_dir, tmp_path, "size", "--set", "train.max_steps=2"))
    assert "Traceback" not in out
    line = next((ln for ln in out.splitlines() if ln.startswith("model: ")), None)
    assert line is not None, out
    cfg = load_config("configs/demo.yaml", [f"data.path={synthetic_dir}"])
    meta = read_data_meta(cfg)
    tables = resolve_tables(cfg, meta)
    model = build_model(cfg, tables, len(meta["dense_features"]))
    emb = sum(t.num_embeddings * t.embedding_dim for t in tables)
    dense = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("sparse_arch."))
    assert emb > 0 and dense > 0
    m = re.match(r"model: ([\d,]+) parameters, ([\d.]+) MB of weights: embeddings ([\d,]+) \((\d+) tables, "
                 r"([\d.]+) MB fp32\), dense ([\d,]+) \(([\d.]+) MB fp32\)$", line)
    assert m, line
    n = [int(g.replace(",", "")) for g in (m[1], m[3], m[6])]
    assert n == [emb + dense, emb, dense] and int(m[4]) == len(tables), line
    assert float(m[2]) == pytest.approx(4 * (emb + dense) / 1e6, abs=0.006) and float(m[5]) == pytest.approx(4 * emb / 1e6, abs=0.006)


def test_train_tensorboard_true_writes_scalars_and_without_the_package_is_one_error_line(synthetic_dir, tmp_path,
                                                                                        monkeypatch):
    """Issue 23: `train.tensorboard: true` writes every metrics.jsonl record as scalars through
    torch.utils.tensorboard's SummaryWriter (here a recording stand-in: the package is optional);
    without the package the run is refused before anything is written (one line, exit 2)."""
    import sys
    import types

    import torch.utils

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` fails, as when not installed
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    if hasattr(torch.utils, "tensorboard"):
        monkeypatch.delattr(torch.utils, "tensorboard")
    r = runner.invoke(app, _train_args(synthetic_dir, tmp_path, "tb_missing", "--set", "train.max_steps=2",
                                       "--set", "train.tensorboard=true"))
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert r.output.startswith("error: train.tensorboard: true") and "pip install tensorboard" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "tb_missing").exists()

    calls = []

    class Writer:
        def __init__(self, log_dir):
            calls.append(("init", log_dir))

        def add_scalar(self, tag, value, step):
            calls.append((tag, value, step))

        def close(self):
            calls.append(("close",))

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    out = invoke(*_train_args(synthetic_dir, tmp_path, "tb", "--set", "train.max_steps=4", "--set", "train.log_every=2",
                              "--set", "train.tensorboard=true"))
    assert "Traceback" not in out
    assert calls[0] == ("init", str(tmp_path / "tb" / "tensorboard")) and calls[-1] == ("close",)
    recs = read_jsonl(tmp_path / "tb" / "metrics.jsonl")
    losses = {r["step"]: r["loss"] for r in recs if r["kind"] == "train"}
    assert losses and {(c[0], c[2]): c[1] for c in calls if len(c) == 3 and c[0] == "train/loss"} == \
        {("train/loss", s): v for s, v in losses.items()}
    ev = [r for r in recs if r["kind"] == "eval"][-1]
    assert ("eval_val/auc", ev["auc"], ev["step"]) in calls and ("eval_val/logloss", ev["logloss"], ev["step"]) in calls
    calls.clear()
    invoke(*_train_args(synthetic_dir, tmp_path, "tb_off", "--set", "train.max_steps=2", "--set", "train.tensorboard=false"))
    assert calls == []
