"""``dlrmctl preprocess logs``: schema validation, readers, transforms, splits and bad input, on small
logs written by the tests (CSV, TSV, Parquet, JSON lines)."""

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from dlrmctl.data.columnar import DataError
from dlrmctl.data.ids import hash_buckets, raw_id_of
from dlrmctl.data.logs import LogOptions, SchemaError, load_schema, parse_schema, preprocess_logs
from tests.conftest import one_error_line

SCHEMA = """
name: toy
label: click
time: ts
ignore: [id]
dense:
  - {name: price, transform: log1p, fill: 0}
  - {name: age, transform: standardize, fill: 30}
categorical:
  - {name: user, vocab: {min_count: 1}}
  - {name: site, hash: 97}
  - {name: item, ids: raw}
"""


def _csv(path, rows, header="id,click,ts,price,age,user,site,item"):
    path.write_text(header + "\n" + "".join(r + "\n" for r in rows))
    return path


def _rows(n=200, seed=0):
    rng = np.random.default_rng(seed)
    return [f"{i},{int(rng.random() < 0.3)},{1000 + i},{rng.integers(-5, 100)},{'' if i % 7 == 0 else rng.integers(18, 70)},"
            f"u{rng.integers(0, 20)},s{rng.integers(0, 50)},{rng.integers(0, 1000)}" for i in range(n)]


