"""``vocab`` keys ``order: value``, ``from: join`` and ``oov: error`` of ``preprocess logs``: ids by
sorted value (integers numerically), a catalogue vocabulary from a side table's keys (a key never
seen in train keeps its row), no out-of-vocabulary rows (an unknown value is a bad row at
preprocess and in raw rows), and their schema keys validated by path."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from dlrmctl.data.columnar import DataError
from dlrmctl.data.ids import raw_ids
from dlrmctl.data.logs import LogOptions, SchemaError, load_schema, parse_schema, preprocess_logs
from dlrmctl.data.logs.raw_transform import RawTransformer
from dlrmctl.data.logs.vocab_rules import value_order
from tests.conftest import one_error_line

SCHEMA = """
label: click
join:
  - {path: items.csv, key: item, columns: [tags]}
categorical:
  - {name: user, vocab: {min_count: 1, order: value%s}}
  - {name: item, vocab: {from: join, order: %s, oov: error}}
  - {name: tags, vocab: {min_count: 1, order: value}, multi: {delimiter: "|"}}
ignore: [rid]
"""


def _write(tmp_path, users, items, clicks):
    p = tmp_path / "log.csv"
    p.write_text("rid,user,item,click\n" + "".join(f"r{k},{u},{i},{c}\n" for k, (u, i, c)
                                                     in enumerate(zip(users, items, clicks))))
    # a catalogue of 12 items: 3 of them (2, 7, 11) never in the log
    (tmp_path / "items.csv").write_text("item,tags\n" + "".join(
        f"{i},{'|'.join(sorted({f'z{i % 3}', f'a{i % 2}'}))}\n" for i in (10, 3, 11, 0, 5, 1, 2, 9, 4, 8, 6, 7)))
    return p


def _vocab(d, name):
    meta = json.loads((d / "meta.json").read_text())
    t = ipc.open_file(pa.memory_map(str(d / meta["vocab_files"][name]))).read_all()
    return t.column("value").to_numpy(), t.column("count").to_numpy(), meta


def _keys(values):
    return raw_ids(pa.array([str(v) for v in values])).tolist()


def test_value_order_sorts_integers_numerically_and_other_text_by_code_point():
    assert pa.array(["10", "9", "-3", "100"]).take(pa.array(value_order(pa.array(["10", "9", "-3", "100"])))) \
        .to_pylist() == ["-3", "9", "10", "100"]
    assert pa.array(["b", "a10", "a9", "B"]).take(pa.array(value_order(pa.array(["b", "a10", "a9", "B"])))) \
        .to_pylist() == ["B", "a10", "a9", "b"]
    assert value_order(pa.array([30, -1, 7])).tolist() == [1, 2, 0]


@pytest.mark.parametrize("item_order", ["value", "count"])
def test_ids_by_sorted_value_and_a_catalogue_vocabulary_from_the_side_table(tmp_path, item_order):
    rng = np.random.default_rng(0)
    users = rng.choice([9, 10, 100, 2, 33], 300)
    items = rng.choice([0, 1, 3, 4, 5, 6, 8, 9, 10], 300, p=[.3, .2, .1, .1, .1, .05, .05, .05, .05])
    log = _write(tmp_path, users, items, rng.integers(0, 2, 300))
    schema = tmp_path / "s.yaml"
    schema.write_text(SCHEMA % (", oov: error", item_order))
    out = tmp_path / "o"
    preprocess_logs(load_schema(schema), log, out, LogOptions(), progress=False)  # every row in train
    uv, uc, meta = _vocab(out, "user")
    iv, ic, _ = _vocab(out, "item")
    tv, _, _ = _vocab(out, "tags")
    # users in numeric order (not by text: "10" < "100" < "2" < "33" < "9"), with their train rows
    assert uv.tolist() == _keys([2, 9, 10, 33, 100])
    assert uc.tolist() == [int((users == u).sum()) for u in (2, 9, 10, 33, 100)]
    # items: every key of items.csv (2, 7, 11 never in the log), by value or by train count then key
    catalogue = [10, 3, 11, 0, 5, 1, 2, 9, 4, 8, 6, 7]
    counts = {i: int((items == i).sum()) for i in catalogue}
    if item_order == "value":
        assert iv.tolist() == _keys(sorted(catalogue))
    else:
        assert iv.tolist() == [k for _, k in sorted((-counts[i], _keys([i])[0]) for i in catalogue)]
    assert dict(zip(iv.tolist(), ic.tolist())) == {_keys([i])[0]: counts[i] for i in catalogue}
    # tags (a joined, multi-valued column): by text
    assert tv.tolist() == _keys(["a0", "a1", "z0", "z1", "z2"])
    t = ipc.open_file(pa.memory_map(str(out / meta["splits"]["train"]["files"][0]))).read_all()
    assert np.array_equal(uv[t.column("user").to_numpy()], raw_ids(pa.array([str(u) for u in users])))
    assert np.array_equal(iv[t.column("item").to_numpy()], raw_ids(pa.array([str(i) for i in items])))
    f = {x["name"]: x for x in meta["sparse_features"]}
    assert {n: x["num_embeddings"] for n, x in f.items()} == {"user": 5, "item": 12, "tags": 7}  # V; V + 2
    assert "missing_id" not in f["item"] and "oov_id" not in f["item"] and f["tags"]["oov_id"] == 5
    assert meta["transforms"]["sparse"]["item"]["from"].startswith("every key of the joined side table")
    assert meta["schema"]["categorical"][1]["vocab_from"] == "join"
    # raw rows (predict / serve) get the same ids
    _dense, ids, _labels = next(RawTransformer(meta, out).file(log))
    assert np.array_equal(ids.ids[0], t.column("user").to_numpy())
    assert np.array_equal(ids.ids[1], t.column("item").to_numpy())


def test_a_value_outside_an_oov_error_vocabulary_is_a_bad_row_at_preprocess_and_in_raw_rows(tmp_path):
    # user 77 rates only at the latest time: it is in test, not in the train vocabulary
    users, items = [1, 2, 1, 2, 1, 77], [0, 1, 3, 0, 1, 3]
    _write(tmp_path, [], [], [])  # items.csv
    log = tmp_path / "log.csv"
    log.write_text("t,rid,user,item,click\n" + "".join(f"{k},r{k},{u},{i},{k % 2}\n" for k, (u, i)
                                                       in enumerate(zip(users, items))))
    schema = tmp_path / "s.yaml"
    schema.write_text("time: t\n" + SCHEMA % (", oov: error", "value"))
    one_error_line(["preprocess", "logs", "--schema", schema, "--input", log, "--out", tmp_path / "o",
                    "--split-by", "time", "--test-ratio", "0.1", "-q"], f"{log}:7", "user", "oov: error")
    rep = preprocess_logs(load_schema(schema), log, tmp_path / "s", LogOptions(
        split_by="time", test_ratio=0.1, on_bad_line="skip"), progress=False)
    assert rep.rows == {"train": 5, "val": 0, "test": 0} and rep.bad_lines == 1
    # the default (oov: row): the out-of-vocabulary id, V
    schema.write_text("time: t\n" + SCHEMA % ("", "value"))
    preprocess_logs(load_schema(schema), log, tmp_path / "r", LogOptions(split_by="time", test_ratio=0.1),
                    progress=False)
    meta = json.loads((tmp_path / "r" / "meta.json").read_text())
    t = ipc.open_file(pa.memory_map(str(tmp_path / "r" / meta["splits"]["test"]["files"][0]))).read_all()
    assert t.column("user").to_pylist() == [2]
    # raw rows with an unknown user against the oov: error dataset: the row is named
    meta = json.loads((tmp_path / "s" / "meta.json").read_text())
    with pytest.raises(DataError, match=r"log.csv:7.*user"):
        list(RawTransformer(meta, tmp_path / "s").file(log))


@pytest.mark.parametrize("cat,path", [
    ({"name": "u", "vocab": {"order": "random"}}, r"categorical\[0\] \(u\).vocab.order"),
    ({"name": "u", "vocab": {"from": "side"}}, r"categorical\[0\] \(u\).vocab.from"),
    ({"name": "u", "vocab": {"from": "join"}}, r"categorical\[0\] \(u\).vocab.from: 'u' is not the key"),
    ({"name": "i", "vocab": {"from": "join", "min_count": 2}}, r"categorical\[0\] \(i\).vocab.min_count"),
    ({"name": "u", "vocab": {"oov": "drop"}}, r"categorical\[0\] \(u\).vocab.oov"),
    ({"name": "u", "vocab": {"sort": "value"}}, r"categorical\[0\] \(u\).vocab.sort: unknown key"),
])
def test_order_from_and_oov_keys_are_validated_by_their_path(cat, path):
    with pytest.raises(SchemaError, match="schema key " + path):
        parse_schema({"label": "y", "join": [{"path": "m.csv", "key": "i", "columns": ["g"]}], "categorical": [cat]})


def test_a_schema_without_the_new_keys_records_what_it_recorded_before():
    s = parse_schema({"label": "y", "categorical": ["a", {"name": "b", "vocab": {"order": "value"}}]})
    d = s.to_dict()
    assert "order" not in d["categorical"][0] and "oov" not in d["categorical"][0]
    assert d["categorical"][1]["order"] == "value"
    assert type(s).from_dict(d).categorical == s.categorical


@pytest.mark.parametrize("vocab,multi,want,not_want", [
    ({"min_count": 2}, False, ["min_count", "descending train count", "oov_id = V"], ["sorted values", "bad row"]),
    ({"order": "value"}, False, ["min_count", "sorted values", "oov_id = V"], ["descending"]),
    ({"oov": "error"}, False, ["descending train count", "bad row"], ["oov_id = V", "V + 1"]),
    ({"from": "join"}, False, ["every key of the joined side table", "descending train rows", "oov_id = V"],
     ["min_count"]),
    ({"from": "join", "order": "value", "oov": "error"}, False, ["every key", "sorted values", "bad row"],
     ["min_count", "descending", "oov_id = V", "V + 1"]),
    ({"from": "join", "oov": "error"}, True, ["kept", "descending counted events", "bad row"],
     ["min_count", "train count", "oov_id = V"]),
])
def test_the_vocabulary_formula_in_meta_is_built_from_the_column_s_rules(vocab, multi, want, not_want):
    from dlrmctl.data.logs.vocab_rules import describe

    join = {"path": "t.csv", "key": "item", "columns": ["tag"], **({"many": {}} if multi else {})}
    s = parse_schema({"label": "y", "join": [join], "categorical": [
        {"name": "item", **({} if multi else {"vocab": vocab})},
        {"name": "tag", "multi": True, **({"vocab": vocab} if multi else {})}]})
    d = describe(s.categorical[1 if multi else 0])
    text = " ".join(f"{k}: {v}" for k, v in d.items())
    assert d["mode"] == "vocab" and ("min_count" in d) == (vocab.get("from") != "join")
    for w in want:
        assert w in text, (w, d)
    for w in not_want:
        assert w not in text, (w, d)
