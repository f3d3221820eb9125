"""The drifting click log (preprocess synthetic-drift): each day alone is reproducible, ids are born
and retire at the documented rate, popularity moves, modulo ids are the raw ids' buckets."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
from typer.testing import CliRunner

from dlrmctl.cli import app
from dlrmctl.data.columnar import is_raw_feature, read_meta
from dlrmctl.data.drifting import DriftOptions, generate_drifting_day
from dlrmctl.data.ids import raw_ids


def _col(d, split, name):
    meta = read_meta(d)
    return np.concatenate([ipc.open_file(pa.memory_map(str(d / f))).read_all().column(name).to_numpy()
                           for f in meta["splits"][split]["files"]])


def test_a_day_is_the_same_generated_alone_and_ids_are_born_and_retire_at_the_churn_rate(tmp_path):
    o = DriftOptions(rows=6000, features=2, signal=1, alive=300, churn=0.2, seed=5)
    for k in (0, 3):
        generate_drifting_day(tmp_path / f"d{k}", k, o)
    generate_drifting_day(tmp_path / "again", 3, o)
    assert np.array_equal(_col(tmp_path / "d3", "train", "C1"), _col(tmp_path / "again", "train", "C1"))
    m3 = read_meta(tmp_path / "d3")
    assert m3["drift"]["ever_seen_per_feature"] == 300 + 3 * 60 and is_raw_feature(m3["sparse_features"][0])
    assert 0.5 < m3["bayes_auc"] < 1.0
    day0 = set(_col(tmp_path / "d0", "train", "C1").tolist())
    day3 = set(_col(tmp_path / "d3", "train", "C1").tolist())
    born = set(raw_ids(np.arange(301, 481)).tolist())  # ids 301..480 were born on days 1..3
    assert day3 & born and not day0 & born
    assert len(day0 - day3) > 0.3 * 300 * (1 - 0.8 ** 3)  # retired ids never come back


def test_modulo_ids_are_the_raw_ids_buckets_and_the_day_is_otherwise_identical(tmp_path):
    generate_drifting_day(tmp_path / "raw", 1, DriftOptions(rows=2000, alive=100, seed=2))
    generate_drifting_day(tmp_path / "mod", 1, DriftOptions(rows=2000, alive=100, seed=2, modulo=77))
    assert np.array_equal(_col(tmp_path / "raw", "train", "C3") % 77, _col(tmp_path / "mod", "train", "C3"))
    assert np.array_equal(_col(tmp_path / "raw", "val", "label"), _col(tmp_path / "mod", "val", "label"))
    assert read_meta(tmp_path / "mod")["sparse_features"][2]["num_embeddings"] == 77


@pytest.mark.parametrize("args,match", [(["--churn", "1.5"], "--churn must be in"), (["--signal", "9"], "--signal"),
                                        (["--day", "-1"], "--day")])
def test_bad_options_are_one_line_naming_the_option(tmp_path, args, match):
    r = CliRunner().invoke(app, ["preprocess", "synthetic-drift", "--out", str(tmp_path / "o"), "--day", "0", *args])
    assert r.exit_code == 2 and match in r.output


def test_a_long_replay_and_a_large_day_report_progress(tmp_path, capsys):
    """`--day 400` replayed 400 days for a minute without a word: the replay and the drawing of
    each feature are reported (here a line per update)."""
    o = DriftOptions(rows=2000, features=3, signal=2, alive=50)
    generate_drifting_day(tmp_path / "d", 5, o, progress=True, progress_every_s=1e-9)
    out = capsys.readouterr()
    text = out.out + out.err
    assert "synthetic-drift: replaying days 0-4: day 5/5 (100%)" in text, text
    assert "synthetic-drift: drawing 2,000 rows of day 5: feature 3/3 (100%)" in text, text
    generate_drifting_day(tmp_path / "q", 5, o)  # progress=False: silent
    out = capsys.readouterr()
    assert out.out + out.err == ""