def _schema(tmp_path, text=SCHEMA, name="s.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def _read(d, split):
    with open(d / "meta.json") as f:
        meta = json.load(f)
    tabs = [ipc.open_file(pa.memory_map(str(d / p))).read_all() for p in meta["splits"][split]["files"]]
    return pa.concat_tables(tabs), meta


def test_csv_log_becomes_the_columnar_format_with_every_mode(tmp_path):
    src = _csv(tmp_path / "log.csv", _rows())
    schema = load_schema(_schema(tmp_path))
    rep = preprocess_logs(schema, src, tmp_path / "out", LogOptions(val_ratio=0.2, test_ratio=0.1), progress=False)
    assert sum(rep.rows.values()) == 200
    train, meta = _read(tmp_path / "out", "train")
    feats = {f["name"]: f for f in meta["sparse_features"]}
    assert meta["schema"]["name"] == "toy" and meta["dense_features"] == ["price", "age"]
    assert feats["site"]["num_embeddings"] == 97 and feats["item"]["ids"] == "raw"
    assert feats["user"]["num_embeddings"] == feats["user"]["distinct_train_values"] + 2
    # hash: the documented raw id mod buckets; raw: the raw id itself
    all_rows = {int(r.split(",")[2]): r.split(",") for r in _rows()}
    del all_rows
    t = train.to_pydict()
    assert max(t["site"]) < 97 and min(t["item"]) > 0
    src_rows = [r.split(",") for r in _rows()]
    items = {raw_id_of(r[7]) for r in src_rows}
    assert set(t["item"]) <= items
    sites = {int(hash_buckets(np.array([raw_id_of(r[6])]), 97)[0]) for r in src_rows}
    assert set(t["site"]) <= sites
    # log1p after clamping negatives; standardize with the train mean/std (missing -> fill first)
    assert min(t["price"]) == 0.0
    mean, std = meta["transforms"]["dense"]["age"]["mean"], meta["transforms"]["dense"]["age"]["std"]
    assert abs(np.mean(t["age"])) < 1e-4 and abs(np.std(t["age"]) - 1) < 1e-3 and std > 0 and mean > 18


def test_same_rows_as_parquet_and_json_lines_give_the_same_ids(tmp_path):
    rows = _rows(120)
    src = _csv(tmp_path / "log.csv", rows)
    schema = _schema(tmp_path)
    preprocess_logs(load_schema(schema), src, tmp_path / "a", progress=False)
    a, _ = _read(tmp_path / "a", "train")
    tab = pa.csv.read_csv(src) if hasattr(pa, "csv") else None
    import pyarrow.csv as pcsv

    tab = pcsv.read_csv(src, convert_options=pcsv.ConvertOptions(column_types={"user": pa.string(),
                                                                              "site": pa.string()}))
    pq.write_table(tab, tmp_path / "log.parquet", row_group_size=50)
    preprocess_logs(load_schema(schema), tmp_path / "log.parquet", tmp_path / "b", progress=False)
    b, _ = _read(tmp_path / "b", "train")
    with open(tmp_path / "log.jsonl", "w") as f:
        for r in tab.to_pylist():
            f.write(json.dumps(r) + "\n")
    preprocess_logs(load_schema(schema), tmp_path / "log.jsonl", tmp_path / "c", progress=False)
    c, _ = _read(tmp_path / "c", "train")
    for col in ("user", "site", "item", "price", "age", "label"):
        assert a[col].to_pylist() == b[col].to_pylist() == c[col].to_pylist(), col


def test_time_split_puts_the_latest_rows_in_test_and_val(tmp_path):
    src = _csv(tmp_path / "log.csv", _rows(300))
    preprocess_logs(load_schema(_schema(tmp_path)), src, tmp_path / "out",
                    LogOptions(val_ratio=0.1, test_ratio=0.2, split_by="time"), progress=False)
    _, meta = _read(tmp_path / "out", "train")
    assert meta["splits"]["test"]["rows"] == 60 and meta["splits"]["val"]["rows"] == 30
    assert meta["transforms"]["split"]["test_from"] == 1000 + 240


def test_multi_valued_weighted_parquet_column_becomes_weighted_bags(tmp_path):
    tags = [["a", "b", "c"], [], None, ["b"], ["a", "c", "d", "e", "f"]] * 20
    w = [[0.5, 1.0, 2.0], [], None, [3.0], [1.0] * 5] * 20
    tab = pa.table({"y": [i % 2 for i in range(100)], "tags": tags, "tw": w})
    pq.write_table(tab, tmp_path / "t.parquet")
    s = _schema(tmp_path, "label: y\ncategorical:\n  - {name: tags, vocab: {min_count: 1}, multi: {max_len: 4},"
                          " weights: tw}\n")
    preprocess_logs(load_schema(s), tmp_path / "t.parquet", tmp_path / "out", progress=False)
    t, meta = _read(tmp_path / "out", "train")
    f = meta["sparse_features"][0]
    assert f["multi_hot"] and f["weighted"] and f["max_pooling_factor"] == 4
    assert t.schema.field("tags").type == pa.list_(pa.int64())
    assert t.schema.field("tags__weight").type == pa.list_(pa.float32())
    lens = [len(x) for x in t["tags"].to_pylist()]
    assert lens == [len(x) for x in t["tags__weight"].to_pylist()] and set(lens) <= {0, 1, 3, 4}


def test_a_bad_weight_in_a_bag_is_named_by_its_line_or_its_row_skipped_and_counted(tmp_path):
    lines = ["y,g,gw"] + [f"{i % 2},a|b,0.5|1.5" for i in range(30)]
    lines[8] = "1,a|b,0.5|x"  # a weight that does not parse (line 9 of the file, after the header)
    lines[20] = "0,a|b|c,1|inf|2"  # a non-finite weight (line 21)
    src = tmp_path / "w.csv"
    src.write_text("\n".join(lines) + "\n")
    s = _schema(tmp_path, "label: y\ncategorical: [{name: g, vocab: {min_count: 1}, multi: {delimiter: '|'}, "
                          "weights: gw}]\n")
    with pytest.raises(DataError, match=r"w\.csv:9: field gw: expected a weight, got 'x'"):
        preprocess_logs(load_schema(s), src, tmp_path / "err", progress=False)
    rep = preprocess_logs(load_schema(s), src, tmp_path / "out", LogOptions(on_bad_line="skip"), progress=False)
    assert rep.bad_lines == 2 and sum(rep.rows.values()) == 28
    t, _ = _read(tmp_path / "out", "train")
    assert all(w == [0.5, 1.5] for w in t["g__weight"].to_pylist())


def test_delimited_multi_valued_text_column(tmp_path):
    src = tmp_path / "l.tsv"
    src.write_text("y\tg\n1\ta|b\n0\t\n1\tb\n")
    s = _schema(tmp_path, "label: y\ncategorical: [{name: g, vocab: {min_count: 1}, multi: {delimiter: '|'}}]\n")
    preprocess_logs(load_schema(s), src, tmp_path / "out", progress=False)
    t, meta = _read(tmp_path / "out", "train")
    assert [len(x) for x in t["g"].to_pylist()] == [2, 0, 1]
    assert meta["sparse_features"][0]["missing_fraction"] == pytest.approx(1 / 3)


def test_label_rule_makes_a_binary_label(tmp_path):
    src = tmp_path / "r.csv"
    src.write_text("rating,u\n5,a\n3,b\n4,a\n1,c\n")
    s = _schema(tmp_path, "label: {column: rating, positive: '>= 4'}\ncategorical: [{name: u, hash: 8}]\n")
    preprocess_logs(load_schema(s), src, tmp_path / "out", progress=False)
    t, _ = _read(tmp_path / "out", "train")
    assert t["label"].to_pylist() == [1.0, 0.0, 1.0, 0.0]


def test_skip_counts_bad_lines(tmp_path):
    rows = _rows(50)
    rows[3] = "3,1,1003,abc,20,u1,s1,5"  # dense value that does not parse
    rows[10] = "10,2,1010,1,20,u1,s1,5"  # label outside {0, 1}
    rows[20] = "20,1,1020,1,20,u1"  # too few fields
    src = _csv(tmp_path / "log.csv", rows)
    rep = preprocess_logs(load_schema(_schema(tmp_path)), src, tmp_path / "out",
                          LogOptions(on_bad_line="skip"), progress=False)
    assert rep.bad_lines == 3 and sum(rep.rows.values()) == 47


# ----------------------------------------------------------------------------- one error line at the CLI
def _cli(tmp_path, schema_text, src, *names, extra=()):
    s = _schema(tmp_path, schema_text, "bad.yaml")
    out = tmp_path / f"o{len(list(tmp_path.glob('o*')))}"
    return one_error_line(["preprocess", "logs", "--schema", s, "--input", src, "--out", out, "-q",
                           *extra], *names)


def test_schema_key_errors_name_the_key_path(tmp_path):
    src = _csv(tmp_path / "log.csv", _rows(5))
    _cli(tmp_path, SCHEMA.replace("ignore:", "ignroe:"), src, "bad.yaml", "ignroe", "did you mean 'ignore'")
    _cli(tmp_path, SCHEMA.replace("hash: 97", "hash: many"), src, "categorical[1] (site).hash", "'many'")
    _cli(tmp_path, SCHEMA.replace("transform: log1p", "transform: log"), src, "dense[0] (price).transform")
    _cli(tmp_path, SCHEMA.replace("label: click", "label: {column: click, positive: big}"), src, "label.positive")
    # a threshold of inf would make every label 0 without a word; a bucket count beyond int64 overflowed
    _cli(tmp_path, SCHEMA.replace("label: click", "label: {column: click, positive: '>= 1e999'}"), src,
         "label.positive", "finite")
    _cli(tmp_path, SCHEMA.replace("hash: 97", f"hash: {1 << 63}"), src, "categorical[1] (site).hash", "2^63 - 1")
    _cli(tmp_path, SCHEMA.replace("ignore: [id]", "ignore: [id, price]"), src, "ignore[1]", "price")
    _cli(tmp_path, "dense: 3\n", src, "bad.yaml", "dense", "expected a list")
    _cli(tmp_path, SCHEMA.replace("hash: 97", "hash: 1, parse: hex"), src, "categorical[1] (site).hash", ">= 2")


def test_bad_values_name_file_line_and_column(tmp_path):
    rows = _rows(20)
    rows[4] = "4,1,1004,12x,20,u1,s1,5"
    _cli(tmp_path, SCHEMA, _csv(tmp_path / "a.csv", rows), "a.csv:6", "price", "'12x'")
    rows = _rows(20)
    rows[2] = "2,3,1002,1,20,u1,s1,5"
    _cli(tmp_path, SCHEMA, _csv(tmp_path / "b.csv", rows), "b.csv:4", "click", "0 or 1")
    rows[2] = "2,1,1002,1,20,u1"
    _cli(tmp_path, SCHEMA, _csv(tmp_path / "c.csv", rows), "c.csv:4", "expected 8 CSV fields, got 6")


def test_missing_and_unnamed_columns_are_errors_naming_both(tmp_path):
    src = _csv(tmp_path / "m.csv", ["1,0,5,1,20,u,s"], header="id,click,ts,price,age,user,site")
    _cli(tmp_path, SCHEMA, src, "m.csv", "'item'", "bad.yaml")
    src = _csv(tmp_path / "x.csv", ["1,0,5,1,20,u,s,3,9"], header="id,click,ts,price,age,user,site,item,extra")
    _cli(tmp_path, SCHEMA, src, "x.csv", "'extra'", "ignore")


def test_empty_input_is_an_error(tmp_path):
    (tmp_path / "e.csv").write_text("")
    _cli(tmp_path, SCHEMA, tmp_path / "e.csv", "no rows")
    _cli(tmp_path, SCHEMA, _csv(tmp_path / "h.csv", []), "no rows")


def test_parquet_errors_name_row_group_and_row(tmp_path):
    tab = pa.table({"y": [0, 1] * 30, "u": ["a"] * 30 + ["b"] * 29 + ["c"], "x": ["1"] * 59 + ["oops"]})
    pq.write_table(tab, tmp_path / "p.parquet", row_group_size=20)
    _cli(tmp_path, "label: y\ndense: [x]\ncategorical: [u]\n", tmp_path / "p.parquet",
         "p.parquet: row group 2, row 19", "field x", "'oops'")


def test_parse_schema_fills_defaults():
    s = parse_schema({"label": "y", "defaults": {"categorical": {"hash": 10}},
                      "categorical": ["a", {"name": "b", "vocab": {"min_count": 2}}]})
    assert [(c.mode, c.buckets, c.min_count) for c in s.categorical] == [("hash", 10, 3), ("vocab", 0, 2)]
    with pytest.raises(SchemaError, match=r"categorical\[0\] \(a\): give one of"):
        parse_schema({"categorical": [{"name": "a", "hash": 3, "ids": "raw"}]})


# ----------------------------------------------------------------------------- Criteo as a schema
def test_criteo_schema_gives_the_rows_ids_splits_statistics_and_val_auc_of_preprocess_criteo(tmp_path):
    from dlrmctl.data.criteo import CriteoOptions, preprocess_criteo
    from tests.conftest import CRITEO_10K, require_shared

    src = require_shared(CRITEO_10K)
    preprocess_criteo(src, tmp_path / "c", CriteoOptions(val_ratio=0.15, test_ratio=0.15), progress=False)
    schema = load_schema("configs/schemas/criteo.yaml")
    preprocess_logs(schema, src, tmp_path / "l", LogOptions(val_ratio=0.15, test_ratio=0.15), progress=False)
    keys = ("name", "num_embeddings", "missing_id", "oov_id", "missing_fraction", "distinct_train_values",
            "mean_pooling_factor", "max_pooling_factor", "multi_hot")
    for split in ("train", "val", "test"):
        a, ma = _read(tmp_path / "c", split)
        b, mb = _read(tmp_path / "l", split)
        assert a.schema == b.schema and a.num_rows == b.num_rows > 0
        assert a.equals(b), split
        assert ma["ctr"] == mb["ctr"] and ma["splits"][split]["rows"] == mb["splits"][split]["rows"]
    assert [{k: f[k] for k in keys} for f in ma["sparse_features"]] == \
        [{k: f[k] for k in keys} for f in mb["sparse_features"]]
    for f in ma["vocab_files"]:
        va = ipc.open_file(pa.memory_map(str(tmp_path / "c" / ma["vocab_files"][f]))).read_all()
        vb = ipc.open_file(pa.memory_map(str(tmp_path / "l" / mb["vocab_files"][f]))).read_all()
        assert va.equals(vb), f
    # the same rows as Parquet (columns named label, I1.., C1..; one split: the row keys are the
    # file's rows, the split hash also keys on the file name) give the same ids and values
    import pyarrow.csv as pcsv

    names = list(schema.columns)
    tab = pcsv.read_csv(src, read_options=pcsv.ReadOptions(column_names=names),
                        parse_options=pcsv.ParseOptions(delimiter="\t", quote_char=False),
                        convert_options=pcsv.ConvertOptions(column_types={n: pa.string() for n in names[14:]}))
    pq.write_table(tab, tmp_path / "criteo.parquet", row_group_size=3000)
    # hashing (parse: hex, hash: N) gives the ids of preprocess criteo --num-embeddings N-1
    preprocess_criteo(src, tmp_path / "ch", CriteoOptions(num_embeddings=[99] * 26, val_ratio=0.15, test_ratio=0.15),
                      progress=False)
    hashed = dataclasses.replace(schema, categorical=tuple(dataclasses.replace(c, mode="hash", buckets=100)
                                                           for c in schema.categorical))
    preprocess_logs(hashed, src, tmp_path / "lh", LogOptions(val_ratio=0.15, test_ratio=0.15), progress=False)
    for split in ("train", "val", "test"):
        a, ma = _read(tmp_path / "ch", split)
        b, mb = _read(tmp_path / "lh", split)
        assert a.equals(b), split
    assert [f["num_embeddings"] for f in ma["sparse_features"]] == [f["num_embeddings"] for f in mb["sparse_features"]]
    # a model trained on either gets the same val AUC, bit for bit
    from tests.commands.test_cli_e2e import invoke

    auc = {}
    for d in ("c", "l"):
        invoke("train", "configs/criteo_sample.yaml", "--set", f"data.path={tmp_path / d}", "--set",
               f"train.run_dir={tmp_path / ('runs_' + d)}", "--set", "train.progress=false", "--set",
               "train.max_steps=20", "--set", "train.eval_every=20")
        auc[d] = json.loads(invoke("evaluate", tmp_path / ("runs_" + d) / "criteo_sample", "--split", "val",
                                   "--json").strip().splitlines()[-1])["auc"]
    assert auc["c"] == auc["l"] and 0.5 < auc["c"] < 1, auc
    preprocess_criteo(src, tmp_path / "c1", CriteoOptions(), progress=False)
    preprocess_logs(dataclasses.replace(schema, format="parquet"), tmp_path / "criteo.parquet",
                    tmp_path / "p", progress=False)
    a, _ = _read(tmp_path / "c1", "train")
    b, _ = _read(tmp_path / "p", "train")
    assert a.equals(b)


def test_two_workers_equal_one_and_a_rerun_resumes(tmp_path):
    (tmp_path / "in").mkdir()
    for i in range(3):
        _csv(tmp_path / "in" / f"day{i}.csv.gz".replace(".gz", ""), _rows(80, seed=i))
    import gzip

    raw = (tmp_path / "in" / "day2.csv").read_bytes()
    (tmp_path / "in" / "day2.csv").unlink()
    (tmp_path / "in" / "day2.csv.gz").write_bytes(gzip.compress(raw))  # compressed input, same rows
    schema = load_schema(_schema(tmp_path))
    opts = LogOptions(val_ratio=0.2, test_ratio=0.2)
    preprocess_logs(schema, tmp_path / "in", tmp_path / "one", opts, progress=False)
    rep = preprocess_logs(schema, str(tmp_path / "in" / "*"), tmp_path / "two",
                          dataclasses.replace(opts, workers=2), progress=False)
    assert rep.files_processed == 3 and sum(rep.rows.values()) == 240
    for split in ("train", "val", "test"):
        a, ma = _read(tmp_path / "one", split)
        b, mb = _read(tmp_path / "two", split)
        assert a.equals(b) and ma["sparse_features"] == mb["sparse_features"]
    again = preprocess_logs(schema, tmp_path / "in", tmp_path / "one", opts, progress=False)
    assert again.files_skipped == 3 and again.files_processed == 0 and again.rows == rep.rows


def test_raw_rows_of_a_headerless_schema_score_with_or_without_the_label(tmp_path):
    from dlrmctl.data.logs.raw_transform import RawTransformer

    s = _schema(tmp_path, "header: false\ncolumns: [y, x, u]\nformat: tsv\nlabel: y\n"
                          "dense: [{name: x, transform: standardize}]\ncategorical: [{name: u, vocab: {min_count: 1}}]\n")
    (tmp_path / "train.tsv").write_text("".join(f"{i % 2}\t{i}\tu{i % 5}\n" for i in range(40)))
    preprocess_logs(load_schema(s), tmp_path / "train.tsv", tmp_path / "out", progress=False)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    tr = RawTransformer(meta, tmp_path / "out")
    (tmp_path / "test.tsv").write_text("3\tu1\n7\tu9\n")  # no label column; u9 unseen -> the OOV id
    dense, ids, labels = next(tr.file(tmp_path / "test.tsv"))
    d2, i2, l2 = tr.lines([b"1\t3\tu1", b"0\t7\tu9"])
    assert labels is None and l2.tolist() == [1.0, 0.0]
    np.testing.assert_array_equal(ids, i2)
    np.testing.assert_array_equal(dense, d2)
    assert ids[1, 0] == meta["sparse_features"][0]["oov_id"]


def test_a_line_longer_than_a_block_is_named_by_its_line_or_skipped_and_counted(tmp_path):
    rows = _rows(300)
    rows[100] = rows[100].replace(",u", ",u" + "x" * 30_000)  # line 102 (after the header)
    src = _csv(tmp_path / "log.csv", rows)
    schema = load_schema(_schema(tmp_path))
    with pytest.raises(DataError, match=r"log.csv:102: a line of 20000 bytes or more"):
        preprocess_logs(schema, src, tmp_path / "e", LogOptions(block_size=20_000), progress=False)
    rep = preprocess_logs(schema, src, tmp_path / "s", LogOptions(block_size=20_000, on_bad_line="skip"),
                          progress=False)
    assert rep.bad_lines == 1 and sum(rep.rows.values()) == 299
    js = tmp_path / "log.jsonl"
    js.write_text("".join(json.dumps(dict(zip("id,click,ts,price,age,user,site,item".split(","), r.split(","))))
                          + "\n" for r in rows))
    with pytest.raises(DataError, match=r"log.jsonl:101: a line of 20000 bytes or more"):
        preprocess_logs(schema, js, tmp_path / "j", LogOptions(block_size=20_000), progress=False)


def test_a_utf8_bom_before_the_header_is_not_part_of_the_first_column(tmp_path):
    rows = _rows(50)
    src = tmp_path / "bom.csv"
    src.write_bytes(b"\xef\xbb\xbf" + _csv(tmp_path / "plain.csv", rows).read_bytes())
    schema = load_schema(_schema(tmp_path))
    rep = preprocess_logs(schema, src, tmp_path / "b", LogOptions(), progress=False)
    preprocess_logs(schema, tmp_path / "plain.csv", tmp_path / "p", LogOptions(), progress=False)
    assert sum(rep.rows.values()) == 50
    assert _read(tmp_path / "b", "train")[0].equals(_read(tmp_path / "p", "train")[0])
    js = tmp_path / "bom.jsonl"
    names = "id,click,ts,price,age,user,site,item".split(",")
    js.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(dict(zip(names, r.split(",")))) + "\n" for r in rows).encode())
    assert sum(preprocess_logs(schema, js, tmp_path / "j", LogOptions(), progress=False).rows.values()) == 50


