"""`dlrmctl report`: summary table from metrics.jsonl and PNG plots."""

import json

import pytest
from typer.testing import CliRunner

from dlrmctl.cli import app


def _write_metrics(run):
    run.mkdir()
    recs = [{"kind": "train", "step": s, "epoch": 1, "loss": 0.7 - 0.01 * s, "loss_avg": 0.71 - 0.01 * s,
             "samples_per_s": 1000.0 + s} for s in range(2, 11, 2)]
    recs += [{"kind": "eval", "split": "val", "step": 5, "epoch": 1, "auc": 0.70, "logloss": 0.5, "ne": 0.9, "calibration": 1.0},
             {"kind": "eval", "split": "val", "step": 10, "epoch": 1, "auc": 0.72, "logloss": 0.48, "ne": 0.88, "calibration": 0.98}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_report_prints_the_summary_and_writes_plots(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib (dlrmctl[report]) is not installed")
    run = tmp_path / "run"
    _write_metrics(run)
    r = CliRunner().invoke(app, ["report", str(run)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "| 10 | 1 | 0.7200 | 0.4800 | 0.8800 | 0.980 |" in r.output
    assert "best AUC 0.7200 at step 10" in r.output
    # each loss quantity is labelled for what it is
    assert "loss of step 10 alone (one batch): 0.6000" in r.output
    assert "mean loss over steps 9-10 (what loss.png plots): 0.6100" in r.output
    assert "last loss" not in r.output
    for name in ("loss.png", "auc.png", "throughput.png"):
        assert (run / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_names_a_corrupt_metrics_line(tmp_path):
    run = tmp_path / "run"
    _write_metrics(run)
    with open(run / "metrics.jsonl", "a") as f:
        f.write("{not json\n")
    r = CliRunner().invoke(app, ["report", str(run), "--no-plots"])
    assert r.exit_code == 2 and "metrics.jsonl:8: not JSON" in r.output
