"""Issue 23 item 10: labels outside {0, 1} and NaN / inf dense values are refused where data enters
training and metrics, with one policy for columnar shards, raw Criteo TSV and the public metrics
functions (they were trained on silently, gave a negative log loss, or read `nan` as missing)."""

from __future__ import annotations

import shutil

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
from typer.testing import CliRunner

from dlrmctl.cli import app
from dlrmctl.data.checksums import record_checksums
from dlrmctl.data.columnar import DataError, read_meta
from dlrmctl.data.loader import BatchLoader
from dlrmctl.metrics import auc, compute_metrics, compute_metrics_from_logits, logloss

runner = CliRunner()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from dlrmctl.data.synthetic import generate_synthetic

    d = tmp_path_factory.mktemp("iv")
    generate_synthetic(d, rows=1500, seed=4, num_embeddings=[30] * 26)
    return d


def _poke(src, dst, split: str, column: str, row: int, value: float):
    """Copy the dataset ``src`` to ``dst`` with ``column[row] = value`` in the first shard of ``split``;
    returns that shard's path."""
    shutil.copytree(src, dst)
    meta = read_meta(dst)
    path = dst / meta["splits"][split]["files"][0]
    with pa.memory_map(str(path)) as f:
        t = ipc.open_file(f).read_all()
    cols = {n: t.column(n).to_numpy().copy() for n in t.schema.names}
    cols[column][row] = value
    t = pa.Table.from_arrays([pa.array(cols[n], type=t.schema.field(n).type) for n in t.schema.names], schema=t.schema)
    with ipc.new_file(str(path), t.schema) as w:
        w.write_table(t)
    record_checksums(dst)  # a planted value, not damage: meta.json records the new bytes
    return path


@pytest.mark.parametrize("value", [2.0, -1.0, 0.5, float("nan")])
@pytest.mark.parametrize("shuffle", [False, True])
def test_the_loader_refuses_a_bad_label_naming_shard_split_row_and_value(data, tmp_path, value, shuffle):
    shard = _poke(data, tmp_path / "d", "train", "label", 37, value)
    loader = BatchLoader(tmp_path / "d", "train", 128, shuffle=shuffle, prefetch=0)
    with pytest.raises(DataError) as ei:
        for _ in loader:
            pass
    msg = str(ei.value)
    assert msg.startswith(f"{shard}: field label: train split, row 37 of the shard"), msg
    assert repr(value) in msg and "must be 0 or 1" in msg


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("shuffle", [False, True])
def test_the_loader_refuses_a_non_finite_dense_value(data, tmp_path, value, shuffle):
    name = read_meta(data)["dense_features"][3]
    shard = _poke(data, tmp_path / "d", "val", name, 5, value)
    with pytest.raises(DataError) as ei:
        list(BatchLoader(tmp_path / "d", "val", 64, shuffle=shuffle, prefetch=2))
    msg = str(ei.value)
    assert msg.startswith(f"{shard}: field {name}: val split, row 5 of the shard"), msg
    assert "finite" in msg and repr(value) in msg


def test_good_data_passes_the_checks(data):
    assert sum(b.batch_size for b in BatchLoader(data, "train", 256, shuffle=True)) == read_meta(data)["splits"]["train"]["rows"]


def _train(data, runs, *extra):
    return runner.invoke(app, [
        "train", "configs/demo.yaml", "--set", f"data.path={data}", "--set", f"train.run_dir={runs}",
        "--set", "name=r", "--set", "train.progress=false", "--set", "data.batch_size=256", "--set",
        "train.max_steps=3", "--set", "model.compute_kernel=dense", *extra])


@pytest.mark.parametrize("column,value,what", [("label", 2.0, "must be 0 or 1"), ("I2", float("nan"), "finite")])
def test_dlrmctl_train_names_the_shard_of_a_bad_value_in_one_line(data, tmp_path, column, value, what):
    shard = _poke(data, tmp_path / "d", "train", column, 100, value)
    r = _train(tmp_path / "d", tmp_path / "runs")
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and "lower the learning rate" not in r.output
    lines = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and str(shard) in lines[0] and f"field {column}" in lines[0] and what in lines[0], r.output
    assert "row 100 of the shard" in lines[0]