def test_a_headerless_or_tab_separated_file_for_a_schema_with_a_header_is_one_clear_line(tmp_path):
    src = tmp_path / "nohead.csv"
    src.write_text("".join(r + "\n" for r in _rows(20)))
    _cli(tmp_path, SCHEMA, src, f"{src}:1: the first line is not a header", "`header: true`",
         "set `header: false`")
    # a tab-separated file read as CSV (its header one field): the tabs are named, as predict names them
    tabs = tmp_path / "tabs.csv"
    tabs.write_text("".join(line.replace(",", "\t") + "\n" for line in ["id,click,ts,price,age,user,site,item"]
                            + _rows(20)))
    _cli(tmp_path, SCHEMA, tabs, f"{tabs}:1: the first line is not a header",
         "it looks tab-separated, the schema reads ','-separated CSV", "`format` / `delimiter`")


def test_a_bad_json_line_is_named_by_its_line_in_any_block(tmp_path):
    names = "id,click,ts,price,age,user,site,item".split(",")
    rows = [json.dumps(dict(zip(names, r.split(",")))) for r in _rows(300)]
    schema = load_schema(_schema(tmp_path))
    for bad_at in (2, 250):  # in the first block, and in a later one
        bad = list(rows)
        bad[bad_at] = bad[bad_at][:-5]  # cut: not valid JSON
        js = tmp_path / f"bad{bad_at}.jsonl"
        js.write_text("\n".join(bad) + "\n")
        with pytest.raises(DataError, match=rf"bad{bad_at}.jsonl:{bad_at + 1}: bad JSON line"):
            preprocess_logs(schema, js, tmp_path / f"o{bad_at}", LogOptions(block_size=4096), progress=False)


