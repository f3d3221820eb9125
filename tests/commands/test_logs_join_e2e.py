"""A schema with a side table (``join``) and a per-group split end to end: MovieLens' ratings.csv
through configs/schemas/movielens.yaml -> train -> export -> predict on raw rating rows, whose
genres and titles come from the side table the export carries and whose item popularity and user
activity from its train counts (skipped without ../shared/data)."""

import csv
import json

import numpy as np

from tests.commands.test_cli_e2e import invoke
from tests.conftest import SHARED_DATA, require_shared


def test_movielens_schema_preprocess_train_export_predict_joins_raw_rows_from_the_export(tmp_path):
    src = require_shared(SHARED_DATA / "movielens" / "ml-latest-small" / "ratings.csv")
    data, runs, model = tmp_path / "ml", tmp_path / "runs", tmp_path / "model"
    invoke("preprocess", "logs", "--schema", "configs/schemas/movielens.yaml", "--input", src, "--out", data,
           "--val-ratio", 0.1, "--test-ratio", 0.1, "-q")
    meta = json.loads((data / "meta.json").read_text())
    assert meta["transforms"]["split"]["mode"] == "time_per_group" and meta["joins"][0]["rows"] == 9742
    invoke("train", "configs/avazu.yaml", "--set", f"data.path={data}", "--set", f"train.run_dir={runs}",
           "--set", "train.progress=false", "--set", "train.max_steps=30", "--set", "train.eval_every=30")
    invoke("export", runs / "avazu", "--out", model, "--fp32")
    assert (model / meta["joins"][0]["file"]).is_file()
    assert (model / "vocab" / "count_item_popularity.arrow").is_file()  # train counts, for raw rows' popularity
    rows = src.read_text().splitlines()[:301]  # a copy without movies.csv beside it
    raw = tmp_path / "rows.csv"
    raw.write_text("\n".join(rows) + "\n")
    out = invoke("predict", model, "--input", raw, "--output", tmp_path / "scores.csv")
    assert "auc" in out and "300" in out, out
    from dlrmctl.inference.export import load_exported
    from dlrmctl.inference.predict import raw_transformer

    tr, names = raw_transformer(load_exported(model))
    assert names == ["userId", "movieId", "genres", "tag"]
    _dense, ids, labels = next(tr.file(raw))
    records = [{k: v for k, v in r.items() if k != "rating"} for r in csv.DictReader(rows)]
    _d2, i2, l2 = tr.records(records)
    assert l2 is None and len(labels) == 300
    for a, b in zip(ids.ids, i2.ids):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(_dense, _d2)  # counts, extracted years and years since: from the export
    assert _dense.shape == (300, 4) and (_dense[:, 0] > 0).mean() > 0.9  # (0: a movie without train ratings)
    np.testing.assert_array_equal(ids.lengths, i2.lengths)
    assert ids.lengths[2].sum() > 300  # genre bags joined: most movies have several genres
    bad = tmp_path / "bad.csv"
    bad.write_text(rows[0] + "\n" + rows[1] + "\n1,99999999,4.0,964982703\n")
    from typer.testing import CliRunner

    from dlrmctl.cli import app

    r = CliRunner().invoke(app, ["predict", str(model), "--input", str(bad)])
    last = r.output.strip().splitlines()[-1]  # after predict's line saying which program runs
    assert r.exit_code == 2 and "Traceback" not in r.output and last.startswith("error: "), r.output
    assert all(w in last for w in ("bad.csv:3", "movieId", "movies.csv", "99999999")), last
    # advice for a key newer than the model's copy of the side table: what happens and how to refresh it
    assert "'99999999' is not a key of the side table movies.csv as this model holds it" in last, last
    assert "add them to movies.csv, then preprocess logs, train and export again" in last, last
    assert "`missing: empty` such rows would get missing values: an empty bag, the missing id, the fill" in last
