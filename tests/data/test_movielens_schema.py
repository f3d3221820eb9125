"""MovieLens as a schema instance: ``preprocess logs --schema configs/schemas/movielens.yaml`` on
ml-latest-small's ratings.csv (movies.csv joined) against ``preprocess movielens`` on the release
(skipped without ../shared/data): the same rows in the same order and splits, the same ids,
vocabularies, dense features, tag bags and meta.json statistics, and a model of the same shape
(configs/movielens.yaml, configs/movielens_schema.yaml) gets the same val AUC bit for bit."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from dlrmctl.data.ids import raw_ids
from dlrmctl.data.logs import LogOptions, load_schema, preprocess_logs

NAMES = {"userId": "user_id", "movieId": "item_id", "genres": "genres", "tag": "tags"}
DENSE = ["item_popularity", "user_activity", "release_year", "years_since_release"]


def _split(d, split):
    meta = json.loads((d / "meta.json").read_text())
    t = pa.concat_tables([ipc.open_file(pa.memory_map(str(d / p))).read_all() for p in meta["splits"][split]["files"]])
    return t, meta


def _vocab(d, meta, name):
    return ipc.open_file(pa.memory_map(str(d / meta["vocab_files"][name]))).read_all()


def _both(tmp_path, src):
    from dlrmctl.data.movielens import MovieLensOptions, preprocess_movielens

    preprocess_movielens(src, tmp_path / "m", MovieLensOptions(val_ratio=0.1, test_ratio=0.1))
    preprocess_logs(load_schema("configs/schemas/movielens.yaml"), src / "ratings.csv", tmp_path / "l",
                    LogOptions(val_ratio=0.1, test_ratio=0.1), progress=False)
    return tmp_path / "m", tmp_path / "l"


def test_movielens_schema_gives_the_rows_ids_vocabularies_and_statistics_of_preprocess_movielens(tmp_path):
    from tests.conftest import SHARED_DATA, require_shared

    m, lg = _both(tmp_path, require_shared(SHARED_DATA / "movielens" / "ml-latest-small"))
    for split in ("train", "val", "test"):
        a, mm = _split(m, split)
        b, ml = _split(lg, split)
        assert a.num_rows == b.num_rows == {"train": 81200, "val": 9818, "test": 9818}[split]
        assert a.column("label").equals(b.column("label")), split
        for ours, theirs in NAMES.items():  # ids (and bags, element by element) in the same row order
            assert a.column(theirs).to_pylist() == b.column(ours).to_pylist(), (split, ours)
        for f in DENSE:
            assert a.column(f).equals(b.column(f)), (split, f)
    for ours, theirs in NAMES.items():
        lv = _vocab(lg, ml, ours)
        if theirs in ("genres", "tags"):
            assert lv.column("value").to_pylist() == raw_ids(pa.array(mm["vocabularies"][theirs])).tolist()
            continue
        mv = _vocab(m, mm, theirs)
        assert lv.column("value").to_pylist() == raw_ids(pa.array([str(v) for v in mv.column("value").to_pylist()])).tolist()
        assert lv.column("count").equals(mv.column("count"))
    fm = {f["name"]: f for f in mm["sparse_features"]}
    for f in ml["sparse_features"]:  # sizes (no out-of-vocabulary rows), pooling factors
        want = fm[NAMES[f["name"]]]
        assert {k: f[k] for k in want} == {**want, "name": f["name"]}, f["name"]
    assert ml["dense_features"] == mm["dense_features"] == DENSE
    ry = (ml["transforms"]["dense"]["release_year"], mm["transforms"]["dense"]["release_year"])
    assert (ry[0]["mean"], ry[0]["std"]) == (ry[1]["mean"], ry[1]["std"])
    assert {s: ml["splits"][s]["rows"] for s in ml["splits"]} == {s: mm["splits"][s]["rows"] for s in mm["splits"]}
    assert ml["ctr"] == pytest.approx(mm["ctr"], rel=1e-7)  # preprocess movielens averages float32 labels
    # the item popularity of raw rows (predict / serve) comes from the stored train counts
    from dlrmctl.data.logs.raw_transform import RawTransformer

    ratings = tmp_path / "few.csv"
    src = require_shared(SHARED_DATA / "movielens" / "ml-latest-small")
    ratings.write_text("".join((src / "ratings.csv").read_text().splitlines(keepends=True)[:200]))
    dense, _ids, _labels = next(RawTransformer(ml, lg).file(ratings))
    a, _ = _split(m, "train")
    first = {(u, i): k for k, (u, i) in enumerate(zip(a.column("user_id").to_pylist(), a.column("item_id").to_pylist()))}
    rows = [r.split(",") for r in ratings.read_text().splitlines()[1:]]
    uv = {v: k for k, v in enumerate(_vocab(m, mm, "user_id").column("value").to_pylist())}
    iv = {v: k for k, v in enumerate(_vocab(m, mm, "item_id").column("value").to_pylist())}
    hits = [(j, first[(uv[int(r[0])], iv[int(r[1])])]) for j, r in enumerate(rows) if (uv[int(r[0])], iv[int(r[1])]) in first]
    assert len(hits) > 100
    want = np.stack([a.column(f).to_numpy() for f in DENSE], axis=1)
    assert np.array_equal(dense[[j for j, _ in hits]], want[[k for _, k in hits]])


def test_a_model_trained_on_either_gets_the_same_val_auc_bit_for_bit(tmp_path):
    from tests.commands.test_cli_e2e import invoke
    from tests.conftest import SHARED_DATA, require_shared

    m, lg = _both(tmp_path, require_shared(SHARED_DATA / "movielens" / "ml-latest-small"))
    auc = {}
    for d, cfg in ((m, "configs/movielens.yaml"), (lg, "configs/movielens_schema.yaml")):
        invoke("train", cfg, "--set", f"data.path={d}", "--set", f"train.run_dir={tmp_path / ('runs_' + d.name)}",
               "--set", "train.progress=false", "--set", "train.max_steps=60", "--set", "train.eval_every=60")
        name = "movielens" if d == m else "movielens_schema"
        auc[d.name] = json.loads(invoke("evaluate", tmp_path / ("runs_" + d.name) / name, "--split", "val",
                                        "--json").strip().splitlines()[-1])["auc"]
    assert auc["m"] == auc["l"] and 0.5 < auc["m"] < 1, auc