def test_iso_8601_times_with_t_z_offsets_and_fractions_split_by_their_utc_instant(tmp_path):
    """`--split-by time` refused ISO 8601 times with `T`, `Z` or a UTC offset."""
    base = np.datetime64("2024-03-01T00:00:00")
    spellings = ["{}Z", "{}+00:00", "{}.250Z", "{}", "{}+0000"]
    rows, want = [], []
    for i, r in enumerate(_rows(100)):
        f = r.split(",")
        t = str(base + np.timedelta64(i * 60, "s"))  # 2024-03-01T00:01:00 ...
        if i % 7 == 3:  # the same instant written in another zone
            local = str(base + np.timedelta64(i * 60 + 7200, "s"))
            f[2] = local + "+02:00"
        else:
            f[2] = spellings[i % len(spellings)].format(t if i % 2 else t.replace("T", " "))
        rows.append(",".join(f))
        want.append(int((base + np.timedelta64(i * 60, "s")).astype("datetime64[s]").astype(np.int64)))
    src = _csv(tmp_path / "iso.csv", rows)
    rep = preprocess_logs(load_schema(_schema(tmp_path)), src, tmp_path / "out",
                          LogOptions(val_ratio=0.1, test_ratio=0.2, split_by="time"), progress=False)
    _, meta = _read(tmp_path / "out", "train")
    assert meta["splits"]["test"]["rows"] == 20 and meta["splits"]["val"]["rows"] == 10, meta["splits"]
    assert meta["transforms"]["split"]["test_from"] == want[80] and sum(rep.rows.values()) == 100


