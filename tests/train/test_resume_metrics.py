"""After an interrupt, ``--resume`` drops the metrics.jsonl records an attempt logged past its
last kept checkpoint (and a line torn by the kill) before logging those steps again: every step
appears once in metrics.jsonl and in ``report``."""

from __future__ import annotations

import json
from collections import Counter

import yaml
from typer.testing import CliRunner

from dlrmctl.cli import app
from tests.conftest import tiny_synthetic


def test_resume_logs_each_step_once(tmp_path_factory, tmp_path):
    data = tiny_synthetic(tmp_path_factory, "resume_metrics", rows=1200)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"name": "r", "data": {"path": data, "batch_size": 64, "prefetch": 0},
                                   "train": {"run_dir": str(tmp_path / "runs"), "max_steps": 4, "log_every": 1,
                                             "eval_every": 2, "checkpoint_every": 2, "progress": False}}))
    r = CliRunner().invoke(app, ["train", str(cfg)])
    assert r.exit_code == 0, r.output
    log = tmp_path / "runs" / "r" / "metrics.jsonl"
    with open(log, "a") as f:  # what a killed attempt past step 4 left: steps 5-6 and half a line
        for s in (5, 6):
            f.write(json.dumps({"kind": "train", "step": s, "loss": 0.5}) + "\n")
        f.write('{"kind": "train", "st')
    r = CliRunner().invoke(app, ["train", str(cfg), "--resume", "--set", "train.max_steps=8"])
    assert r.exit_code == 0, r.output
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    train_steps = Counter(x["step"] for x in recs if x["kind"] == "train")
    assert sorted(train_steps) == list(range(1, 9)) and set(train_steps.values()) == {1}, train_steps
    eval_steps = Counter(x["step"] for x in recs if x["kind"] == "eval")
    assert set(eval_steps.values()) == {1}, eval_steps
