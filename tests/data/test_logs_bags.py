"""``join[].many``: a side table of many rows per key (tag events) aggregated into one bag per key,
counting only train-visible events (time <= the group's latest train time), normalised, kept by
``min_count``, capped by ``max_len`` (most frequent first, ties by value), in value order; the
kept values are the feature's vocabulary (``vocab: {from: join}``); raw rows get the stored bags;
the keys are validated by path."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from dlrmctl.data.ids import raw_ids
from dlrmctl.data.logs import LogOptions, SchemaError, load_schema, parse_schema, preprocess_logs
from dlrmctl.data.logs.raw_transform import RawTransformer

SCHEMA = """
label: click
time: ts
split: {by: time, group: user, tiebreak: item}
join:
  - {path: tags.csv, key: item, columns: [tag], many: {time: at, group: user, normalize: true, min_count: 2,
                                                      max_len: 2}}
categorical:
  - {name: user, vocab: {min_count: 1}}
  - {name: item, vocab: {min_count: 1}}
  - {name: tag, vocab: {from: join, order: value, oov: error}, multi: true}
"""


def _write(tmp_path):
    # users 1 and 2 rate items 10, 11 at times 1..4: with --test-ratio 0.5 each user's last 2 rows are test,
    # so user 1's latest train time is 2, user 2's is 20
    (tmp_path / "log.csv").write_text("user,item,ts,click\n" + "".join(
        f"{u},{i},{t},{t % 2}\n" for u, i, t in [(1, 10, 1), (1, 11, 2), (1, 10, 3), (1, 11, 4),
                                                (2, 10, 10), (2, 11, 20), (2, 10, 30), (2, 11, 40)]))
    (tmp_path / "tags.csv").write_text("user,item,tag,at\n" + "".join(f"{u},{i},{tag},{t}\n" for u, i, tag, t in [
        (1, 10, "Funny ", 1), (2, 10, "funny", 5), (2, 10, "dark", 6), (1, 10, "Dark", 2),
        (2, 10, "long  film", 7), (2, 10, "Long film", 8), (1, 10, "late", 3),   # user 1's time 3 is after train
        (2, 10, "late", 9), (3, 10, "stranger", 1), (3, 10, "stranger", 2),      # user 3 has no rating
        (2, 11, "funny", 10), (2, 11, "dark", 41), (2, 11, "dark", 21)]))        # 41, 21 > 20: not visible
    (tmp_path / "s.yaml").write_text(SCHEMA)


def test_many_rows_per_key_become_one_bag_of_train_visible_frequent_values(tmp_path):
    _write(tmp_path)
    out = tmp_path / "o"
    preprocess_logs(load_schema(tmp_path / "s.yaml"), tmp_path / "log.csv", out,
                    LogOptions(test_ratio=0.5), progress=False)
    meta = json.loads((out / "meta.json").read_text())
    vocab = ipc.open_file(pa.memory_map(str(out / meta["vocab_files"]["tag"]))).read_all()
    # counted: funny x3 (1@1, 2@5, 2@10), dark x2, long film x2, late x1 (user 1's is after train), stranger x0
    assert vocab.column("value").to_pylist() == raw_ids(pa.array(["dark", "funny", "long film"])).tolist()
    assert vocab.column("count").to_pylist() == [2, 3, 2]
    # item 10: dark 2, funny 2, long film 2 -> the 2 most frequent, ties by value: dark, funny; item 11: funny
    want = {"10": ["dark", "funny"], "11": ["funny"]}
    ids = {v: k for k, v in enumerate(vocab.column("value").to_pylist())}
    items = ipc.open_file(pa.memory_map(str(out / meta["vocab_files"]["item"]))).read_all().column("value").to_pylist()
    for split in ("train", "test"):
        t = ipc.open_file(pa.memory_map(str(out / meta["splits"][split]["files"][0]))).read_all()
        for item, bag in zip(t.column("item").to_pylist(), t.column("tag").to_pylist()):
            name = next(k for k in want if raw_ids(pa.array([k]))[0] == items[item])
            assert bag == [ids[k] for k in raw_ids(pa.array(want[name])).tolist()]
    f = {x["name"]: x for x in meta["sparse_features"]}["tag"]
    assert f["num_embeddings"] == 3 and f["max_pooling_factor"] == 2
    assert meta["joins"][0]["events_counted"] == 8 and meta["joins"][0]["keys_with_bags"] == 2
    # raw rows: the stored bags, without tags.csv
    (tmp_path / "tags.csv").unlink()
    _dense, got, _labels = next(RawTransformer(meta, out).file(tmp_path / "log.csv"))
    bags = np.split(got.ids[2], np.cumsum(got.lengths[2])[:-1])
    assert [len(b) for b in bags] == [2, 1, 2, 1, 2, 1, 2, 1]


@pytest.mark.parametrize("join,path", [
    ({"columns": ["tag", "x"], "many": {}}, r"join\[0\] \(t.csv\).many: a `many` side table brings one column"),
    ({"columns": ["tag"], "many": {"time": "at"}}, r"join\[0\] \(t.csv\).many.group: `time` and `group` go"),
    ({"columns": ["tag"], "many": {"min_count": 0}}, r"join\[0\] \(t.csv\).many.min_count"),
    ({"columns": ["tag"], "many": {"cap": 3}}, r"join\[0\] \(t.csv\).many.cap: unknown key"),
    ({"columns": ["tag"], "many": {"time": "at", "group": "item"}}, r"join\[0\] \(t.csv\).many.group: expected the split's"),
    ({"columns": ["tag"], "many": {}, "missing": "error"}, r"join\[0\] \(t.csv\).missing: a `many` side table gives"),
])
def test_many_keys_are_validated_by_their_path(join, path):
    with pytest.raises(SchemaError, match="schema key " + path):
        parse_schema({"label": "y", "time": "t", "split": {"by": "time", "group": "user"},
                      "join": [{"path": "t.csv", "key": "item", **join}],
                      "categorical": ["user", "item", {"name": "tag", "multi": True}]})


def test_from_join_on_a_column_neither_a_key_nor_a_bag_is_refused():
    with pytest.raises(SchemaError, match=r"categorical\[1\] \(tag\).vocab.from: 'tag' is not the key"):
        parse_schema({"label": "y", "join": [{"path": "t.csv", "key": "item", "columns": ["tag"]}],
                      "categorical": ["item", {"name": "tag", "vocab": {"from": "join"}, "multi": True}]})


@pytest.mark.parametrize("split,split_by", [("split: {by: time}\n", None), ("", "time")])
def test_bags_with_one_global_time_cut_split_by_time(tmp_path, split, split_by):
    # 8 rows at times 1..8: --val-ratio 0.25 --test-ratio 0.25 cuts at time 5 (val) and 7 (test)
    (tmp_path / "log.csv").write_text("user,item,ts,click\n" + "".join(
        f"{t % 2},{10 + t % 3},{t},{t % 2}\n" for t in range(1, 9)))
    (tmp_path / "tags.csv").write_text("item,tag\n10,a\n11,b\n10,c\n")
    (tmp_path / "s.yaml").write_text("label: click\ntime: ts\n" + split + (
        "join:\n  - {path: tags.csv, key: item, columns: [tag], many: {normalize: true}}\n"
        "categorical:\n  - {name: user, vocab: {min_count: 1}}\n  - {name: item, vocab: {min_count: 1}}\n"
        "  - {name: tag, vocab: {from: join}, multi: true}\n"))
    out = tmp_path / "o"
    preprocess_logs(load_schema(tmp_path / "s.yaml"), tmp_path / "log.csv", out,
                    LogOptions(split_by=split_by, val_ratio=0.25, test_ratio=0.25), progress=False)
    meta = json.loads((out / "meta.json").read_text())
    assert {s: meta["splits"][s]["rows"] for s in ("train", "val", "test")} == {"train": 4, "val": 2, "test": 2}
    assert meta["transforms"]["split"]["val_from"] == 5 and meta["transforms"]["split"]["test_from"] == 7
    t = ipc.open_file(pa.memory_map(str(out / meta["splits"]["train"]["files"][0]))).read_all()
    assert sorted(len(b) for b in t.column("tag").to_pylist()) == [0, 1, 1, 2]  # items 11, 12, 10, 11



@pytest.mark.parametrize("missing", [{}, {"missing": "empty"}])
def test_a_many_join_without_missing_error_gives_keys_without_events_an_empty_bag(missing):
    s = parse_schema({"label": "y", "join": [{"path": "t.csv", "key": "item", "columns": ["tag"], "many": {}, **missing}],
                      "categorical": ["item", {"name": "tag", "multi": True}]})
    assert s.join[0].missing == "empty"
