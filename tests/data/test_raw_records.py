"""Raw rows as JSON objects (``RawTransformer.records``, serve's JSON rows): one column may mix JSON
kinds across rows, an absent key is a missing value, the required columns are named together."""

import json

import numpy as np
import pytest

from dlrmctl.data.columnar import DataError
from dlrmctl.data.logs import load_schema, preprocess_logs
from dlrmctl.data.logs.raw_transform import RawTransformer
from tests.data.test_logs import SCHEMA as LOGS_SCHEMA

SCHEMA = LOGS_SCHEMA + """  - {name: tags, multi: {delimiter: "|", max_len: 3}, vocab: {min_count: 1}}
"""  # and a multi-valued column


def _transformer(tmp_path, text=SCHEMA, header="id,click,ts,price,age,user,site,item,tags", row=None):
    row = row or (lambda i: f"{i},{i % 2},{1000 + i},{i % 9},{20 + i % 30},{i % 7},s{i % 5},{i % 11},t{i % 3}|t{i % 4}")
    (tmp_path / "s.yaml").write_text(text)
    (tmp_path / "log.csv").write_text(header + "\n" + "".join(row(i) + "\n" for i in range(60)))
    preprocess_logs(load_schema(tmp_path / "s.yaml"), tmp_path / "log.csv", tmp_path / "out", progress=False)
    return RawTransformer(json.loads((tmp_path / "out" / "meta.json").read_text()), tmp_path / "out")


def test_a_column_mixing_json_numbers_and_text_scores_as_its_csv_line(tmp_path):
    tr = _transformer(tmp_path)
    want = tr.lines([b"0,1,1000,5,40,3,s1,7,t1|t2", b"1,0,1001,2.5,,4,,8,t0"])
    rows = [{"price": 5, "age": "40", "user": 3, "site": "s1", "item": "7", "tags": ["t1", "t2"]},
            {"price": "2.5", "user": "4", "item": 8.0, "tags": "t0"}]  # age, site absent: missing values
    got = tr.records(rows)
    np.testing.assert_array_equal(got[0], want[0])
    for a, b in zip(got[1].ids, want[1].ids):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(got[1].lengths, want[1].lengths)
    assert got[2] is None
    rev = tr.records(rows[::-1])  # the other kind first
    np.testing.assert_array_equal(rev[0], got[0][::-1])


@pytest.mark.parametrize("rows, where", [
    ([{"user": 3, "price": 1}, {"user": 3, "price": "x"}], ":2: field price"),
    ([{"user": "u1"}, {"user": 1.5}], ":2: field user"),
    ([{"user": "u1"}, {"user": {"a": 1}}], ":2: field user"),
    ([{"user": "u1"}, {"user": True}], ":2: field user"),
])
def test_an_unconvertible_value_names_its_row_and_column(tmp_path, rows, where):
    tr = _transformer(tmp_path)
    with pytest.raises(DataError, match=where):
        tr.records(rows)


def test_all_the_absent_required_columns_are_named_in_one_message(tmp_path):
    text = ("label: click\ntime: ts\ndense:\n  - {name: year, fill: 2000}\n  - {name: age, years_since: year}\n"
            "categorical:\n  - {name: user, vocab: {min_count: 1}}\n")
    tr = _transformer(tmp_path, text, "click,ts,year,user", lambda i: f"{i % 2},{1_600_000_000 + i},{1990 + i % 9},u{i % 3}")
    got = tr.records([{"ts": 1_600_000_000}])  # year, user absent: missing values
    assert got[0].shape == (1, 2)
    with pytest.raises(DataError, match=r"column\(s\) 'ts' .*in no row"):
        tr.records([{"user": "u1", "year": 1999}])