def test_a_time_column_of_mixed_kinds_names_the_line_that_differs(tmp_path):
    rows = _rows(30)
    ints = list(rows)
    ints[12] = ints[12].replace(",1012,", ",2024-01-02T03:04:05Z,")
    _cli(tmp_path, SCHEMA, _csv(tmp_path / "ints.csv", ints), "ints.csv:14: field ts: expected an integer time "
         "like line 2's", "'2024-01-02T03:04:05Z'", extra=("--split-by", "time"))
    iso = [r.replace(f",{1000 + i},", f",2024-01-02 03:{i:02d}:00,") for i, r in enumerate(_rows(30))]
    iso[5] = iso[5].replace(",2024-01-02 03:05:00,", ",1705,")
    iso[20] = iso[20].replace(",2024-01-02 03:20:00,", ",01/02/2024,")
    _cli(tmp_path, SCHEMA, _csv(tmp_path / "iso.csv", iso), "iso.csv:7: field ts: expected an ISO 8601 time like "
         "line 2's", extra=("--split-by", "time"))
    iso[5] = _rows(30)[5].replace(",1005,", ",2024-01-02 03:05:00,")
    _cli(tmp_path, SCHEMA, _csv(tmp_path / "iso.csv", iso), "iso.csv:22: field ts: expected an integer or an ISO "
         "8601 time", "'01/02/2024'", extra=("--split-by", "time"))


