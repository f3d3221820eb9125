"""The train split's own out-of-vocabulary share per feature, from what an export carries, and
``predict``'s warning measured against it."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from dlrmctl.data.logs import load_schema, preprocess_logs
from dlrmctl.inference.predict import PredictReport
from dlrmctl.inference.train_oov import train_oov_shares

SCHEMA = """
label: click
categorical:
  - {name: ip, vocab: {min_count: 3}}
  - {name: site, vocab: {min_count: 2}}
  - {name: kind, vocab: {min_count: 1}}
"""


def _manifest(meta):
    """The ``preprocessing`` an export writes (the split rows left out, as the writer does)."""
    return {"preprocessing": {"sparse": meta["sparse_features"], "vocab_files": meta["vocab_files"],
                              "meta": {k: v for k, v in meta.items() if k not in ("splits", "vocab_files")}}}


def test_train_shares_are_what_the_train_split_maps_to_the_oov_row(tmp_path):
    rng = np.random.default_rng(0)
    rows = [f"{int(rng.random() < 0.2)},{int(rng.zipf(1.3)) if rng.random() < 0.9 else ''},"
            f"s{rng.integers(0, 40)},k{rng.integers(0, 4)}" for _ in range(600)]
    (tmp_path / "log.csv").write_text("click,ip,site,kind\n" + "".join(r + "\n" for r in rows))
    (tmp_path / "s.yaml").write_text(SCHEMA)
    preprocess_logs(load_schema(tmp_path / "s.yaml"), tmp_path / "log.csv", tmp_path / "out", progress=False)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    got = train_oov_shares(_manifest(meta), tmp_path / "out")
    train = pa.concat_tables(ipc.open_file(pa.memory_map(str(tmp_path / "out" / p))).read_all()
                             for p in meta["splits"]["train"]["files"])
    for sf in meta["sparse_features"]:
        want = float((train.column(sf["name"]).to_numpy() == sf["oov_id"]).mean())
        assert abs(got[sf["name"]] - want) < 1e-3, (sf["name"], got, want)
    assert got["ip"] > 0.2 and got["kind"] == 0.0  # a long tail under min_count; every value kept


def test_the_warning_compares_with_the_train_share_and_says_it():
    rep = PredictReport(10, False, None, "-", {"ip": [82, 100], "site": [60, 100]}, {"ip": 0.80})
    lines = rep.oov_warnings(0.5)
    assert len(lines) == 1 and lines[0].startswith(  # ip: 82% under the limit 80% + 20% x 0.5 = 90%
        "feature 'site': 60.0% of its 100 ids are out of the training vocabulary (the train split's own ids: "
        "0.0%; warned above 50%)")
    rep = PredictReport(10, False, None, "-", {"ip": [95, 100]}, {"ip": 0.80})
    assert rep.oov_warnings(0.5)[0].startswith("feature 'ip': 95.0% of its 100 ids are out of the training "
                                               "vocabulary (the train split's own ids: 80.0%; warned above 90%)")
