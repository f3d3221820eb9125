"""``preprocess logs`` with a per-group time split (``split.group``), side tables (``join``) and
``null_values``: the split equals MovieLens' per-user split, joined columns become features (and
raw rows are joined the same way), bad keys and bad schema keys are one line naming what is wrong;
MovieLens as a schema: tests/data/test_movielens_schema.py."""

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from dlrmctl.data.columnar import DataError
from dlrmctl.data.ids import raw_ids
from dlrmctl.data.logs import LogOptions, SchemaError, load_schema, parse_schema, preprocess_logs
from dlrmctl.data.logs.raw_transform import RawTransformer
from dlrmctl.data.movielens import time_ordered_split
from tests.conftest import one_error_line

SCHEMA = """
label: click
time: ts
split: {by: time, group: user, tiebreak: item}
join:
  - {path: items.csv, key: item, columns: [tags, price]%s}
dense:
  - {name: price, transform: log1p}
categorical:
  - {name: rid, ids: raw}
  - {name: user, vocab: {min_count: 1}}
  - {name: item, vocab: {min_count: 1}}
  - {name: tags, vocab: {min_count: 1}, multi: {delimiter: "|"}, null_values: [none]}
"""


def _log(tmp_path, n=600, seed=0, files=2, missing_item=False):
    """A log of ``n`` rows over ``files`` CSV files (rows interleaved) and its side table items.csv;
    equal times within a user (the tiebreak orders them).  Returns (paths, rows as arrays)."""
    rng = np.random.default_rng(seed)
    user = rng.integers(0, 25, n)
    item = rng.integers(0, 40, n)
    ts = rng.integers(0, 60, n)  # many equal times per user
    click = (rng.random(n) < 0.3).astype(int)
    rows = {"rid": np.arange(n), "user": user, "item": item, "ts": ts, "click": click}
    keep = np.ones(n, bool)
    _, first = np.unique(np.stack([user, item, ts]), axis=1, return_index=True)  # (user, ts, item) unique
    keep[:] = False
    keep[first] = True
    rows = {k: v[keep] for k, v in rows.items()}
    if missing_item:
        rows["item"][5] = 999
    paths = []
    for f in range(files):
        p = tmp_path / f"log{f}.csv"
        sel = np.arange(len(rows["rid"]))[f::files]
        p.write_text("rid,user,item,ts,click\n" + "".join(
            f"r{rows['rid'][i]},u{rows['user'][i]},{rows['item'][i]},{rows['ts'][i]},{rows['click'][i]}\n" for i in sel))
        paths.append(p)
    (tmp_path / "items.csv").write_text("item,title,tags,price\n" + "".join(
        f"{i},\"t, {i}\",{'none' if i % 9 == 0 else '|'.join(f'g{(i * k) % 7}' for k in range(1, 1 + i % 3))},{i}\n"
        for i in range(40)))
    return paths, rows


def _read(d, split):
    meta = json.loads((d / "meta.json").read_text())
    tabs = [ipc.open_file(pa.memory_map(str(d / p))).read_all() for p in meta["splits"][split]["files"]]
    return pa.concat_tables(tabs), meta


def _vocab(d, meta, name):
    return ipc.open_file(pa.memory_map(str(d / meta["vocab_files"][name]))).read_all().column("value").to_numpy()


def test_per_group_time_split_is_each_users_latest_rows_as_in_movielens(tmp_path):
    paths, rows = _log(tmp_path)
    schema = tmp_path / "s.yaml"
    schema.write_text(SCHEMA % "")
    out = tmp_path / "out"
    preprocess_logs(load_schema(schema), [str(p) for p in paths], out, LogOptions(val_ratio=0.2, test_ratio=0.25),
                    progress=False)
    want = time_ordered_split(rows["user"], rows["ts"], 0.2, 0.25, tiebreak=rows["item"])
    got = {}
    for code, split in enumerate(("train", "val", "test")):
        t, meta = _read(out, split)
        got.update(dict.fromkeys(t.column("rid").to_numpy().tolist(), code))
    rid_keys = raw_ids(pa.array([f"r{i}" for i in rows["rid"]]))
    assert [got[k] for k in rid_keys.tolist()] == want.tolist()
    assert 0 < (want == 1).sum() and 0 < (want == 2).sum()
    sp = meta["transforms"]["split"]
    assert (sp["mode"], sp["group"], sp["tiebreak"], sp["groups"]) == ("time_per_group", "user", "item", 25)
    # two workers and a rerun (resumed) give the same splits
    preprocess_logs(load_schema(schema), [str(p) for p in paths], tmp_path / "w2",
                    LogOptions(val_ratio=0.2, test_ratio=0.25, workers=2), progress=False)
    for split in ("train", "val", "test"):
        assert _read(out, split)[0].equals(_read(tmp_path / "w2", split)[0])