def test_a_short_raw_row_names_the_field_count_and_the_first_missing_column(tmp_path):
    """A raw row with too few fields (what `serve` gets in a request, one row or several, or a
    file's row; a request's line one field short is a line without the label) is refused naming
    the row, the field counts and the first missing column; a
    block whose only row is bad is refused too (it once came back as "parsed 0 of 1 rows")."""
    from dlrmctl.data.columnar import DataError
    from dlrmctl.data.logs.raw_transform import RawTransformer

    s = _schema(tmp_path, "header: false\ncolumns: [y, x, u, v]\nformat: csv\nlabel: y\n"
                          "dense: [{name: x}]\ncategorical: [{name: u, vocab: {min_count: 1}}, "
                          "{name: v, vocab: {min_count: 1}}]\n")
    (tmp_path / "train.csv").write_text("".join(f"{i % 2},{i},u{i % 5},v{i % 3}\n" for i in range(40)))
    preprocess_logs(load_schema(s), tmp_path / "train.csv", tmp_path / "out", progress=False)
    tr = RawTransformer(json.loads((tmp_path / "out" / "meta.json").read_text()), tmp_path / "out")
    with pytest.raises(DataError, match=r"^req:1: expected 4 CSV fields, got 2 \(the first missing: 'u'\)$"):
        tr.lines([b"1,3"], "req")
    with pytest.raises(DataError, match=r"^req:2: expected 4 CSV fields, got 2 \(the first missing: 'u'\)$"):
        tr.lines([b"1,3,u1,v1", b"0,7"], "req")  # (one field short is a line without the label, alone or not)
    (tmp_path / "short.csv").write_text("1,3,u1,v1\n1\n")
    with pytest.raises(DataError, match=r"short.csv:2: expected 4 CSV fields, got 1 \(the first missing: 'x'\)"):
        list(tr.file(tmp_path / "short.csv"))


def test_pass_two_from_pass_one_decoded_blocks_writes_what_parsing_again_writes(tmp_path, monkeypatch):
    import dlrmctl.data.logs.preprocess as logs_preprocess

    text = ("name: c\nlabel: click\ntime: ts\ndense:\n  - {name: price, transform: log1p}\n"
            "  - {name: age, transform: standardize, fill: 30}\ncategorical:\n"
            "  - {name: user, vocab: {min_count: 2}}\n  - {name: cat, parse: hex, vocab: {min_count: 1}}\n"
            "  - {name: site, parse: hex, hash: 101}\n"
            "  - {name: tags, vocab: {min_count: 1}, multi: {delimiter: '|', max_len: 2}, weights: tw}\n")
    rng = np.random.default_rng(3)
    rows = [f"{int(rng.random() < 0.3)},{1000 + i // 4},{rng.integers(-5, 100)},{'' if i % 7 == 0 else rng.integers(18, 70)},"
            f"u{rng.integers(0, 20)},{'' if i % 5 == 0 else format(int(rng.integers(0, 40)), '08x')},"
            f"{format(int(rng.integers(0, 2**32)), '08X')},t{i % 3}|t{i % 4}|t9,0.5|1|2" for i in range(300)]
    rows[40] = rows[40].replace(",u", ",x,u")  # one field too many: skipped
    rows[41] = rows[41].split(",", 1)[0] + ",zz," + rows[41].split(",", 2)[2]  # a bad time: skipped
    src = _csv(tmp_path / "log.csv", rows, header="click,ts,price,age,user,cat,site,tags,tw")
    schema = load_schema(_schema(tmp_path, text))
    opts = LogOptions(val_ratio=0.2, test_ratio=0.2, split_by="time", on_bad_line="skip", block_size=4096)
    rep = preprocess_logs(schema, src, tmp_path / "cached", opts, progress=False)
    assert rep.bad_lines == 2 and not (tmp_path / "cached" / ".counts").exists()
    monkeypatch.setattr(logs_preprocess, "read_cache", lambda *a: None)  # pass 2 parses the file again
    again = preprocess_logs(schema, src, tmp_path / "parsed", opts, progress=False)
    assert again.rows == rep.rows and again.bad_lines == 2
    for split in ("train", "val", "test"):
        a, ma = _read(tmp_path / "cached", split)
        b, mb = _read(tmp_path / "parsed", split)
        assert a.equals(b) and a.num_rows
        assert ma["sparse_features"] == mb["sparse_features"] and ma["transforms"] == mb["transforms"]


