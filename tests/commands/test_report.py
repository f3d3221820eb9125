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


def test_report_plots_are_titled_and_mark_val_loss_best_step_early_stop_and_epochs(tmp_path):
    """Issue 23: each plot is titled with the run's name (config.yaml), loss.png has the validation
    log loss beside the training loss, and every plot marks the best step (summary.json's, i.e. the
    checkpoint 'best'), the early stop and the epoch boundaries (what the PNG's text chunks record)."""
    pytest.importorskip("matplotlib", reason="matplotlib (dlrmctl[report]) is not installed")
    from PIL import Image

    run = tmp_path / "run"
    run.mkdir()
    recs = [{"kind": "train", "step": s, "epoch": 1 + (s > 12), "loss": 0.7 - 0.01 * s, "loss_avg": 0.7 - 0.01 * s,
             "samples_per_s": 1000.0} for s in range(2, 21, 2)]
    recs += [{"kind": "eval", "split": "val", "step": s, "epoch": 1 + (s > 12), "auc": a, "logloss": ll, "ne": 0.9,
              "calibration": 1.0} for s, a, ll in ((6, 0.70, 0.50), (12, 0.74, 0.47), (18, 0.72, 0.49), (20, 0.71, 0.5))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sorted(recs, key=lambda r: r["step"])))
    (run / "config.yaml").write_text("name: my_run\ntrain:\n  keep_best: auc\n")
    (run / "summary.json").write_text(json.dumps({"best": {"auc": 0.74, "step": 12}, "steps": 20,
                                                  "early_stopped": True}))
    r = CliRunner().invoke(app, ["report", str(run)])
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    texts = {n: Image.open(run / n).text for n in ("loss.png", "auc.png", "throughput.png")}
    assert texts["loss.png"]["Title"] == "my_run: loss"
    assert texts["auc.png"]["Title"] == "my_run: val AUC"
    assert "val log loss" in texts["loss.png"]["Description"] and "training" in texts["loss.png"]["Description"]
    for n, t in texts.items():
        d = t["Description"]
        assert "best step 12" in d and "early stop at step 20" in d and "epoch ends at steps 12" in d, (n, d)

    # without summary.json (a run still training): the best by train.keep_best, no early stop
    (run / "summary.json").unlink()
    (run / "config.yaml").write_text("name: my_run\ntrain:\n  keep_best: ne\n")
    recs[-1]["ne"] = 0.8  # step 20 has the lowest NE
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sorted(recs, key=lambda r: r["step"])))
    r = CliRunner().invoke(app, ["report", str(run)])
    assert r.exit_code == 0, r.output
    d = Image.open(run / "auc.png").text["Description"]
    assert "best step 20" in d and "early stop" not in d, d


def test_report_of_a_sweep_directory_prints_its_ranking_and_names_its_points(tmp_path):
    sweep = tmp_path / "grid"
    (sweep / "p000-lr=0.1").mkdir(parents=True)
    (sweep / "sweep.csv").write_text("rank,point,val_auc\n1,p000-lr=0.1,0.7\n")
    (sweep / "sweep.md").write_text("Sorted by val auc\n\n| rank | point | val auc |\n| 1 | p000-lr=0.1 | 0.7000 |\n")
    r = CliRunner().invoke(app, ["report", str(sweep)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert f"{sweep} is a sweep" in r.output and "| 1 | p000-lr=0.1 | 0.7000 |" in r.output
    assert f"dlrmctl report {sweep}/<point>" in r.output
    r = CliRunner().invoke(app, ["report", str(tmp_path)])  # neither a run nor a sweep: the one error line
    assert r.exit_code == 2 and "not a training run directory" in r.output