def test_dlrmctl_train_on_unlabelled_data_is_refused_not_a_nan_loss(data, tmp_path):
    from dlrmctl.data.columnar import write_meta

    d = tmp_path / "d"
    shutil.copytree(data, d)
    meta = read_meta(d)
    meta["label"] = None
    write_meta(d, meta)
    r = _train(d, tmp_path / "runs")
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert "has no labels" in r.output and "lower the learning rate" not in r.output


@pytest.mark.parametrize("fn", [compute_metrics_from_logits, compute_metrics, auc, logloss])
@pytest.mark.parametrize("bad", [2.0, -1.0, 0.5, float("nan")])
def test_public_metrics_refuse_labels_outside_0_1(fn, bad):
    y = np.zeros(1000)
    y[::2] = 1.0
    y[[7, 500]] = bad
    with pytest.raises(ValueError, match=rf"labels must be 0 or 1: 2 of 1000 are not \(e\.g\. {bad!r} at index 7\)"):
        fn(np.full(1000, 0.3), y)
    fn(np.full(4, 0.3), np.array([0.0, 1.0, 1.0, 0.0]))  # 0 / 1 of any float dtype are fine
    fn(np.full(2, 0.3), np.array([True, False]))


def test_raw_criteo_nan_and_inf_dense_fields_are_refused_alike(tmp_path):
    """`nan` was read as a missing count (0) while `inf` was refused: both are now bad lines; only an
    empty field is missing."""
    from dlrmctl.data.criteo.parse import CriteoOptions
    from dlrmctl.data.criteo.preprocess import preprocess_criteo

    def line(dense):
        return "\t".join(["1", *dense, *(["0000000a"] * 26)]) + "\n"

    for v in ("nan", "NaN", "inf", "-inf"):
        f = tmp_path / v / "a.tsv"
        f.parent.mkdir()
        f.write_text(line(["1"] * 13) + line(["1", v] + [""] * 11))
        with pytest.raises(DataError, match=rf"a\.tsv:2: field I2: expected an integer, got '{v}' \(NaN / inf are "
                                            "refused, not read as missing"):
            preprocess_criteo(f, tmp_path / v / "out", CriteoOptions(num_embeddings=[10] * 26), progress=False)
        rep = preprocess_criteo(f, tmp_path / v / "skip", CriteoOptions(num_embeddings=[10] * 26, on_bad_line="skip"),
                                progress=False)
        assert rep.bad_lines == 1 and rep.rows["train"] == 1
    f = tmp_path / "empty.tsv"  # an empty field stays a missing value
    f.write_text(line([""] * 13))
    assert preprocess_criteo(f, tmp_path / "e", CriteoOptions(num_embeddings=[10] * 26), progress=False).rows["train"] == 1


def test_a_nan_label_or_weight_is_not_told_to_leave_the_field_empty(tmp_path):
    """The advice "leave the field empty for a missing value" is true of a dense field only: an
    empty label or weight is refused too, and the message says so."""
    from tests.conftest import one_error_line

    f = tmp_path / "a.tsv"
    f.write_text("\t".join(["nan"] + ["1"] * 13 + ["0000000a"] * 26) + "\n")
    line = one_error_line(["preprocess", "criteo", "--input", f, "--out", tmp_path / "o", "-q"],
                          "a.tsv:1: field label", "and so is an empty field")
    assert "leave the field empty" not in line
    schema = tmp_path / "s.yaml"
    schema.write_text("name: w\nlabel: click\ncategorical:\n  - {name: item, hash: 10, weights: w}\n")
    for row, field in (("nan,a,1", "click"), ("1,a,inf", "w")):
        log = tmp_path / f"{field}.csv"
        log.write_text("click,item,w\n1,b,2\n" + row + "\n")
        line = one_error_line(["preprocess", "logs", "--schema", schema, "--input", log, "--out", tmp_path / field,
                               "-q"], f"{field}.csv:3", f"field {field}", "and so is an empty field")
        assert "leave the field empty" not in line