def test_a_time_column_mixing_dates_minutes_seconds_and_fractions_splits_at_the_cli(tmp_path):
    """A date-only time ("2024-03-01": its "-01" is the day, not a UTC offset) next to times with
    fractional seconds and zones in one column."""
    from typer.testing import CliRunner

    from dlrmctl.cli import app

    spellings = ["2024-03-{:02d}", "2024-03-{:02d}T00:00:00.250Z", "2024-03-{:02d} 00:00", "2024-03-{:02d}T02:00:00+02:00",
                 "2024-03-{:02d}T00:00:00.5", "2024-03-{:02d}T00:00:00-0000"]
    rows = []
    for i, r in enumerate(_rows(60)):
        f = r.split(",")
        f[2] = spellings[i % len(spellings)].format(1 + i // 6)  # day 1 + i // 6, midnight UTC (+ < 1 s)
        rows.append(",".join(f))
    src = _csv(tmp_path / "mixed.csv", rows)
    res = CliRunner().invoke(app, ["preprocess", "logs", "--schema", str(_schema(tmp_path)), "--input", str(src),
                                   "--out", str(tmp_path / "out"), "--split-by", "time", "--test-ratio", "0.2", "-q"])
    assert res.exit_code == 0, res.output
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    day9 = int(np.datetime64("2024-03-09", "s").astype(np.int64))
    assert meta["transforms"]["split"]["test_from"] == day9 and meta["splits"]["test"]["rows"] == 12
    assert meta["bad_lines_skipped"] == 0 and sum(meta["splits"][s]["rows"] for s in ("train", "val", "test")) == 60


# ----------------------------------------------------------------------------- JSON lines: every kind of bad line
_NAMES = "id,click,ts,price,age,user,site,item".split(",")


def _json_rows(n=40):
    return [dict(zip(_NAMES, r.split(","))) | {"item": int(r.split(",")[7])} for r in _rows(n)]


def _jsonl(path, objs):
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))
    return path


def _skip_cli(tmp_path, src):
    from typer.testing import CliRunner

    from dlrmctl.cli import app

    out = tmp_path / f"skip{len(list(tmp_path.glob('skip*')))}"
    res = CliRunner().invoke(app, ["preprocess", "logs", "--schema", str(_schema(tmp_path)), "--input", str(src),
                                   "--out", str(out), "--on-bad-line", "skip", "-q"])
    assert res.exit_code == 0, res.output
    meta = json.loads((out / "meta.json").read_text())
    return meta["bad_lines_skipped"], sum(meta["splits"][s]["rows"] for s in ("train", "val", "test"))


def test_json_lines_whose_key_changes_kind_or_holds_infinity_are_named_or_skipped_at_the_cli(tmp_path):
    cases = {  # line (1-based) -> the bad object, and what the error names
        "kind": (6, lambda o: o | {"user": 5}, ("field user", "key 'user': expected strings", "got an integer")),
        "inf": (9, lambda o: json.dumps(o)[:-1] + ', "price": Infinity}', ("bad JSON line", "Infinity")),
        "list": (3, lambda o: o | {"site": ["s1"]}, ("field site", "got a list")),
        "fraction": (7, lambda o: o | {"item": 12.5}, ("field item", "not a number with a fraction")),
    }
    for name, (line, make, names) in cases.items():
        objs = _json_rows()
        objs[line - 1] = make(objs[line - 1])
        src = _jsonl(tmp_path / f"{name}.jsonl", objs)
        _cli(tmp_path, SCHEMA, src, f"{name}.jsonl:{line}:", *names)
        assert _skip_cli(tmp_path, src) == (1, 39), name


def _small_blocks_error_then_skip(tmp_path, schema, src, match):
    """``src`` in 4 KiB blocks: the error ``match`` (``--on-bad-line error``), then the skip run's report."""
    with pytest.raises(DataError, match=match):
        preprocess_logs(schema, src, tmp_path / "e", LogOptions(block_size=4096), progress=False)
    return preprocess_logs(schema, src, tmp_path / "s", LogOptions(block_size=4096, on_bad_line="skip"), progress=False)


