"""Issue 16 item 4: `dlrmctl sweep CONFIG --grid key=v1,v2 ...` trains one run directory per grid
point and writes a summary sorted by the validation metric; the test split is never read."""

import csv
import json
import os
import signal
import subprocess
import sys
import time

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
    # the same value twice would train the same point twice
    with pytest.raises(ValueError, match=r"--grid model.dropout: value\(s\) \['0.1'\] given twice"):
        parse_grid(["model.dropout=0.1, 0.1,0.2"])


def test_ranking_puts_failed_points_last():
    rows = [{"point": "a", "auc": 0.7}, {"point": "b"}, {"point": "c", "auc": 0.8}]
    assert [r["point"] for r in rank_rows(rows, "auc")] == ["c", "a", "b"]
    rows = [{"point": "a", "ne": 0.9}, {"point": "c", "ne": 0.8}]
    assert [r["point"] for r in rank_rows(rows, "ne")] == ["c", "a"]


def test_a_nan_metric_ranks_last_and_leaves_the_order_of_the_others():
    # summary.json holds NaN for an undefined AUC (one-class val); NaN in the sort key scrambled the order
    nan = float("nan")
    rows = [{"point": "a", "auc": 0.7}, {"point": "b", "auc": nan}, {"point": "c", "auc": 0.8},
            {"point": "d", "auc": 0.75}, {"point": "e"}]
    assert [r["point"] for r in rank_rows(rows, "auc")] == ["c", "d", "a", "b", "e"]
    rows = [{"point": "a", "ne": nan}, {"point": "b", "ne": 0.9}, {"point": "c", "ne": float("inf")},
            {"point": "d", "ne": 0.8}]
    assert [r["point"] for r in rank_rows(rows, "ne")] == ["d", "b", "c", "a"]


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


@pytest.mark.slow
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
    # `report` on the sweep directory: its ranking, and how to report a point
    rep = runner.invoke(app, ["report", str(root)], catch_exceptions=False)
    assert rep.exit_code == 0 and md.strip() in rep.output and f"dlrmctl report {root}/<point>" in rep.output, rep.output
    # a second sweep into the same directory is refused without --overwrite
    r2 = _sweep(data, tmp_path, "--grid", "model.dropout=0,0.3", "--grid", "optimizer.dense.lr=0.01,0.2")
    assert r2.exit_code == 2 and "exists: pass --overwrite" in r2.output


def test_a_bad_grid_value_fails_before_any_training(data, tmp_path):
    r = _sweep(data, tmp_path, "--grid", "model.dropout=0,1.5")
    assert r.exit_code == 2 and "grid point p001-dropout=1.5" in r.output and "model.dropout: must be in" in r.output
    assert not (tmp_path / "grid").exists()


def test_keys_the_sweep_sets_itself_cannot_be_gridded(data, tmp_path):
    """A grid over name / train.run_dir / train.progress was silently overridden by the sweep (all points
    the same run); over train.keep_best the points would be ranked on a metric they were not selected on."""
    from dlrmctl.commands.sweep import RESERVED_KEYS

    for key in RESERVED_KEYS:
        with pytest.raises(ValueError, match=f"--grid {key}: "):
            parse_grid([f"{key}=a,b"])
    r = _sweep(data, tmp_path, "--grid", "name=a,b")
    assert r.exit_code == 2 and "--grid name: the sweep names each point" in r.output
    r = _sweep(data, tmp_path, "--grid", f"train.run_dir={tmp_path}/x,{tmp_path}/y")
    assert r.exit_code == 2 and "--grid train.run_dir" in r.output
    assert not (tmp_path / "grid").exists() and not (tmp_path / "x").exists()


def test_sweep_name_is_one_directory_under_run_dir(data, tmp_path):
    """--name .. wrote the points and sweep.csv into train.run_dir's parent; --name '' silently fell back
    to the config's name."""
    runs = tmp_path / "runs"
    for bad in ("..", ".", "", "a/b"):
        args = ["sweep", "configs/demo.yaml", "--set", f"data.path={data}", "--set", f"train.run_dir={runs}",
                "--grid", "model.dropout=0", "--name", bad]
        r = runner.invoke(app, args, catch_exceptions=False)
        assert r.exit_code == 2 and "--name: must be one directory name" in r.output, (bad, r.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.slow
def test_more_jobs_than_points_and_a_name_with_spaces(data, tmp_path):
    """--jobs larger than the grid runs the points (as many at once as there are) and the printed
    `dlrmctl evaluate` hint is quoted for the shell."""
    import shlex

    args = ["sweep", "configs/demo.yaml", "--set", f"data.path={data}", "--set", f"train.run_dir={tmp_path}",
            "--set", "data.batch_size=256", "--set", "train.max_steps=2", "--set", "model.compute_kernel=dense",
            "--grid", "model.dropout=0", "--jobs", "4", "--name", "my sweep"]
    r = runner.invoke(app, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "1 point(s) of model.dropout (1), 1 at a time" in r.output
    hint = r.output.split("dlrmctl evaluate ", 1)[1].split(" --split test")[0]
    assert shlex.split(hint) == [str(tmp_path / "my sweep" / "p000-dropout=0")]
    assert (tmp_path / "my sweep" / "sweep.csv").exists()


def _procs_mentioning(text: str) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        out.append(int(pid))
            except OSError:
                pass
    return out


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="lists processes through /proc")
@pytest.mark.parametrize("sig", [signal.SIGINT])  # SIGTERM takes the same path (interruptible)
def test_a_signal_to_the_sweep_process_alone_stops_every_point_and_the_sweep(data, tmp_path, sig):
    """`kill -INT PID` (or a supervisor's SIGTERM) to the sweep process was ignored: the points
    kept training and the sweep did not exit until SIGKILL."""
    args = [sys.executable, "-m", "dlrmctl.cli", "sweep", "configs/demo.yaml", "--set", f"data.path={data}",
            "--set", f"train.run_dir={tmp_path}", "--set", "data.batch_size=8", "--set", "train.epochs=50",
            "--set", "model.compute_kernel=dense", "--name", "grid", "--grid", "model.dropout=0,0.1", "--jobs", "2"]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    logs = tmp_path / "grid" / "logs"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # both points are training
        if logs.is_dir() and len([f for f in logs.iterdir() if "epoch" in f.read_text()]) == 2:
            break
        time.sleep(1)
    assert len(_procs_mentioning(str(tmp_path))) >= 2
    p.send_signal(sig)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 128 + sig, (p.returncode, out, err)
    assert err.strip().splitlines()[-1].startswith(f"error: interrupted ({signal.Signals(sig).name}): `dlrmctl sweep`"), err
    deadline = time.monotonic() + 60  # a killed point leaves /proc once the kernel has run its exit
    while _procs_mentioning(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _procs_mentioning(str(tmp_path)) == []
