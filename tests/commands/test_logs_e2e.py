"""A schema dataset through every verb: Avazu (real 9k-row sample; skips without the shared data)
preprocessed with configs/schemas/avazu.yaml, trained with configs/avazu.yaml (tables from
meta.json), evaluated on test, exported int8, and its raw CSV rows scored by predict; the raw-row
transformer gives the same model inputs from the file and from JSON objects keyed by column name."""

import csv
import json

import numpy as np
from tests.commands.test_cli_e2e import invoke
from tests.conftest import SHARED_DATA, require_shared

AVAZU = SHARED_DATA / "avazu" / "avazu_train_9k.csv"


def test_avazu_schema_preprocess_train_evaluate_export_predict(tmp_path):
    src = require_shared(AVAZU)
    data, runs, model = tmp_path / "avazu", tmp_path / "runs", tmp_path / "model"
    invoke("preprocess", "logs", "--schema", "configs/schemas/avazu.yaml", "--input", src, "--out", data,
           "--val-ratio", 0.1, "--test-ratio", 0.1, "-q")
    meta = json.loads((data / "meta.json").read_text())
    assert len(meta["sparse_features"]) == 21 and meta["dense_features"] == []
    assert sum(meta["splits"][s]["rows"] for s in ("train", "val", "test")) == 8999
    invoke("train", "configs/avazu.yaml", "--set", f"data.path={data}", "--set", f"train.run_dir={runs}",
           "--set", "train.progress=false", "--set", "train.max_steps=30")
    ev = json.loads(invoke("evaluate", runs / "avazu", "--split", "test", "--json").strip().splitlines()[-1])
    assert ev["num_samples"] == meta["splits"]["test"]["rows"] and 0.5 < ev["auc"] <= 1.0
    invoke("export", runs / "avazu", "--out", model, "--int8")
    rows = src.read_text().splitlines()[:301]
    raw = tmp_path / "rows.csv"
    raw.write_text("\n".join(rows) + "\n")
    out = invoke("predict", model, "--input", raw, "--output", tmp_path / "scores.csv")
    assert "auc" in out and "300" in out, out
    # the same rows as JSON objects keyed by column name (what serve receives) -> the same inputs
    from dlrmctl.inference.export import load_exported
    from dlrmctl.inference.predict import raw_transformer

    tr, _ = raw_transformer(load_exported(model))
    dense, ids, labels = next(tr.file(raw))
    records = list(csv.DictReader(rows))
    for r in records:
        r.pop("click")
    d2, i2, l2 = tr.records(records)
    assert l2 is None and labels is not None and len(labels) == 300
    np.testing.assert_array_equal(ids, i2)
    np.testing.assert_array_equal(dense, d2)
    d3, i3, _ = tr.lines([r.encode() for r in rows[1:]])
    np.testing.assert_array_equal(ids, i3)


def test_multi_valued_weighted_parquet_column_trains_and_exports(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    rng = np.random.default_rng(0)
    n = 3000
    lens = rng.integers(0, 6, n)
    tags = [[f"t{x}" for x in rng.integers(0, 30, k)] for k in lens]
    w = [list(rng.uniform(0.5, 2.0, k).round(3)) for k in lens]
    logit = np.array([sum(wi * (1 if t in ("t1", "t2", "t3") else -0.2) for t, wi in zip(ts, ws))
                      for ts, ws in zip(tags, w)])
    y = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(int)
    pq.write_table(pa.table({"y": y, "user": rng.integers(0, 50, n), "price": rng.uniform(0, 100, n),
                             "tags": tags, "tag_w": w}), tmp_path / "log.parquet", row_group_size=1000)
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({
        "label": "y", "dense": [{"name": "price", "transform": "standardize"}],
        "categorical": [{"name": "user", "hash": 64},
                        {"name": "tags", "vocab": {"min_count": 1}, "multi": {"max_len": 4}, "weights": "tag_w"}]}))
    data = tmp_path / "data"
    invoke("preprocess", "logs", "--schema", tmp_path / "s.yaml", "--input", tmp_path / "log.parquet", "--out", data,
           "--val-ratio", 0.2, "-q")
    cfg = yaml.safe_load(open("configs/demo.yaml"))
    cfg.update(name="weighted_tags")
    cfg["data"].update(path=str(data), batch_size=128)
    cfg["model"]["tables"] = [{"name": "t_user", "num_embeddings": None, "feature_names": ["user"]},
                              {"name": "t_tags", "num_embeddings": None, "feature_names": ["tags"], "weighted": True}]
    cfg["train"].update(max_steps=15, run_dir=str(tmp_path / "runs"), progress=False)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    invoke("train", tmp_path / "c.yaml")
    ev = json.loads(invoke("evaluate", tmp_path / "runs" / "weighted_tags", "--split", "val", "--json")
                    .strip().splitlines()[-1])
    assert ev["num_samples"] == json.loads((data / "meta.json").read_text())["splits"]["val"]["rows"]
    invoke("export", tmp_path / "runs" / "weighted_tags", "--out", tmp_path / "model", "--fp32")
    man = json.loads((tmp_path / "model" / "manifest.json").read_text())
    assert man["weighted_features"] == ["tags"]


def test_serve_answers_raw_json_rows_with_the_scores_of_predict(tmp_path):
    """`serve` of the Avazu model: raw rows as JSON objects keyed by column name (and as CSV lines)
    score as `predict` scores the same rows of the CSV file (1e-6)."""
    import urllib.request

    from tests.inference.test_serve import server

    src = require_shared(AVAZU)
    data, runs, model = tmp_path / "avazu", tmp_path / "runs", tmp_path / "model"
    invoke("preprocess", "logs", "--schema", "configs/schemas/avazu.yaml", "--input", src, "--out", data, "-q",
           "--val-ratio", 0.2)
    invoke("train", "configs/avazu.yaml", "--set", f"data.path={data}", "--set", f"train.run_dir={runs}",
           "--set", "train.progress=false", "--set", "train.max_steps=10")
    invoke("export", runs / "avazu", "--out", model, "--fp32")
    rows = src.read_text().splitlines()[:41]
    (tmp_path / "rows.csv").write_text("\n".join(rows) + "\n")
    invoke("predict", model, "--input", tmp_path / "rows.csv", "--output", tmp_path / "scores.csv")
    want = np.loadtxt(tmp_path / "scores.csv", delimiter=",", skiprows=1, usecols=-1)
    objs = [json.dumps(r) for r in csv.DictReader(rows)]

    def post(url, lines):
        body = {"inputs": [{"name": "raw", "datatype": "BYTES", "shape": [len(lines)], "data": lines}]}
        req = urllib.request.Request(f"http://{url}/v2/models/avazu/infer", data=json.dumps(body).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return np.array(json.loads(r.read())["outputs"][0]["data"])

    with server(model, "--name", "avazu") as (url, _):
        np.testing.assert_allclose(post(url, objs), want, atol=1e-6, rtol=0)
        np.testing.assert_allclose(post(url, rows[1:]), want, atol=1e-6, rtol=0)
