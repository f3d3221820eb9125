"""Derived dense features of ``preprocess logs`` (``count_of``, ``extract``, ``years_since``,
``fill: mean``): train-split counts looked up per row (val / test rows do not count), a number
extracted by a regex, a year difference, the train mean as the fill; raw rows (``predict`` /
``serve``) get the same values from the stored count table; the keys are validated by path."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from dlrmctl.data.logs import LogOptions, SchemaError, load_schema, parse_schema, preprocess_logs
from dlrmctl.data.logs.raw_transform import RawTransformer

SCHEMA = """
label: click
time: ts
join:
  - {path: items.csv, key: item, columns: [title]}
dense:
  - {name: pop, count_of: item, transform: log1p}
  - {name: act, count_of: user}
  - {name: year, extract: {column: title, pattern: '\\((\\d{4})\\)$'}, transform: standardize, fill: mean}
  - {name: age, years_since: year}
categorical:
  - {name: user, ids: raw}
  - {name: item, vocab: {min_count: 2}}
ignore: [rid]
"""


def _data(tmp_path):
    """20 rows over 4 users and 5 items; ts = 2000-01-01 + k years (UTC), so the time split puts the
    last 4 rows (k >= 16) in test; item 4 is only in test; items 2 and 4 have no year in the title."""
    rng = np.random.default_rng(3)
    user = rng.integers(0, 4, 20)
    item = np.concatenate([rng.integers(0, 4, 16), [4, 4, 1, 0]])
    years = np.arange(20) + 2000
    ts = [int(np.datetime64(f"{y}-01-01T00:00:00", "s").astype(np.int64)) for y in years]
    (tmp_path / "log.csv").write_text("rid,ts,user,item,click\n" + "".join(
        f"r{k},{ts[k]},{user[k]},{item[k]},{k % 2}\n" for k in range(20)))
    titles = {0: "A (1990)", 1: "B (2001)", 2: "C", 3: "D (1970)", 4: "E (soon)"}
    (tmp_path / "items.csv").write_text("item,title\n" + "".join(f'{i},"{t}"\n' for i, t in titles.items()))
    (tmp_path / "s.yaml").write_text(SCHEMA)
    return user, item, years, {0: 1990.0, 1: 2001.0, 3: 1970.0}


def test_counts_years_and_the_mean_fill_are_train_statistics_and_raw_rows_get_the_same(tmp_path):
    user, item, years, known = _data(tmp_path)
    out = tmp_path / "o"
    preprocess_logs(load_schema(tmp_path / "s.yaml"), tmp_path / "log.csv", out,
                    LogOptions(split_by="time", test_ratio=0.2), progress=False)
    meta = json.loads((out / "meta.json").read_text())
    train = np.arange(20) < 16
    mean = float(np.mean([known[i] for i in item[train] if i in known]))
    std = float(np.sqrt(np.mean([known[i] ** 2 for i in item[train] if i in known]) - mean ** 2))
    tr = meta["transforms"]["dense"]
    assert tr["year"]["mean"] == pytest.approx(mean, rel=1e-12) and tr["year"]["std"] == pytest.approx(std, rel=1e-9)
    assert tr["pop"]["computed_on"] == "train" and meta["vocab_files"]["count:pop"] == "vocab/count_pop.arrow"
    want = np.stack([
        np.log1p([(item[train] == i).sum() for i in item]),          # test rows of item 4 count for nothing
        [(user[train] == u).sum() for u in user],
        [(known[i] - mean) / std if i in known else 0.0 for i in item],  # fill: mean -> 0 once standardized
        [y - known.get(i, mean) for i, y in zip(item, years)],
    ], axis=1).astype(np.float32)
    got = {}
    for split in ("train", "val", "test"):
        for p in meta["splits"][split]["files"]:
            t = ipc.open_file(pa.memory_map(str(out / p))).read_all()
            for k, row in zip(t.column("item").to_numpy(), np.stack([t.column(n).to_numpy() for n in
                                                                      ("pop", "act", "year", "age")], axis=1)):
                got.setdefault(split, []).append(row)
    assert np.array_equal(np.concatenate([got["train"], got["test"]]), want)
    # raw rows: the count tables and the train statistics come from the dataset, not the inputs
    (tmp_path / "items.csv").unlink()
    dense, _ids, _labels = next(RawTransformer(meta, out).file(tmp_path / "log.csv"))
    assert np.array_equal(dense, want)


@pytest.mark.parametrize("dense,path", [
    ({"name": "p", "count_of": "nope"}, r"dense\[0\] \(p\).count_of: 'nope' is not a one-valued categorical"),
    ({"name": "p", "count_of": "h"}, r"dense\[0\] \(p\).count_of"),
    ({"name": "p", "count_of": "u", "transform": "standardize"}, r"dense\[0\] \(p\).transform"),
    ({"name": "p", "count_of": "u", "fill": 1}, r"dense\[0\] \(p\).fill"),
    ({"name": "p", "count_of": "u", "extract": {"column": "t", "pattern": "(1)"}}, r"dense\[0\] \(p\): give one of"),
    ({"name": "p", "extract": {"column": "t", "pattern": "\\d+"}}, r"dense\[0\] \(p\).extract.pattern: expected a group"),
    ({"name": "p", "extract": {"column": "t", "pattern": "(("}}, r"dense\[0\] \(p\).extract.pattern: not a regular"),
    ({"name": "p", "extract": {"col": "t"}}, r"dense\[0\] \(p\).extract.col: unknown key"),
    ({"name": "p", "years_since": "q"}, r"dense\[0\] \(p\).years_since"),
    ({"name": "p", "fill": "median"}, r"dense\[0\] \(p\).fill: expected a finite number"),
])
def test_derived_dense_keys_are_validated_by_their_path(dense, path):
    with pytest.raises(SchemaError, match="schema key " + path):
        parse_schema({"label": "y", "time": "t", "dense": [dense],
                      "categorical": [{"name": "u", "ids": "raw"}, {"name": "h", "hash": 10}]})


def test_a_derived_feature_is_not_a_column_of_the_file_and_round_trips_through_meta(tmp_path):
    _data(tmp_path)
    s = load_schema(tmp_path / "s.yaml")
    assert "pop" not in s.used_columns() and "age" not in s.used_columns() and "title" not in s.used_columns()
    assert type(s).from_dict(s.to_dict()).dense == s.dense
    plain = parse_schema({"label": "y", "dense": ["a"]}).to_dict()["dense"][0]
    assert set(plain) == {"name", "transform", "fill"}  # what a schema without the new keys recorded before


@pytest.mark.parametrize("extra,path", [
    ({"dense": [{"name": "pop", "count_of": "item"}], "categorical": ["item", "count_pop"]},
     r"categorical\[1\] \(count_pop\): its table vocab/count_pop.arrow is also the table of dense\[0\] \(pop\).count_of"),
    ({"dense": [{"name": "pop", "count_of": "item"}], "categorical": ["item", "Count_Pop"]},
     r"categorical\[1\] \(Count_Pop\): its table vocab/Count_Pop.arrow is also the table of dense\[0\] \(pop\)"),
    ({"join": [{"path": "t.csv", "key": "item", "columns": ["tag"], "many": {}}],
      "categorical": ["item", {"name": "tag", "multi": True}, "join_0_values"]},
     r"categorical\[2\] \(join_0_values\): its table vocab/join_0_values.arrow is also the table of join\[0\] "
     r"\(t.csv\).many"),
    ({"join": [{"path": "t.csv", "key": "item", "columns": ["kind"]}], "categorical": ["item", "kind", "join_0"]},
     r"categorical\[2\] \(join_0\): its table vocab/join_0.arrow is also the table of join\[0\] \(t.csv\)"),
])
def test_two_keys_writing_the_same_table_file_are_refused_naming_both(extra, path):
    with pytest.raises(SchemaError, match="schema key " + path):
        parse_schema({"label": "y", **extra})


def test_a_hashed_categorical_named_like_a_derived_table_writes_no_file_and_is_kept():
    s = parse_schema({"label": "y", "dense": [{"name": "pop", "count_of": "item"}],
                      "categorical": ["item", {"name": "count_pop", "hash": 10}]})
    assert [c.name for c in s.categorical] == ["item", "count_pop"]



@pytest.mark.parametrize("year", [{"transform": "log1p"}, {"transform": "log1p", "fill": "mean"},
                                  {"extract": {"column": "title", "pattern": "(\\d+)"}, "transform": "log1p"}])
def test_years_since_a_log1p_feature_is_refused(year):
    with pytest.raises(SchemaError, match=r"schema key dense\[1\] \(age\).years_since: 'year' \(dense\[0\]\) has "
                                          r"transform: log1p"):
        parse_schema({"label": "y", "time": "t", "dense": [{"name": "year", **year}, {"name": "age", "years_since": "year"}],
                      "categorical": ["u"]})


def test_a_hex_categorical_that_is_also_an_extract_column_is_read_as_text_for_both(tmp_path):
    (tmp_path / "log.csv").write_text("y,c\n" + "".join(f"{k % 2},{v}\n" for k, v in enumerate(
        ["0000001a", "00000022", "0000003f", "", "00000100"] * 4)))
    (tmp_path / "s.yaml").write_text("label: y\ndense:\n  - {name: n, extract: {column: c, pattern: '^([0-9]+)'}}\n"
                                     "categorical:\n  - {name: c, parse: hex, hash: 1000}\n")
    out = tmp_path / "o"
    preprocess_logs(load_schema(tmp_path / "s.yaml"), tmp_path / "log.csv", out, LogOptions(), progress=False)
    meta = json.loads((out / "meta.json").read_text())
    assert sum(meta["splits"][s]["rows"] for s in ("train", "val", "test")) == 20
    dense, got, _labels = next(RawTransformer(meta, out).file(tmp_path / "log.csv"))
    assert np.asarray(dense)[:5, 0].tolist() == [1.0, 22.0, 3.0, 0.0, 100.0]
    assert np.asarray(got)[:5, 0].tolist() == [0x1a % 999, 0x22 % 999, 0x3f % 999, 999, 0x100 % 999]


def test_an_extract_match_that_is_not_a_number_is_a_bad_row_named_by_its_line_or_skipped(tmp_path):
    from tests.conftest import one_error_line

    rows = [f"{k % 2},v{k}.5" for k in range(30)]
    rows[23] = "1,vab"  # line 25 of the file (after the header)
    rows[5] = "0,w7"  # no match: a missing value
    (tmp_path / "s.yaml").write_text("label: y\ndense:\n  - {name: n, extract: {column: x, pattern: '^v(.*)$'}}\n"
                                     "categorical:\n  - {name: c, hash: 10}\n")
    (tmp_path / "log.csv").write_text("y,x,c\n" + "\n".join(r + ",a" for r in rows) + "\n")
    one_error_line(["preprocess", "logs", "--schema", tmp_path / "s.yaml", "--input", tmp_path / "log.csv",
                    "--out", tmp_path / "o"], "log.csv:25", "x", "expected a number matched by the first group of "
                   "extract.pattern of 'n', got 'ab'")
    rep = preprocess_logs(load_schema(tmp_path / "s.yaml"), tmp_path / "log.csv", tmp_path / "s",
                          LogOptions(on_bad_line="skip"), progress=False)
    assert rep.bad_lines == 1 and sum(rep.rows.values()) == 29
