"""A schema dataset through every verb: Avazu (real 9k-row sample; skips without the shared data)
preprocessed with configs/schemas/avazu.yaml, trained with configs/avazu.yaml (tables from
meta.json), evaluated on test, exported int8, and its raw CSV rows scored by predict; the raw-row
transformer gives the same model inputs from the file and from JSON objects keyed by column name."""

import csv
import json
import warnings

import numpy as np
import pytest
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
    with warnings.catch_warnings():  # no dense columns: nothing to warn about (torch's "zero-element tensors")
        warnings.simplefilter("error", UserWarning)
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


def _post_rows(url, name, rows):
    """POST raw rows (strings: JSON objects or text lines) as the ``raw`` BYTES input -> scores."""
    import urllib.request

    body = {"inputs": [{"name": "raw", "datatype": "BYTES", "shape": [len(rows)], "data": rows}]}
    req = urllib.request.Request(f"http://{url}/v2/models/{name}/infer", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return np.array(json.loads(r.read())["outputs"][0]["data"])


def _read_cpp_input(path):
    """A ``DLRMIN02`` file -> ``(dense [B, D], values [N], lengths [FB], weights [N])`` tensors."""
    import struct

    import torch

    raw = path.read_bytes()
    assert raw[:8] == b"DLRMIN02"
    B, D, N, FB = struct.unpack_from("<4q", raw, 8)
    o = 40
    dense = np.frombuffer(raw, "<f4", B * D, o).reshape(B, D)
    o += 4 * B * D
    values = np.frombuffer(raw, "<i8", N, o)
    lengths = np.frombuffer(raw, "<i8", FB, o + 8 * N)
    weights = np.frombuffer(raw, "<f4", N, o + 8 * N + 8 * FB)
    assert len(raw) == o + 8 * N + 8 * FB + 4 * N
    return tuple(torch.from_numpy(a.copy()) for a in (dense, values, lengths, weights))


def test_multi_valued_weighted_columns_train_export_predict_and_serve_raw_rows(tmp_path):
    """An Arrow list column and a "|"-delimited text column, each with a weight column, written to
    Parquet: preprocess logs -> train (weighted tables from meta.json sizes) -> export -> predict on
    raw Parquet rows (AUC) -> serve raw JSON rows with predict's scores (1e-6); the raw-row
    transformer cuts bags to max_len and keeps their weights."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    from tests.inference.test_serve import server

    rng = np.random.default_rng(0)
    n = 3000
    lens = rng.integers(0, 6, n)
    tags = [[f"t{x}" for x in rng.integers(0, 30, k)] for k in lens]
    w = [list(rng.uniform(0.5, 2.0, k).round(3)) for k in lens]
    clens = rng.integers(0, 4, n)
    cats = [[f"c{x}" for x in rng.integers(0, 12, k)] for k in clens]
    cw = [list(rng.uniform(0.5, 2.0, k).round(2)) for k in clens]
    logit = np.array([sum(wi * (1 if t in ("t1", "t2", "t3") else -0.2) for t, wi in zip(ts, ws))
                      + sum(wi * (0.8 if c in ("c1", "c2") else -0.1) for c, wi in zip(cs, cws))
                      for ts, ws, cs, cws in zip(tags, w, cats, cw)])
    y = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(int)
    tab = pa.table({"y": y, "user": rng.integers(0, 50, n), "price": rng.uniform(0, 100, n),
                    "tags": tags, "tag_w": w, "cats": ["|".join(c) for c in cats],
                    "cat_w": ["|".join(str(x) for x in c) for c in cw]})
    pq.write_table(tab, tmp_path / "log.parquet", row_group_size=1000)
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({
        "label": "y", "dense": [{"name": "price", "transform": "standardize"}],
        "categorical": [{"name": "user", "hash": 64},
                        {"name": "tags", "vocab": {"min_count": 1}, "multi": {"max_len": 4}, "weights": "tag_w"},
                        {"name": "cats", "hash": 32, "multi": {"delimiter": "|", "max_len": 2},
                         "weights": "cat_w"}]}))
    data = tmp_path / "data"
    invoke("preprocess", "logs", "--schema", tmp_path / "s.yaml", "--input", tmp_path / "log.parquet", "--out", data,
           "--val-ratio", 0.2, "-q")
    cfg = yaml.safe_load(open("configs/demo.yaml"))
    cfg.update(name="weighted_tags")
    cfg["data"].update(path=str(data), batch_size=128)
    cfg["model"]["tables"] = [{"name": "t_user", "num_embeddings": None, "feature_names": ["user"]},
                              {"name": "t_tags", "num_embeddings": None, "feature_names": ["tags"], "weighted": True},
                              {"name": "t_cats", "num_embeddings": None, "feature_names": ["cats"], "weighted": True}]
    cfg["train"].update(max_steps=15, run_dir=str(tmp_path / "runs"), progress=False)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    invoke("train", tmp_path / "c.yaml")
    ev = json.loads(invoke("evaluate", tmp_path / "runs" / "weighted_tags", "--split", "val", "--json")
                    .strip().splitlines()[-1])
    assert ev["num_samples"] == json.loads((data / "meta.json").read_text())["splits"]["val"]["rows"]
    model = tmp_path / "model"
    invoke("export", tmp_path / "runs" / "weighted_tags", "--out", model, "--fp32")
    man = json.loads((model / "manifest.json").read_text())
    assert man["weighted_features"] == ["tags", "cats"]

    rows = tab.slice(0, 60)
    pq.write_table(rows, tmp_path / "rows.parquet")
    out = invoke("predict", model, "--input", tmp_path / "rows.parquet", "--output", tmp_path / "scores.csv")
    assert "auc" in out and "60" in out, out
    want = np.loadtxt(tmp_path / "scores.csv", delimiter=",", skiprows=1, usecols=-1)
    assert want.shape == (60,)

    # the one raw-row transformer: bags cut to max_len, the first max_len weights kept
    from dlrmctl.data.raw_rows import Bags
    from dlrmctl.inference.export import load_exported
    from dlrmctl.inference.predict import raw_transformer

    tr, features = raw_transformer(load_exported(model))
    records = rows.drop(["y"]).to_pylist()
    _, bags, labels = tr.records(records)
    assert isinstance(bags, Bags) and labels is None
    t, c = features.index("tags"), features.index("cats")
    np.testing.assert_array_equal(bags.lengths[t], np.minimum(lens[:60], 4))
    np.testing.assert_array_equal(bags.lengths[c], np.minimum(clens[:60], 2))
    np.testing.assert_allclose(bags.weights[t], np.concatenate([x[:4] for x in w[:60]]), rtol=1e-6)
    np.testing.assert_allclose(bags.weights[c], np.concatenate([x[:2] for x in cw[:60]]), rtol=1e-6)

    # the C++ example's input writer: the same transformer, the weights in a DLRMIN02 file
    import subprocess
    import sys

    import torch

    r = subprocess.run([sys.executable, "scripts/cpp_inference/raw_input.py", str(model), str(tmp_path / "rows.parquet"),
                        str(tmp_path / "in.bin")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "wrote 60 rows" in r.stdout, r.stderr
    d, v, ln, wt = _read_cpp_input(tmp_path / "in.bin")
    np.testing.assert_allclose(load_exported(model).score(d, v, ln, wt).numpy(), want, atol=1e-6, rtol=0)
    assert ln.view(3, 60)[features.index("tags")].max() <= 4 and torch.all(wt > 0)
    from dlrmctl.inference.predict import write_cpp_raw_input

    assert write_cpp_raw_input(model, tmp_path / "rows.parquet", tmp_path / "in7.bin", batch_rows=7) == 60
    assert (tmp_path / "in7.bin").read_bytes() == (tmp_path / "in.bin").read_bytes()  # chunks regrouped per feature

    with server(model, "--name", "tagged") as (url, _):
        np.testing.assert_allclose(_post_rows(url, "tagged", [json.dumps(r) for r in records]), want, atol=1e-6,
                                   rtol=0)
        # a mixed batch: the label may come along, one row alone, bags of every length
        np.testing.assert_allclose(_post_rows(url, "tagged", [json.dumps(r) for r in rows.to_pylist()[:7]]),
                                   want[:7], atol=1e-6, rtol=0)


@pytest.mark.slow
def test_serve_answers_raw_json_rows_with_the_scores_of_predict(tmp_path):
    """`serve` of the Avazu model: raw rows as JSON objects keyed by column name (and as CSV lines)
    score as `predict` scores the same rows of the CSV file (1e-6)."""
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
    with server(model, "--name", "avazu") as (url, _):
        np.testing.assert_allclose(_post_rows(url, "avazu", objs), want, atol=1e-6, rtol=0)
        np.testing.assert_allclose(_post_rows(url, "avazu", rows[1:]), want, atol=1e-6, rtol=0)
        # a line without the label column (`click`, the second field) scores alike, alone or batched
        no_label = ",".join(f for i, f in enumerate(rows[1].split(",")) if i != 1)
        np.testing.assert_allclose(_post_rows(url, "avazu", [no_label]), want[:1], atol=1e-6, rtol=0)
        np.testing.assert_allclose(_post_rows(url, "avazu", [no_label, rows[2]]), want[:2], atol=1e-6, rtol=0)


@pytest.mark.slow  # two preprocesses of 10k real lines and a DCN-v2 training run
def test_criteo_1tb_day0_through_its_schema_trains_the_dlrmv2_shape_with_multi_hot_bags(tmp_path):
    """Criteo 1TB day-0 lines (real, 10k; skips without the shared data) through
    configs/schemas/criteo_1tb.yaml give tables of exactly MLPerf DLRMv2's sizes (those of
    configs/criteo_1tb_dlrmv2.yaml); the same schema with every table capped at 2,000 rows trains
    that config's shape scaled down (DCN-v2, 3 cross layers, the MLPerf multi-hot bag sizes expanded
    by the loader), is evaluated and exported."""
    import yaml

    from tests.conftest import SHARED_DATA

    src = require_shared(SHARED_DATA / "criteo" / "criteo1tb_day0_10k.tsv")
    full = yaml.safe_load(open("configs/criteo_1tb_dlrmv2.yaml"))
    invoke("preprocess", "logs", "--schema", "configs/schemas/criteo_1tb.yaml", "--input", src, "--out",
           tmp_path / "mlperf", "--val-ratio", 0.1, "-q")
    meta = json.loads((tmp_path / "mlperf" / "meta.json").read_text())
    assert [f["num_embeddings"] for f in meta["sparse_features"]] == \
        [t["num_embeddings"] for t in full["model"]["tables"]]
    assert sum(s["rows"] for s in meta["splits"].values()) == 10000

    schema = yaml.safe_load(open("configs/schemas/criteo_1tb.yaml"))
    for c in schema["categorical"]:
        c["hash"] = min(c["hash"], 2000)
    (tmp_path / "small.yaml").write_text(yaml.safe_dump(schema))
    data = tmp_path / "small"
    invoke("preprocess", "logs", "--schema", tmp_path / "small.yaml", "--input", src, "--out", data,
           "--val-ratio", 0.1, "-q")
    cfg = dict(full, name="dlrmv2_small")
    cfg["data"] = dict(full["data"], path=str(data), batch_size=256, eval_batch_size=1024)
    cfg["model"] = dict(full["model"], embedding_dim=16, dense_arch_layer_sizes=[32, 16],
                        over_arch_layer_sizes=[64, 32, 1], dcn_low_rank_dim=16,
                        tables=[dict(t, num_embeddings=None) for t in full["model"]["tables"]])
    cfg["train"] = dict(full["train"], max_steps=12, eval_every=12, log_every=4, run_dir=str(tmp_path / "runs"),
                        progress=False)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    invoke("train", tmp_path / "c.yaml")
    ev = json.loads(invoke("evaluate", tmp_path / "runs" / "dlrmv2_small", "--split", "val", "--json")
                    .strip().splitlines()[-1])
    assert ev["num_samples"] == json.loads((data / "meta.json").read_text())["splits"]["val"]["rows"]
    assert 0.0 <= ev["auc"] <= 1.0 and np.isfinite(ev["logloss"])
    invoke("export", tmp_path / "runs" / "dlrmv2_small", "--out", tmp_path / "model", "--fp32")
    man = json.loads((tmp_path / "model" / "manifest.json").read_text())
    assert len(man["sparse_features"]) == 26
