"""Issue 14 item 2: evaluate, export, predict and --resume check a fingerprint of the data's schema,
vocabularies and split, and refuse a mismatch naming both fingerprints' sources."""

import json
import re
import shutil

import pytest
from typer.testing import CliRunner

from dlrmctl.cli import app
from dlrmctl.data.fingerprint import DataMismatchError, check_same_data, data_fingerprint
from tests.conftest import SHARED_DATA, require_shared

RAW = SHARED_DATA / "criteo" / "criteo_kaggle_sample_100.tsv"
runner = CliRunner()


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_fingerprint_parts_follow_schema_vocabulary_and_split():
    meta = {"format_version": 1, "dataset": "criteo", "dense_features": ["I1"], "label": "label",
            "sparse_features": [{"name": "C1", "num_embeddings": 10, "multi_hot": False, "oov_id": 8,
                                 "mean_pooling_factor": 1.0}],
            "splits": {"train": {"rows": 80, "files": ["a"]}, "val": {"rows": 20, "files": ["b"]}},
            "ctr": {"train": 0.25, "val": 0.2},
            "transforms": {"sparse": {"frequency_threshold": 3}, "split": {"val_ratio": 0.2, "seed": 0}},
            "inputs": ["/somewhere/train.txt"], "rows_per_s": 1e5}
    fp = data_fingerprint(meta)
    # where the input came from and how fast it was read are not part of the data's identity
    assert data_fingerprint({**meta, "inputs": ["/elsewhere/x"], "rows_per_s": 3.0}) == fp
    other = json.loads(json.dumps(meta))
    other["sparse_features"][0]["num_embeddings"] = 7
    assert data_fingerprint(other)["vocabulary"] != fp["vocabulary"]
    assert data_fingerprint(other)["schema"] == fp["schema"] and data_fingerprint(other)["split"] == fp["split"]
    other = json.loads(json.dumps(meta))
    other["transforms"]["split"]["val_ratio"] = 0.5
    assert data_fingerprint(other)["split"] != fp["split"] and data_fingerprint(other)["vocabulary"] == fp["vocabulary"]
    other = json.loads(json.dumps(meta))
    other["dense_features"] = ["I1", "I2"]
    assert data_fingerprint(other)["schema"] != fp["schema"]
    with pytest.raises(DataMismatchError) as e:
        check_same_data(meta, "run/data_meta.json", other, "new/meta.json")
    msg = str(e.value)
    assert "new/meta.json is not the data the model was trained on" in msg and "schema differs" in msg
    assert f"{fp['all']} (run/data_meta.json)" in msg and f"{data_fingerprint(other)['all']} (new/meta.json)" in msg


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The 100-line Criteo sample preprocessed with val ratio 0.3 and a short run on it; plus the
    same lines preprocessed with val ratio 0.5 (different vocabularies and split)."""
    require_shared(RAW)
    from dlrmctl.data.criteo.parse import CriteoOptions
    from dlrmctl.data.criteo.preprocess import preprocess_criteo

    root = tmp_path_factory.mktemp("fp")
    data, other = root / "data", root / "other"
    preprocess_criteo(RAW, data, CriteoOptions(frequency_threshold=2, val_ratio=0.3), progress=False)
    preprocess_criteo(RAW, other, CriteoOptions(frequency_threshold=2, val_ratio=0.5), progress=False)
    r = cli("train", "configs/criteo_sample.yaml", "--set", f"data.path={data}", "--set", f"train.run_dir={root}",
            "--set", "name=r", "--set", "train.progress=false", "--set", "data.batch_size=16",
            "--set", "train.eval_every=0", "--set", "model.compute_kernel=dense", "--set", "train.checkpoint_every=2",
            "--set", "train.max_steps=4")
    assert r.exit_code == 0, r.output
    return root, data, other, root / "r"


def _refused(r, given, recorded):
    out = r.stderr.strip()  # (stdout: the verb's step lines before the refusal)
    assert r.exit_code == 2 and len(out.splitlines()) == 1 and "Traceback" not in r.output, r.output
    assert f"{given} is not the data the model was trained on" in out, out
    fps = re.findall(r"([0-9a-f]{12}(?:/[0-9a-f]{12})?) \(([^)]*)", out.split("data fingerprints ")[1])
    assert [src for _, src in fps] == [str(recorded), str(given)], out  # both fingerprints, both sources
    assert fps[0][0] != fps[1][0]
    return out


def test_raw_id_features_share_one_id_space_whatever_the_day_s_distinct_count():
    meta = {"format_version": 1, "dataset": "criteo", "dense_features": ["I1"], "label": "label",
            "sparse_features": [{"name": "C1", "num_embeddings": 10, "multi_hot": False, "ids": "raw"}],
            "splits": {}, "transforms": {"sparse": {"mode": "raw"}}}
    next_day = json.loads(json.dumps(meta))
    next_day["sparse_features"][0]["num_embeddings"] = 17  # informational: the day's distinct raw ids
    assert data_fingerprint(next_day) == data_fingerprint(meta)
    index = json.loads(json.dumps(meta))
    del index["sparse_features"][0]["ids"]
    assert data_fingerprint(index)["schema"] != data_fingerprint(meta)["schema"]


def test_evaluate_refuses_other_data_naming_both_sources(run):
    _, data, other, r = run
    out = _refused(cli("evaluate", r, "--data", other), other / "meta.json", r / "data_meta.json")
    assert "vocabulary differs" in out and "split differs" in out and re.search(r"C\d+: \d+ vs \d+ rows", out)
    # the same check when the run's own data directory was re-preprocessed in place (the case)
    saved = data.parent / "saved"
    shutil.copytree(data, saved)
    try:
        shutil.rmtree(data)
        shutil.copytree(other, data)
        _refused(cli("evaluate", r), data / "meta.json", r / "data_meta.json")
    finally:
        shutil.rmtree(data)
        shutil.move(str(saved), str(data))
    assert cli("evaluate", r).exit_code == 0


def test_any_split_still_refuses_other_vocabularies(run):
    _, _, other, r = run
    out = _refused(cli("evaluate", r, "--data", other, "--any-split"), other / "meta.json", r / "data_meta.json")
    assert "vocabulary differs" in out and "split differs" not in out


def test_resume_on_other_data_is_refused(run):
    root, _, other, _ = run
    r = cli("train", "configs/criteo_sample.yaml", "--set", f"data.path={other}", "--set", f"train.run_dir={root}",
            "--set", "name=r", "--resume")
    _refused(r, other / "meta.json", root / "r" / "data_meta.json")
    # before any rank of a --nproc run starts, too
    r = cli("train", "configs/criteo_sample.yaml", "--set", f"data.path={other}", "--set", f"train.run_dir={root}",
            "--set", "name=r", "--resume", "--nproc", "2")
    _refused(r, other / "meta.json", root / "r" / "data_meta.json")


def test_export_and_the_exported_model_check_the_data(run, tmp_path):
    from dlrmctl import HAS_FBGEMM

    if not HAS_FBGEMM:
        pytest.skip("export needs fbgemm_gpu")
    _, data, other, r = run
    res = cli("export", r, "--fp32", "--data", other, "--out", tmp_path / "bad")
    _refused(res, other / "meta.json", r / "data_meta.json")
    assert not (tmp_path / "bad").exists()
    res = cli("export", r, "--fp32", "--out", tmp_path / "m")
    assert res.exit_code == 0, res.output
    manifest = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert manifest["data"]["fingerprint"] == data_fingerprint(json.loads((data / "meta.json").read_text()))
    # evaluate MODEL_DIR: the manifest's record against the data given
    assert cli("evaluate", tmp_path / "m", "--data", data).exit_code == 0
    out = _refused(cli("evaluate", tmp_path / "m", "--data", other), other / "meta.json",
                   f"{tmp_path / 'm' / 'manifest.json'} (recorded from {r / 'data_meta.json'}")
    assert "vocabulary differs" in out
    # predict: the artifact's vocabularies are the exported ones
    assert cli("predict", tmp_path / "m", "--input", RAW, "--output", tmp_path / "s.csv").exit_code == 0
    (tmp_path / "m" / "vocab" / "C1.arrow").write_bytes((other / "vocab" / "C1.arrow").read_bytes())
    res = cli("predict", tmp_path / "m", "--input", RAW, "--output", tmp_path / "s2.csv")
    out = res.output.strip()
    assert res.exit_code == 2 and len(out.splitlines()) == 1, out
    assert str(tmp_path / "m" / "vocab" / "C1.arrow") in out and "manifest.json" in out and "re-export" in out
    assert not (tmp_path / "s2.csv").exists()