def test_json_lines_bad_in_a_later_block_keep_the_first_blocks_types_named_or_skipped(tmp_path):
    objs = _json_rows(300)
    objs[250] = objs[250] | {"item": "i250"}  # integers in the first blocks, a string here
    objs[260] = json.dumps(objs[260])[:-1] + ', "age": NaN}'
    objs[270] = objs[270] | {"item": 270.0}  # a number with a decimal point where integers were
    schema = load_schema(_schema(tmp_path))
    rep = _small_blocks_error_then_skip(tmp_path, schema, _jsonl(tmp_path / "late.jsonl", objs),
                                        r"late.jsonl:251: field item: key 'item': expected integers")
    assert rep.bad_lines == 3 and sum(rep.rows.values()) == 297
    # a raw-id column read as numbers (12.0 next to 12.5 in one block): a whole number is the integer's id
    floats = _json_rows()
    for o in floats:
        o["item"] = float(o["item"])
    floats[0]["item"] = 0.5
    rep = preprocess_logs(schema, _jsonl(tmp_path / "f.jsonl", floats), tmp_path / "f", LogOptions(on_bad_line="skip"),
                          progress=False)
    ints = preprocess_logs(schema, _jsonl(tmp_path / "i.jsonl", _json_rows()[1:]), tmp_path / "i", progress=False)
    assert rep.bad_lines == 1 and rep.rows["train"] == ints.rows["train"] == 39
    assert _read(tmp_path / "f", "train")[0].column("item").equals(_read(tmp_path / "i", "train")[0].column("item"))


def test_json_keys_absent_or_unnamed_on_some_lines_follow_one_rule_at_the_cli(tmp_path):
    objs = _json_rows()
    objs[4] = objs[4] | {"note": "a key the schema does not name: ignored"}
    del objs[7]["price"]  # a used column absent from one line: a missing value (its fill)
    src = _jsonl(tmp_path / "keys.jsonl", objs)
    assert _skip_cli(tmp_path, src) == (0, 40)
    no_label = [dict(o) for o in objs]
    del no_label[8]["click"]  # the label absent from a line: a bad row, named
    _cli(tmp_path, SCHEMA, _jsonl(tmp_path / "nolabel.jsonl", no_label), "nolabel.jsonl:9:", "click")
    nowhere = [{k: v for k, v in o.items() if k != "site"} for o in objs]
    _cli(tmp_path, SCHEMA, _jsonl(tmp_path / "nosite.jsonl", nowhere), "nosite.jsonl", "column 'site'",
         "in no line")


def test_a_json_line_longer_than_a_block_is_named_by_its_line_or_skipped_and_counted(tmp_path):
    objs = _json_rows(200)
    objs[120] = objs[120] | {"user": "u" + "x" * 6000}
    rep = _small_blocks_error_then_skip(tmp_path, load_schema(_schema(tmp_path)), _jsonl(tmp_path / "long.jsonl", objs),
                                        r"long.jsonl:121: a line of 4096 bytes or more")
    assert rep.bad_lines == 1 and sum(rep.rows.values()) == 199


def test_raw_lines_with_and_without_the_label_follow_one_rule_alone_and_batched(tmp_path):
    from dlrmctl.data.logs.raw_transform import RawTransformer

    s = _schema(tmp_path, "header: false\ncolumns: [x, y, u, v]\nformat: csv\nlabel: y\n"
                          "dense: [x]\ncategorical: [{name: u, vocab: {min_count: 1}}, {name: v, hash: 50}]\n")
    (tmp_path / "train.csv").write_text("".join(f"{i},{i % 2},u{i % 5},\"v,{i}\"\n" for i in range(40)))
    preprocess_logs(load_schema(s), tmp_path / "train.csv", tmp_path / "out", progress=False)
    tr = RawTransformer(json.loads((tmp_path / "out" / "meta.json").read_text()), tmp_path / "out")
    full, short, quoted_short = b'3,1,u1,"v,3"', b'7,u2,"v,7"', b'5,u4,"v,5"'
    alone = [tr.lines([ln]) for ln in (full, short, quoted_short)]
    mixed = tr.lines([full, short, quoted_short])
    np.testing.assert_array_equal(mixed[0], np.concatenate([a[0] for a in alone]))
    np.testing.assert_array_equal(mixed[1], np.concatenate([a[1] for a in alone]))
    assert alone[0][2].tolist() == [1.0] and alone[1][2] is None and mixed[2] is None
    for lines, at in (([b"7,u2"], 1), ([full, b"7,u2"], 2)):  # two fields short: the same error alone and batched
        with pytest.raises(DataError, match=rf"<lines>:{at}: expected 4 CSV fields, got 2 \(the first missing: 'u'\)"):
            tr.lines(lines)


def test_the_vocabulary_lookup_maps_each_key_to_its_id_and_refuses_a_repeated_key():
    from dlrmctl.data.logs.vocab_lookup import VocabLookup

    rng = np.random.default_rng(0)
    keys = rng.choice(np.arange(-10**12, 10**12, 7919), 5000, replace=False)
    vl = VocabLookup(keys)
    probe = np.concatenate([keys, [10**15, -3]])
    assert vl.lookup(probe).tolist() == list(range(5000)) + [5000, 5000]
    for dup in ([5, 5], [5, 7, 5], list(keys[:100]) + [keys[37]]):  # same round, later round
        with pytest.raises(ValueError, match="duplicate vocabulary value"):
            VocabLookup(np.array(dup))
