"""dlrmctl.data.columnar.parts: a part appears whole or not at all; resume finds only a part made
the same way; the meta.json fields the parts add up to."""

import json

import numpy as np
import pyarrow.ipc as ipc
import pytest

from dlrmctl.data.columnar import LABEL_COLUMN, SPLITS, shard_schema
from dlrmctl.data.columnar.parts import (DONE_FILE, PartBuild, finished_part, fingerprint, part_fingerprint, parts_meta,
                                         split_rows)

SCHEMA = shard_schema(["I1"], ["C1"], [False])


def _rows(n, start=0):
    return {LABEL_COLUMN: np.ones(n, np.float32), "I1": np.arange(start, start + n, dtype=np.float32),
            "C1": np.arange(n, dtype=np.int64)}


def test_a_committed_part_holds_every_split_and_its_done_json(tmp_path):
    with PartBuild(tmp_path, "day_0", SCHEMA) as build:
        build.writers["train"].write(_rows(3))
        build.restart()  # what was written before is dropped
        build.writers["train"].write(_rows(2, start=10))
        build.writers["val"].write(_rows(1))
        build.commit({"fingerprint": "abc", "rows": {"train": 2, "val": 1, "test": 0}})
    part = tmp_path / "parts" / "day_0"
    assert sorted(p.name for p in part.iterdir()) == sorted([DONE_FILE] + [f"{s}.arrow" for s in SPLITS])
    assert not (tmp_path / "parts" / "day_0.tmp").exists()
    train = ipc.open_file(str(part / "train.arrow")).read_all()
    assert train.column("I1").to_pylist() == [10.0, 11.0]
    assert finished_part(tmp_path, "day_0", "abc")["rows"]["val"] == 1


@pytest.mark.parametrize("stop", [RuntimeError("disk"), KeyboardInterrupt()])
def test_a_part_left_by_an_error_or_an_interrupt_leaves_nothing_and_keeps_the_older_part(tmp_path, stop):
    with PartBuild(tmp_path, "p", SCHEMA) as build:
        build.commit({"fingerprint": "old"})
    with pytest.raises(type(stop)):
        with PartBuild(tmp_path, "p", SCHEMA) as build:
            build.writers["test"].write(_rows(4))
            raise stop
    assert not (tmp_path / "parts" / "p.tmp").exists()
    assert finished_part(tmp_path, "p", "old") is not None


def test_finished_part_needs_the_same_fingerprint_and_readable_json(tmp_path):
    assert finished_part(tmp_path, "p", "fp") is None  # no part
    with PartBuild(tmp_path, "p", SCHEMA) as build:
        build.commit({"fingerprint": "fp"})
    assert finished_part(tmp_path, "p", "other") is None
    (tmp_path / "parts" / "p" / DONE_FILE).write_text("{not json")
    assert finished_part(tmp_path, "p", "fp") is None


def test_a_part_fingerprint_follows_the_file_version_and_the_fields(tmp_path):
    f = tmp_path / "in.tsv"
    f.write_text("a\n")
    fp = part_fingerprint(f, {"seed": 0})
    assert fp == part_fingerprint(f, {"seed": 0}) and len(fp) == 16
    assert fp != part_fingerprint(f, {"seed": 1})
    f.write_text("ab\n")
    assert fp != part_fingerprint(f, {"seed": 0})
    assert fingerprint({"a": 1, "b": 2}) == fingerprint({"b": 2, "a": 1})  # canonical JSON


def test_parts_meta_adds_up_the_parts_in_meta_json_order(tmp_path):
    files = [tmp_path / "a.tsv", tmp_path / "b.tsv"]
    stats = {files[0]: {"rows": {"train": 3, "val": 1, "test": 0}, "positives": {"train": 1, "val": 1, "test": 0},
                        "bad_lines": 2},
             files[1]: {"rows": {"train": 1, "val": 0, "test": 0}, "positives": {"train": 1, "val": 0, "test": 0},
                        "bad_lines": 0}}
    assert split_rows(files, stats) == {"train": 4, "val": 1, "test": 0}
    meta = parts_meta(files, stats, True, {"dataset": "x", "dense_features": []}, {"transforms": {}})
    assert list(meta) == ["format_version", "dataset", "dense_features", "label", "splits", "ctr", "transforms",
                          "inputs", "bad_lines_skipped"]
    assert meta["splits"]["train"] == {"rows": 4, "files": ["parts/a.tsv/train.arrow", "parts/b.tsv/train.arrow"]}
    assert meta["ctr"] == {"train": 0.5, "val": 1.0, "test": None}
    assert meta["bad_lines_skipped"] == 2 and meta["label"] == LABEL_COLUMN
    unlabelled = parts_meta(files, stats, False, {}, {})
    assert unlabelled["label"] is None and set(unlabelled["ctr"].values()) == {None}
    json.dumps(meta)