def test_joined_columns_become_features_and_raw_rows_are_joined_alike(tmp_path):
    paths, rows = _log(tmp_path, files=1)
    schema = tmp_path / "s.yaml"
    schema.write_text(SCHEMA % "")
    out = tmp_path / "out"
    preprocess_logs(load_schema(schema), str(paths[0]), out, LogOptions(val_ratio=0.1, test_ratio=0.1),
                    progress=False)
    t, meta = _read(out, "train")
    assert meta["joins"][0]["file"] == "vocab/join_0.arrow" and meta["joins"][0]["rows"] == 40
    tag_vocab = dict(enumerate(_vocab(out, meta, "tags").tolist()))
    items = dict(enumerate(_vocab(out, meta, "item").tolist()))
    for item_id, bag, price in zip(t.column("item").to_numpy(), t.column("tags").to_pylist(),
                                   t.column("price").to_numpy()):
        i = [k for k in range(40) if raw_ids(pa.array([str(k)]))[0] == items[int(item_id)]][0]
        want = [] if i % 9 == 0 else [f"g{(i * k) % 7}" for k in range(1, 1 + i % 3)]  # "none" is a null value
        assert [tag_vocab[b] for b in bag] == raw_ids(pa.array(want, pa.string())).tolist()
        assert price == pytest.approx(np.log1p(i))
    # raw rows (predict / serve) are joined with the dataset's copy of the side table, not items.csv
    (tmp_path / "items.csv").unlink()
    rt = RawTransformer(meta, out)
    dense, ids, _labels = next(rt.file(paths[0]))
    all_rows = pa.concat_tables([_read(out, s)[0] for s in ("train", "val", "test")])
    by_rid = {r: k for k, r in enumerate(all_rows.column("rid").to_numpy().tolist())}
    rid_keys = raw_ids(pa.array([f"r{i}" for i in rows["rid"]]))
    k = [by_rid[r] for r in rid_keys.tolist()]
    assert np.array_equal(dense[:, 0], all_rows.column("price").to_numpy()[k])
    bags = np.split(ids.ids[3], np.cumsum(ids.lengths[3])[:-1])
    want = all_rows.column("tags").to_pylist()
    assert [b.tolist() for b in bags] == [want[j] for j in k]


def test_a_joined_column_also_in_the_log_or_in_raw_rows_is_named_as_such(tmp_path):
    """A column both in the log and brought by a join was called "not named by the schema: give it
    a role" (it has one); raw rows to score carrying a joined column were told the same."""
    paths, _ = _log(tmp_path, files=1)
    schema = tmp_path / "s.yaml"
    schema.write_text(SCHEMA % "")
    both = tmp_path / "both.csv"
    lines = paths[0].read_text().splitlines()
    both.write_text("\n".join([lines[0] + ",price"] + [x + ",1" for x in lines[1:]]) + "\n")
    one_error_line(["preprocess", "logs", "--schema", schema, "--input", both, "--out", tmp_path / "o"],
                   "both.csv", "column 'price' is in the input and also brought by join[0] (items.csv, by its key "
                   "'item') of the schema", "remove it from that join's `columns:`")
    out = tmp_path / "out"
    preprocess_logs(load_schema(schema), str(paths[0]), out, progress=False)
    rt = RawTransformer(_read(out, "train")[1], out)
    with pytest.raises(DataError, match=r"column 'price' comes from the model's side table join\[0\] \(items.csv, "
                                        r"by its key 'item'\): raw rows must not carry it"):
        next(rt.file(both))
    with pytest.raises(DataError, match="column 'tags' comes from the model's side table join"):
        rt.records([{"rid": "r1", "user": "u1", "item": "1", "ts": 1, "tags": "g1"}])


def test_a_key_the_side_table_lacks_is_named_by_its_line_or_skipped_or_empty(tmp_path):
    paths, rows = _log(tmp_path, files=1, missing_item=True)
    schema = tmp_path / "s.yaml"
    schema.write_text(SCHEMA % "")
    one_error_line(["preprocess", "logs", "--schema", schema, "--input", paths[0], "--out", tmp_path / "o"],
                   "log0.csv:7", "item", "items.csv", "999")
    rep = preprocess_logs(load_schema(schema), str(paths[0]), tmp_path / "s",
                          LogOptions(on_bad_line="skip"), progress=False)
    assert rep.bad_lines == 1
    schema.write_text(SCHEMA % ", missing: empty")
    preprocess_logs(load_schema(schema), str(paths[0]), tmp_path / "e", progress=False)
    t, meta = _read(tmp_path / "e", "train")  # no ratios: every row is in train
    assert meta["bad_lines_skipped"] == 0 and t.num_rows == len(rows["rid"])
    rid = raw_ids(pa.array([f"r{rows['rid'][5]}"]))[0]
    row = t.column("rid").to_numpy().tolist().index(rid)
    assert t.column("tags")[row].as_py() == [] and t.column("price")[row].as_py() == 0.0


def test_a_side_table_with_a_repeated_key_or_without_a_column_is_one_line(tmp_path):
    paths, _ = _log(tmp_path, files=1)
    schema = tmp_path / "s.yaml"
    schema.write_text(SCHEMA % "")
    side = tmp_path / "items.csv"
    side.write_text(side.read_text() + "3,again,g1,3\n")
    one_error_line(["preprocess", "logs", "--schema", schema, "--input", paths[0], "--out", tmp_path / "o"],
                   "items.csv", "item = '3'", "data rows 4 and 41")
    side.write_text("item,title,price\n1,a,1\n")
    one_error_line(["preprocess", "logs", "--schema", schema, "--input", paths[0], "--out", tmp_path / "o"],
                   "items.csv", "column 'tags'")


