"""Issue 16 item 4: `dlrmctl sweep CONFIG --grid key=v1,v2 ...` trains one run directory per grid
point and writes a summary sorted by the validation metric; the test split is never read."""

import csv
import json

import pytest
from typer.testing import CliRunner

from dlrmctl.cli import app
from dlrmctl.commands.sweep import grid_points, parse_grid, rank_rows, split_values

runner = CliRunner()


def test_values_split_on_top_level_commas_only():
    assert split_values("0,0.1, auto") == ["0", "0.1", "auto"]
    assert split_values("[64, 32],[16]") == ["[64, 32]", "[16]"]
    for bad in ("[1,2", "1,,2", "1]"):
        with pytest.raises(ValueError):
            split_values(bad)


def test_grid_is_the_product_first_key_slowest():
    g = parse_grid(["model.dropout=0,0.5", "optimizer.dense.lr=0.1,1"])
    pts = grid_points(g)
    assert [a for _, a in pts] == [
        [("model.dropout", "0"), ("optimizer.dense.lr", "0.1")], [("model.dropout", "0"), ("optimizer.dense.lr", "1")],
        [("model.dropout", "0.5"), ("optimizer.dense.lr", "0.1")], [("model.dropout", "0.5"), ("optimizer.dense.lr", "1")]]
    assert pts[3][0] == "p003-dropout=0.5-lr=1"
    with pytest.raises(ValueError, match="given twice"):
        parse_grid(["a=1", "a=2"])
    with pytest.raises(ValueError, match="expected KEY=V1,V2"):
        parse_grid(["model.dropout"])


def test_ranking_puts_failed_points_last():
    rows = [{"point": "a", "auc": 0.7}, {"point": "b"}, {"point": "c", "auc": 0.8}]
    assert [r["point"] for r in rank_rows(rows, "auc")] == ["c", "a", "b"]
    rows = [{"point": "a", "ne": 0.9}, {"point": "c", "ne": 0.8}]
    assert [r["point"] for r in rank_rows(rows, "ne")] == ["c", "a"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from dlrmctl.data.synthetic import generate_synthetic

    d = tmp_path_factory.mktemp("sw")
    generate_synthetic(d, rows=3000, seed=5, num_embeddings=[40] * 26)
    return d


def _sweep(data, runs, *extra):
    args = ["sweep", "configs/demo.yaml", "--set", f"data.path={data}", "--set", f"train.run_dir={runs}",
            "--set", "data.batch_size=256", "--set", "train.max_steps=4", "--set", "train.eval_every=2",
            "--set", "model.compute_kernel=dense", "--name", "grid", *extra]
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def test_a_2x2_sweep_writes_4_runs_and_a_summary_sorted_by_val_auc(data, tmp_path):
    r = _sweep(data, tmp_path, "--grid", "model.dropout=0,0.3", "--grid", "optimizer.dense.lr=0.01,0.2",
               "--jobs", "2")
    assert r.exit_code == 0, r.output
    root = tmp_path / "grid"
    points = sorted(p.name for p in root.iterdir() if p.name.startswith("p0"))
    assert points == ["p000-dropout=0-lr=0.01", "p001-dropout=0-lr=0.2", "p002-dropout=0.3-lr=0.01",
                      "p003-dropout=0.3-lr=0.2"]
    rows = list(csv.DictReader(open(root / "sweep.csv")))
    assert len(rows) == 4 and sorted(r["point"] for r in rows) == points
    aucs = [float(r["val_auc"]) for r in rows]
    assert aucs == sorted(aucs, reverse=True) and [r["rank"] for r in rows] == ["1", "2", "3", "4"]
    for row in rows:
        run = root / row["point"]
        best = json.loads((run / "summary.json").read_text())["best"]
        assert float(row["val_auc"]) == pytest.approx(best["auc"], abs=1e-9)
        cfg = (run / "config.yaml").read_text()
        assert f"dropout: {row['model.dropout']}" in cfg and f"lr: {row['optimizer.dense.lr']}" in cfg
        # only validation evaluations: test is never read
        splits = {json.loads(x).get("split") for x in open(run / "metrics.jsonl") if '"eval"' in x}
        assert splits == {"val"}
        assert (root / "logs" / f"{row['point']}.log").exists()
    md = (root / "sweep.md").read_text()
    assert "Sorted by val auc" in md and md.count("| p00") == 4
    assert rows[0]["point"] in r.output and "--split test" in r.output
    # a second sweep into the same directory is refused without --overwrite
    r2 = _sweep(data, tmp_path, "--grid", "model.dropout=0,0.3", "--grid", "optimizer.dense.lr=0.01,0.2")
    assert r2.exit_code == 2 and "exists: pass --overwrite" in r2.output


def test_a_bad_grid_value_fails_before_any_training(data, tmp_path):
    r = _sweep(data, tmp_path, "--grid", "model.dropout=0,1.5")
    assert r.exit_code == 2 and "grid point p001-dropout=1.5" in r.output and "model.dropout: must be in" in r.output
    assert not (tmp_path / "grid").exists()
