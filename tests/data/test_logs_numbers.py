"""``preprocess logs``: dense CSV / TSV columns read as numbers by the parser give what reading them
as text gives (values, missing values, bad rows named or skipped), in any block."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

import dlrmctl.data.logs.read as logs_read
from dlrmctl.data.columnar import DataError
from dlrmctl.data.logs import LogOptions, load_schema, preprocess_logs
from dlrmctl.data.logs.read import iter_batches

SCHEMA = """
label: click
dense:
  - {name: price, transform: log1p}
  - {name: age, transform: standardize, fill: 30}
  - {name: score, transform: none, fill: -1}
categorical:
  - {name: user, vocab: {min_count: 1}}
  - {name: site, hash: 97}
"""
HEADER = "click,price,age,score,user,site"


def _rows(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    spelled = ["7", " 5", "6\t", '"8"', "1.5", "-3", "1e3", "", "+.5", "00012", '""', "-0"]
    return [f"{int(rng.random() < 0.3)},{spelled[i % len(spelled)]},{'' if i % 7 == 0 else rng.integers(18, 70)},"
            f"{rng.normal():.4f},u{rng.integers(0, 20)},s{rng.integers(0, 50)}" for i in range(n)]


def _write(path, rows):
    path.write_text(HEADER + "\n" + "".join(r + "\n" for r in rows))
    return path


def _outputs(d):
    meta = json.loads((d / "meta.json").read_text())
    tabs = {s: pa.concat_tables([ipc.open_file(pa.memory_map(str(d / p))).read_all() for p in meta["splits"][s]["files"]])
            for s in ("train", "val", "test")}
    for k in ("rows_per_s", "inputs"):
        meta.pop(k, None)
    return tabs, meta


def _schema(tmp_path):
    (tmp_path / "s.yaml").write_text(SCHEMA)
    return load_schema(tmp_path / "s.yaml")


def _set(rows, i, column, value):
    fields = rows[i].split(",")
    fields[HEADER.split(",").index(column)] = value
    rows[i] = ",".join(fields)


def _as_text(monkeypatch):
    monkeypatch.setattr(logs_read, "_number_columns", lambda schema: set())


LATER = {100: ("short", None), 150: ("price", "NaN"), 260: ("age", "12x"), 300: ("score", "inf"), 330: ("short", None)}


@pytest.mark.parametrize("bad", [{}, LATER, {**LATER, 3: ("price", "Infinity")}])
def test_dense_columns_read_as_numbers_write_what_reading_them_as_text_writes(tmp_path, monkeypatch, bad):
    rows = _rows(400)
    for i, (col, value) in bad.items():  # bad values in the first block and in later ones
        if col == "short":
            rows[i] = rows[i].rsplit(",", 1)[0]
        else:
            _set(rows, i, col, value)
    src = _write(tmp_path / "log.csv", rows)
    schema = _schema(tmp_path)
    opts = LogOptions(val_ratio=0.2, on_bad_line="skip", block_size=1024)  # ~30 rows a block
    numbers = preprocess_logs(schema, src, tmp_path / "numbers", opts, progress=False)
    keys = np.concatenate([b.keys for b in iter_batches(src, schema, "skip", 1024)])
    assert (np.diff(keys) > 0).all()  # no row is given twice when a later block is read again as text
    _as_text(monkeypatch)
    text = preprocess_logs(schema, src, tmp_path / "text", opts, progress=False)
    assert numbers.rows == text.rows and numbers.bad_lines == text.bad_lines == len(bad)
    assert sum(numbers.rows.values()) == 400 - len(bad)
    a, ma = _outputs(tmp_path / "numbers")
    b, mb = _outputs(tmp_path / "text")
    assert ma == mb
    for split in a:
        assert a[split].equals(b[split]), split
    if not bad:  # " 5", "6<TAB>" and '"8"' are the numbers 5, 6 and 8
        price = np.concatenate([a[s]["price"].to_numpy() for s in a])
        assert {round(float(np.expm1(x)), 2) for x in price} == {7, 5, 6, 8, 1.5, 0, 1000, 0.5, 12}


def test_dense_columns_reach_the_transform_as_float64_until_a_bad_value(tmp_path):
    rows = _rows(200)
    src = _write(tmp_path / "log.csv", rows)
    schema = _schema(tmp_path)
    types = {b.columns["price"].type for b in iter_batches(src, schema, "error", 1024)}
    assert types == {pa.float64()}
    _set(rows, 120, "price", "nan")
    src = _write(tmp_path / "bad.csv", rows)
    got = list(iter_batches(src, schema, "skip", 1024))
    assert got[0].columns["price"].type == pa.float64() and got[-1].columns["price"].type == pa.string()
    keys = np.concatenate([b.keys for b in got])  # from the block of line 122 on, read again as text
    assert keys.tolist() == list(range(2, 202)) and sum(b.bad_skipped for b in got) == 0


@pytest.mark.parametrize("line,value,shown", [(3, "NaN", "'NaN'"), (250, "12x", "'12x'"), (320, "-Infinity", "'-Infinity'"),
                                              (330, " ", "' '")])
def test_a_bad_dense_value_in_any_block_is_named_by_its_line_and_its_text(tmp_path, line, value, shown):
    rows = _rows(400)
    _set(rows, line - 2, "price", value)
    src = _write(tmp_path / "log.csv", rows)
    schema = _schema(tmp_path)
    with pytest.raises(DataError) as e:
        preprocess_logs(schema, src, tmp_path / "out", LogOptions(block_size=1024), progress=False)
    assert str(e.value).startswith(f"{src}:{line}: field price: expected a number") and shown in str(e.value)
