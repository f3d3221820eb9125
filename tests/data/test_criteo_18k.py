"""Issue 29 item 1: the 18k-line real-data recipe (configs/criteo_18k.yaml): ``preprocess criteo``
of both real files together, and ``scripts/criteo_cv.py`` with a repeated ``--input``."""

from __future__ import annotations

import json
import shutil

from typer.testing import CliRunner

from dlrmctl.cli import app
from dlrmctl.config import load_config
from tests.conftest import CRITEO_10K, REPO, SHARED_DATA, require_shared
from tests.helpers.scripts import load_script

LINES_2000_10000 = SHARED_DATA / "criteo" / "criteo_kaggle_train_lines2000_10000.tsv"
runner = CliRunner()


def test_both_files_preprocess_together_into_the_config_s_three_splits(tmp_path):
    a, b = require_shared(CRITEO_10K), require_shared(LINES_2000_10000)
    out = tmp_path / "criteo_18k"
    r = runner.invoke(app, ["preprocess", "criteo", "--input", str(a), "--input", str(b), "--out", str(out),
                            "--val-ratio", "0.15", "--test-ratio", "0.15"])
    assert r.exit_code == 0, r.output
    meta = json.loads((out / "meta.json").read_text())
    rows = {s: v["rows"] for s, v in meta["splits"].items()}
    assert sum(rows.values()) == 18_001 and all(rows[s] > 2_000 for s in ("val", "test"))
    assert len(meta["inputs"]) == 2
    # the same two files through a directory holding only them: the same rows
    d = tmp_path / "in"
    d.mkdir()
    for f in (a, b):
        shutil.copy(f, d / f.name)
    r = runner.invoke(app, ["preprocess", "criteo", "--input", str(d), "--out", str(tmp_path / "dir"),
                            "--val-ratio", "0.15", "--test-ratio", "0.15"])
    assert r.exit_code == 0, r.output
    assert {s: v["rows"] for s, v in json.loads((tmp_path / "dir" / "meta.json").read_text())["splits"].items()} == rows
    cfg = load_config(str(REPO / "configs" / "criteo_18k.yaml"), [f"data.path={out}"])
    assert cfg.data.path == str(out)


def test_criteo_cv_takes_both_inputs(tmp_path):
    a, b = require_shared(CRITEO_10K), require_shared(LINES_2000_10000)
    cv = load_script("criteo_cv")
    cv.check_args([str(a), str(b)], str(REPO / "configs" / "criteo_18k.yaml"), [], 2, 0, 0.15, 0.15, (0.1,), 1)
    cv.preprocess_split([str(a), str(b)], tmp_path / "d", 3, 0.15, 0.15)
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert sum(v["rows"] for v in meta["splits"].values()) == 18_001
