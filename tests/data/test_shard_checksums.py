"""Dataset shards carry checksums: preprocess records each file's size and SHA-256 in meta.json;
training, evaluation and the data fingerprint check refuse a shard whose bytes changed (a flipped
bit of a label or a dense value), naming the file; an edited meta.json whose paths leave the
dataset, or whose rows are not counts, is one error line."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from dlrmctl.data.checksums import meta_files, record_checksums, sha256_file
from dlrmctl.data.columnar import DataError, open_split
from tests.conftest import one_error_line


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from typer.testing import CliRunner

    from dlrmctl.cli import app

    d = tmp_path_factory.mktemp("sums") / "d"
    r = CliRunner().invoke(app, ["preprocess", "synthetic", "--rows", "600", "--out", str(d)])
    assert r.exit_code == 0, r.output
    return d


def _flip(path, offset_from_end=64):
    b = bytearray(path.read_bytes())
    b[len(b) // 2] ^= 0x01  # inside the record batches: a value, not the Arrow framing
    path.write_bytes(bytes(b))


def _config(tmp_path, data):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"name": "s", "data": {"path": str(data), "batch_size": 64, "prefetch": 0},
                                 "train": {"run_dir": str(tmp_path / "runs"), "max_steps": 2, "progress": False}}))
    return p


def test_preprocess_records_every_files_size_and_sha256(data):
    meta = json.loads((data / "meta.json").read_text())
    assert sorted(meta["checksums"]) == sorted(meta_files(meta)) and len(meta["checksums"]) == 3
    for rel, rec in meta["checksums"].items():
        assert rec == {"bytes": (data / rel).stat().st_size, "sha256": sha256_file(data / rel)}


def test_a_flipped_bit_in_a_shard_is_refused_by_train_and_the_reader(data, tmp_path):
    d = tmp_path / "d"
    shutil.copytree(data, d)
    val = d / "parts" / "synthetic" / "val.arrow"
    _flip(val)
    one_error_line(["train", _config(tmp_path, d)], str(val), "SHA-256", "re-run preprocessing")
    with pytest.raises(DataError, match="SHA-256"):
        open_split(d, "val")
    (d / "parts" / "synthetic" / "train.arrow").write_bytes(b"short")
    with pytest.raises(DataError, match="5 bytes, but meta.json records"):
        open_split(d, "train")


def test_resume_and_evaluate_refuse_a_run_whose_shards_changed(data, tmp_path):
    from typer.testing import CliRunner

    from dlrmctl.cli import app

    d = tmp_path / "d"
    shutil.copytree(data, d)
    cfg = _config(tmp_path, d)
    r = CliRunner().invoke(app, ["train", str(cfg)])
    assert r.exit_code == 0, r.output
    val = d / "parts" / "synthetic" / "val.arrow"
    _flip(val)
    one_error_line(["evaluate", tmp_path / "runs" / "s"], str(val), "SHA-256")
    one_error_line(["train", cfg, "--resume", "--set", "train.max_steps=3"], str(val), "SHA-256")
    record_checksums(d)  # a deliberate edit, recorded: the data is now other data than the run's
    one_error_line(["evaluate", tmp_path / "runs" / "s"], "not the data the model was trained on")


@pytest.mark.parametrize("edit,needle", [
    (lambda m: m["splits"]["train"].update(files=["../../../etc/passwd"]), "not a path inside the dataset"),
    (lambda m: m["splits"]["train"].update(files=["/etc/passwd"]), "not a path inside the dataset"),
    (lambda m: m["splits"]["val"].update(rows=-5), "splits.val.rows must be an integer >= 0"),
    (lambda m: m["splits"]["val"].update(rows="many"), "splits.val.rows must be an integer >= 0"),
    (lambda m: m.update(splits=[1, 2]), "'splits' must be an object"),
    (lambda m: m.update(checksums={"x": 5}), "'checksums' must map each file"),
])
def test_an_edited_meta_json_is_one_line(data, tmp_path, edit, needle):
    d = tmp_path / "d"
    shutil.copytree(data, d)
    meta = json.loads((d / "meta.json").read_text())
    edit(meta)
    (d / "meta.json").write_text(json.dumps(meta))
    one_error_line(["train", _config(tmp_path, d)], str(d / "meta.json"), needle)


def test_export_refuses_a_flipped_vocabulary_file_or_parity_shard_and_writes_nothing(tmp_path):
    """export copies the vocabularies into the artifact and scores the val split: their bytes are
    checked against meta.json's checksums before the checkpoint is read."""
    from typer.testing import CliRunner

    from dlrmctl.cli import app

    rows = "".join("\t".join([str(i % 2)] + [str(i % 5)] * 13 + [f"{i % 7:08x}"] * 26) + "\n" for i in range(400))
    (tmp_path / "raw.tsv").write_text(rows)
    d = tmp_path / "d"
    r = CliRunner().invoke(app, ["preprocess", "criteo", "--input", str(tmp_path / "raw.tsv"), "--out", str(d),
                                 "--frequency-threshold", "1", "--val-ratio", "0.2", "-q"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["train", str(_config(tmp_path, d))])
    assert r.exit_code == 0, r.output
    meta = json.loads((d / "meta.json").read_text())
    vocab = d / next(iter(meta["vocab_files"].values()))
    val = d / meta["splits"]["val"]["files"][0]
    for f in (vocab, val):
        keep = f.read_bytes()
        _flip(f)
        one_error_line(["export", tmp_path / "runs" / "s", "--fp32", "--out", tmp_path / "m"], str(f), "SHA-256")
        assert not (tmp_path / "m").exists()
        f.write_bytes(keep)