@pytest.mark.parametrize("schema, path", [
    ({"split": {"by": "row", "group": "u"}}, "split.group"),
    ({"split": {"by": "time", "tiebreak": "i"}}, "split.tiebreak"),
    ({"split": {"by": "hour"}}, "split.by"),
    ({"split": {"by": "time", "group": "u"}, "time": None}, "split.by"),
    ({"join": [{"path": "m.csv", "columns": ["g"]}]}, "join[0] (m.csv).key"),
    ({"join": [{"path": "m.csv", "key": "i", "columns": ["i"]}]}, "join[0] (m.csv).columns"),
    ({"join": [{"path": "m.csv", "key": "i", "columns": ["g"], "how": "left"}]}, "join[0].how"),
    ({"join": [{"path": "m.csv", "key": "i", "columns": ["g"], "missing": "fill"}]}, "join[0] (m.csv).missing"),
    ({"join": [{"path": "m.csv", "key": "i", "columns": ["g"]}, {"path": "n.csv", "key": "i", "columns": ["g"]}]},
     "join[1] (n.csv).columns[0]"),
    ({"join": {"path": "m.csv"}}, "join"),
    ({"join": [{"path": "m.csv", "key": "i", "columns": ["g"], "format": "xml"}]}, "join[0] (m.csv).format"),
    ({"join": [{"path": "m.csv", "key": "i", "columns": ["g"], "delimiter": "::"}]}, "join[0] (m.csv).delimiter"),
    ({"categorical": [{"name": "g", "null_values": "none"}]}, "categorical[0] (g).null_values"),
])
def test_split_join_and_null_values_keys_are_validated_by_their_path(schema, path):
    base = {"label": "y", "time": "t", "categorical": ["u", "i", "g"]}
    with pytest.raises(SchemaError, match="schema key " + path.replace("[", r"\[").replace("]", r"\]")
                       .replace("(", r"\(").replace(")", r"\)")):
        parse_schema({**base, **schema})


def test_split_by_row_against_a_per_group_schema_is_refused(tmp_path):
    paths, _ = _log(tmp_path, files=1)
    schema = tmp_path / "s.yaml"
    schema.write_text(SCHEMA % "")
    one_error_line(["preprocess", "logs", "--schema", schema, "--input", paths[0], "--out", tmp_path / "o",
                    "--split-by", "row"], "--split-by row", "split.group")


def test_a_changed_side_table_is_a_changed_input_not_an_already_complete_dataset(tmp_path):
    from typer.testing import CliRunner

    from dlrmctl.cli import app

    paths, _ = _log(tmp_path, files=1)
    schema = tmp_path / "s.yaml"
    schema.write_text(SCHEMA % "")
    args = ["preprocess", "logs", "--schema", str(schema), "--input", str(paths[0]), "--out", str(tmp_path / "o"), "-q"]
    assert CliRunner().invoke(app, args).exit_code == 0
    assert "already complete" in CliRunner().invoke(app, args).output
    side = tmp_path / "items.csv"
    side.write_text(side.read_text().replace(",g1", ",g1|g9"))
    one_error_line(args, "holds another dataset", "items.csv")
    assert CliRunner().invoke(app, args + ["--force"]).exit_code == 0
    meta = json.loads((tmp_path / "o" / "meta.json").read_text())
    assert raw_ids(pa.array(["g9"]))[0] in _vocab(tmp_path / "o", meta, "tags").tolist()


@pytest.mark.parametrize("kind", ["parquet", "tsv", "jsonl"])
def test_a_parquet_tsv_or_json_lines_side_table_joins_as_the_csv_one(tmp_path, kind):
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    paths, _ = _log(tmp_path, files=1)
    schema = tmp_path / "s.yaml"
    schema.write_text(SCHEMA % "")
    preprocess_logs(load_schema(schema), str(paths[0]), tmp_path / "csv", progress=False)
    side = pcsv.read_csv(tmp_path / "items.csv", convert_options=pcsv.ConvertOptions(
        column_types={"item": pa.int64(), "tags": pa.string(), "price": pa.string()}))
    other = tmp_path / f"items.{kind}"
    if kind == "parquet":
        pq.write_table(side, other)
    elif kind == "tsv":
        other.write_text("item\ttitle\ttags\tprice\n" + "".join(
            f"{r['item']}\t{r['title']}\t{r['tags']}\t{r['price']}\n" for r in side.to_pylist()))
    else:
        other.write_text("".join(json.dumps(r) + "\n" for r in side.to_pylist()))
    schema.write_text((SCHEMA % "").replace("items.csv", other.name))
    preprocess_logs(load_schema(schema), str(paths[0]), tmp_path / kind, progress=False)
    a, b = _read(tmp_path / "csv", "train")[0], _read(tmp_path / kind, "train")[0]
    assert a.num_rows == b.num_rows > 0 and a.equals(b)
