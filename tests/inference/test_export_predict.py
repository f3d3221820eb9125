"""End to end on the real Criteo sample: preprocess -> train -> `dlrmctl export` -> `dlrmctl predict`
on raw lines -> `dlrmctl evaluate MODEL_DIR`, through the CLI.

Proves that predict applies exactly the training preprocessing (vocabularies included, read from
the artifact alone) and that the exported model's metrics match the run's.
"""

import csv
import shutil

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from dlrmctl import HAS_FBGEMM

from tests.conftest import SHARED_DATA, OnDevice, require_shared

pytestmark = pytest.mark.skipif(not HAS_FBGEMM, reason="export needs fbgemm_gpu")

RAW = SHARED_DATA / "criteo" / "criteo_kaggle_sample_100.tsv"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run trained for one short epoch on the 100-line sample (vocabulary mode, threshold 2)."""
    require_shared(RAW)
    from dlrmctl.cli import app
    from dlrmctl.data.criteo.parse import CriteoOptions
    from dlrmctl.data.criteo.preprocess import preprocess_criteo

    root = tmp_path_factory.mktemp("e2e")
    data = root / "data"
    preprocess_criteo(RAW, data, CriteoOptions(frequency_threshold=2, val_ratio=0.3), progress=False)
    cfg = {
        "name": "tiny",
        "data": {"path": str(data), "batch_size": 16, "eval_batch_size": 64, "prefetch": 0},
        "model": {"embedding_dim": 8, "dense_arch_layer_sizes": [16, 8], "over_arch_layer_sizes": [16, 1]},
        "optimizer": {"embedding": {"lr": 0.05}, "dense": {"lr": 0.02}},
        "train": {"epochs": 1, "run_dir": str(root / "runs"), "progress": False, "pipeline": "none", "device": "cpu"},
    }
    (root / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    r = CliRunner().invoke(app, ["train", str(root / "tiny.yaml")])
    assert r.exit_code == 0, r.output
    return root, data, root / "runs" / "tiny"


def _cli(*args):
    from dlrmctl.cli import app

    r = CliRunner().invoke(app, [str(a) for a in args])
    return r


def test_export_predict_evaluate_through_the_cli(run, tmp_path):
    from dlrmctl.data.criteo.raw_transform import transform_raw_file
    from dlrmctl.data.loader import BatchLoader
    from dlrmctl.inference.export import load_exported

    root, data, run_dir = run
    r = _cli("export", run_dir, "--int8", "--out", tmp_path / "m")
    assert r.exit_code == 0, r.output
    assert "int8 (26 tables" in r.output
    assert sorted(p.name for p in (tmp_path / "m" / "vocab").iterdir())[:2] == ["C1.arrow", "C10.arrow"]

    # the artifact is self-contained: predict works with the training data moved away
    moved = root / "data_moved"
    shutil.move(str(data), str(moved))
    try:
        r = _cli("predict", tmp_path / "m", "--input", RAW, "--output", tmp_path / "scores.csv")
        assert r.exit_code == 0, r.output
        assert r.output.splitlines()[0] == "predict: running model.pt2 (torch.export program) on cpu"
        assert "scored 100 lines" in r.output
    finally:
        shutil.move(str(moved), str(data))
    with open(tmp_path / "scores.csv") as f:
        rows = list(csv.DictReader(f))
    # a row number (the input line's), the label (the input has one) and the score
    assert len(rows) == 100 and list(rows[0]) == ["row", "label", "score"]
    assert [int(x["row"]) for x in rows] == list(range(1, 101))
    assert [x["label"] for x in rows] == [line.split("\t")[0] for line in RAW.read_text().splitlines()]
    pred = np.array([float(x["score"]) for x in rows], dtype=np.float32)
    assert ((pred > 0) & (pred < 1)).all()

    # same preprocessing as training: every preprocessed val row is some raw line, transformed identically,
    # and predict's score of that line equals the artifact's score of the preprocessed row
    meta = __import__("json").loads((data / "meta.json").read_text())
    (dense_raw, ids_raw, _), = list(transform_raw_file(RAW, meta, data, batch_rows=1000))
    m = load_exported(tmp_path / "m")
    batch = next(iter(BatchLoader(data, "val", 1000, shuffle=False, features=m.feature_names, prefetch=0)))
    ids_val = batch.sparse_features.values().view(26, -1).t().numpy()
    matched = 0
    for i in range(batch.batch_size):
        hit = np.flatnonzero((ids_raw == ids_val[i]).all(1) & np.isclose(dense_raw, batch.dense_features[i].numpy()).all(1))
        assert len(hit) >= 1, f"val row {i} matches no raw line: preprocessing differs"
        matched += 1
        want = float(m.score_kjt(batch.dense_features[i:i + 1], _one(batch.sparse_features, i))[0])
        assert abs(float(pred[hit[0]]) - want) <= 1e-6
    assert matched == batch.batch_size > 10

    # evaluate on the exported model == evaluate on the run (int8: within 1e-3 AUC on 30 rows is loose;
    # fp32 must match exactly)
    r = _cli("export", run_dir, "--fp32", "--out", tmp_path / "m32")
    assert r.exit_code == 0, r.output
    r_run = _cli("evaluate", run_dir, "--json")
    r_exp = _cli("evaluate", tmp_path / "m32", "--data", data, "--json", "--device", "auto")
    assert r_run.exit_code == 0 and r_exp.exit_code == 0, r_run.output + r_exp.output
    assert r_exp.output.splitlines()[0] == "evaluate: running model.pt2 (torch.export program) on cpu"
    import json

    a, b = json.loads(r_run.output.strip().splitlines()[-1]), json.loads(r_exp.output.strip().splitlines()[-1])
    assert a["num_samples"] == b["num_samples"] and b["auc"] == pytest.approx(a["auc"], abs=1e-6)


def _one(kjt, i):
    from dlrmctl.sparse import KeyedJaggedTensor

    B = kjt.stride()
    sel = torch.arange(len(kjt.keys())) * B + i
    lengths = kjt.lengths()[sel]
    offs = kjt.offsets()
    values = torch.cat([kjt.values()[offs[j]:offs[j + 1]] for j in sel.tolist()])
    return KeyedJaggedTensor(kjt.keys(), values, lengths=lengths)


def test_export_cli_errors(run, tmp_path):
    _, _, run_dir = run
    r = _cli("export", run_dir, "--int8", "--int4")
    assert r.exit_code == 2 and "choose one of --int8 (the default)" in r.output
    r = _cli("export", tmp_path / "nope", "--int8")
    assert r.exit_code == 2 and "error:" in r.output
    r = _cli("predict", tmp_path, "--input", RAW)
    assert r.exit_code == 2 and "not an exported model" in r.output


def test_predict_rejects_a_malformed_line_naming_file_and_line(run, tmp_path):
    _, _, run_dir = run
    assert _cli("export", run_dir, "--int4", "--out", tmp_path / "m").exit_code == 0
    lines = RAW.read_text().splitlines()
    lines[4] = lines[4].replace("\t", "\tzz", 1)  # I1 is not an integer
    bad = tmp_path / "bad.tsv"
    bad.write_text("\n".join(lines) + "\n")
    r = _cli("predict", tmp_path / "m", "--input", bad, "--output", tmp_path / "s.csv")
    assert r.exit_code == 2 and "bad.tsv:5" in r.output
    assert not (tmp_path / "s.csv").exists()


def test_predict_warns_per_feature_whose_ids_are_mostly_out_of_vocabulary(run, tmp_path):
    """Raw rows whose C5 values were never seen in training: one warning line for C5 (its share and
    the threshold); the unchanged lines give none for C5."""
    from dlrmctl.inference.predict import OOV_WARN_SHARE

    _, _, run_dir = run
    assert _cli("export", run_dir, "--out", tmp_path / "m").exit_code == 0  # int8, the default
    lines = [ln.split("\t") for ln in RAW.read_text().splitlines()]
    for i, f in enumerate(lines):
        f[1 + 13 + 4] = f"{0xdead0000 + i:08x}"  # C5: 100 values absent from the training vocabulary
    unseen = tmp_path / "unseen.tsv"
    unseen.write_text("".join("\t".join(f) + "\n" for f in lines))
    r = _cli("predict", tmp_path / "m", "--input", unseen, "--output", tmp_path / "s.csv")
    assert r.exit_code == 0, r.output
    assert "warning: feature 'C5': 100.0% of its 100 ids are out of the training vocabulary (the train split's " \
           "own ids: " in r.output, r.output
    assert OOV_WARN_SHARE == 0.5
    # the unchanged lines: C5 is then in vocabulary for the rows it was counted on
    r = _cli("predict", tmp_path / "m", "--input", RAW, "--output", tmp_path / "s2.csv")
    assert r.exit_code == 0 and "feature 'C5'" not in r.output, r.output


def test_oov_counts_and_warnings_follow_the_key_major_layout():
    import torch

    from dlrmctl.inference.predict import PredictReport, count_oov

    counts = {}
    # 2 features, batch 3: f0 bags [7], [9, 7], []; f1 (no vocabulary) [1], [2], [3]
    count_oov(counts, ["f0", "f1"], [7, None], torch.tensor([7, 9, 7, 1, 2, 3]), torch.tensor([1, 2, 0, 1, 1, 1]), 3)
    count_oov(counts, ["f0", "f1"], [7, None], torch.tensor([5, 1]), torch.tensor([1, 1]), 1)
    assert counts == {"f0": [2, 4]}
    rep = PredictReport(4, False, None, "-", counts)
    assert rep.oov_warnings(0.5) == [] and len(rep.oov_warnings(0.4)) == 1
    assert rep.oov_warnings(0.4)[0].startswith("feature 'f0': 50.0% of its 4 ids are out of the training vocabulary "
                                               "(the train split's own ids: 0.0%; warned above 40%)")


def _old_path_model(run_dir, checkpoint=None):
    """The pre-meta load path, kept as the reference: every table built on the CPU and randomly
    initialised, then the whole checkpoint loaded over it."""
    import json
    import os

    from dlrmctl.config import resolve_tables
    from dlrmctl.train import checkpoint as ckpt
    from dlrmctl.train.factory import build_model
    from dlrmctl.train.checkpoint import dense_state_dict, embedding_load_request
    from dlrmctl.train.reload import run_config

    cfg = run_config(str(run_dir))
    with open(os.path.join(run_dir, "data_meta.json")) as f:
        meta = json.load(f)
    path, _ = ckpt.resolve_checkpoint(str(run_dir), checkpoint)
    model = build_model(cfg, resolve_tables(cfg, meta), len(meta["dense_features"]), device="cpu",
                        compute_kernel="dense")
    cmeta = ckpt.load_checkpoint_meta(path)
    req, finish = embedding_load_request(model, ckpt.read_metadata(path, cmeta))
    req.update({f"dense/{k}": v for k, v in dense_state_dict(model).items()})
    ckpt.load_checkpoint(path, req, meta=cmeta)
    finish()
    return cfg, model.eval(), meta


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "int8", "int4"])
def test_export_from_the_meta_device_equals_the_full_model_export_bit_for_bit(run, tmp_path, dtype):
    """`dlrmctl export` (meta-device model, tables read and quantized one at a time) writes the
    same artifact as exporting the fully built, fully loaded model: every tensor of model.pt
    (quantized TBE storage with its padding, dense weights, buffers) bit for bit, the same
    manifest, the same scores.  (model.pt's zip bytes themselves are not reproducible even for
    one path: TorchScript stores a random serialization id and per-process class-name mangling.)"""
    import json

    from dlrmctl.config import weighted_features
    from dlrmctl.data.loader import BatchLoader
    from dlrmctl.inference.export import ExportOptions, export_model, export_run, load_exported
    from dlrmctl.train.reload import load_trained_model

    _, data, run_dir = run
    new = export_run(run_dir, dtype, tmp_path / "new", data_dir=data)
    cfg, model, meta = _old_path_model(run_dir)
    export_model(model, tmp_path / "old", ExportOptions(
        dtype, data_meta=meta, data_dir=data, source=new.manifest["source"],
        weighted_features=weighted_features(cfg), data_record=new.manifest["data"]))
    a, b = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("new", "old"))
    for m in (a, b):
        for k in ("created", "model_sha256", "model_bytes", "files", "parity"):  # parity: export_run's alone
            m.pop(k, None)
    assert a == b
    ma, mb = load_exported(tmp_path / "new"), load_exported(tmp_path / "old")
    ta = dict(ma.module.named_buffers()) | dict(ma.module.named_parameters())
    tb = dict(mb.module.named_buffers()) | dict(mb.module.named_parameters())
    # the tables' storage is among them (the program's stacked "lookups.weight_<group>" buffers; TorchScript:
    # the TBE's uint8 weights)
    assert ta.keys() == tb.keys() and any((k.startswith("lookups.weight_") or k.endswith("weights_host")) and v.numel()
                                          for k, v in ta.items())
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, k
        assert torch.equal(ta[k].view(torch.uint8) if ta[k].numel() else ta[k],
                           tb[k].view(torch.uint8) if tb[k].numel() else tb[k]), k
    batch = next(iter(BatchLoader(str(data), "val", 64, shuffle=False)))
    kjt = batch.sparse_features.permute([batch.sparse_features.keys().index(f) for f in ma.feature_names])
    assert torch.equal(ma.score(batch.dense_features, kjt.values(), kjt.lengths()),
                       mb.score(batch.dense_features, kjt.values(), kjt.lengths()))
    # the meta-built model really holds no table storage until a table is read
    _, meta_model, _ = load_trained_model(str(run_dir), checkpoint=None, materialize=False)
    assert all(w.is_meta for w in meta_model.sparse_arch.embedding_weights().values())


def test_evaluate_run_on_a_materialized_meta_model_equals_the_full_model(run, monkeypatch):
    """evaluate_run (meta build, empty tables, checkpoint loaded once) gives the metrics and the
    weights of the old path (random init, then the checkpoint over it)."""
    import dlrmctl.train.reload as reload

    _, data, run_dir = run
    new = reload.evaluate_run(str(run_dir), "val", str(data))
    _, new_model, _ = reload.load_trained_model(str(run_dir), checkpoint=None)
    _, old_model, _ = _old_path_model(run_dir)
    sd_new, sd_old = new_model.state_dict(), old_model.state_dict()
    assert sd_new.keys() == sd_old.keys()
    assert all(torch.equal(sd_new[k], sd_old[k]) for k in sd_new)
    from dlrmctl.config import weighted_features

    calls = []

    def old_path(run_dir, checkpoint=None):  # what run_logits loads, through the old path
        calls.append(run_dir)
        cfg, model, meta = _old_path_model(run_dir, checkpoint)
        return cfg, model, meta, {"weighted_features": weighted_features(cfg, meta)}, None

    monkeypatch.setattr(reload, "load_trained_model_with_checkpoint", old_path)
    assert reload.evaluate_run(str(run_dir), "val", str(data)) == new
    assert calls == [str(run_dir)]  # evaluate_run scored the old path's model


def test_export_predict_evaluate_read_device_outputs_through_to_host(run, tmp_path, monkeypatch):
    """With the model's outputs on a device (faked: .numpy() refuses), export's parity report,
    predict and evaluate still work: every output goes through to_host (.cpu() first)."""
    from dlrmctl.inference.export import ExportedModel

    _, data, run_dir = run
    score, logits = ExportedModel.score, ExportedModel.logits
    monkeypatch.setattr(ExportedModel, "score", lambda self, *a: OnDevice(score(self, *a)))
    monkeypatch.setattr(ExportedModel, "logits", lambda self, *a: OnDevice(logits(self, *a)))
    r = _cli("export", run_dir, "--int8", "--out", tmp_path / "m")
    assert r.exit_code == 0, r.output
    assert "parity       val" in r.output
    r = _cli("predict", tmp_path / "m", "--input", RAW, "--output", tmp_path / "scores.csv")
    assert r.exit_code == 0 and "scored 100 lines" in r.output, r.output
    r = _cli("evaluate", tmp_path / "m", "--data", data, "--json")
    assert r.exit_code == 0 and '"auc"' in r.output, r.output


def test_pt2_export_of_the_run_scores_like_its_torchscript_export(run, tmp_path):
    """`dlrmctl export RUN --fp32|--int8|--int4` (torch.export program) vs `--torchscript` of the
    same checkpoint on the run's val rows: logits within 1e-6 at fp32 and QUANT_LOGIT_BOUND when
    quantized (same codes, scale and bias; only the float32 summation order differs)."""
    from dlrmctl.data.loader import BatchLoader
    from dlrmctl.inference.export import load_exported

    from tests.inference.test_export_pt2 import QUANT_LOGIT_BOUND

    _, data, run_dir = run
    for dtype in ("fp32", "int8", "int4"):
        for art in ("pt2", "torchscript"):
            r = _cli("export", run_dir, f"--{dtype}", "--out", tmp_path / f"{dtype}-{art}",
                     *(["--torchscript"] if art == "torchscript" else []))
            assert r.exit_code == 0, r.output
        p2, ts = load_exported(tmp_path / f"{dtype}-pt2"), load_exported(tmp_path / f"{dtype}-torchscript")
        assert (p2.artifact, ts.artifact) == ("pt2", "torchscript")
        batch = next(iter(BatchLoader(data, "val", 1000, shuffle=False, features=p2.feature_names, prefetch=0)))
        z2 = p2.logits_kjt(batch.dense_features.float(), batch.sparse_features)
        zt = ts.logits_kjt(batch.dense_features.float(), batch.sparse_features)
        assert z2.shape == zt.shape == (batch.batch_size,)
        assert float((z2 - zt).abs().max()) <= (1e-6 if dtype == "fp32" else QUANT_LOGIT_BOUND), dtype


def test_quantize_dense_needs_torchscript_one_line(run, tmp_path):
    _, _, run_dir = run
    r = _cli("export", run_dir, "--int8", "--quantize-dense", "--out", tmp_path / "dq")
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --quantize-dense") and "--torchscript" in lines[0], r.output
    assert not (tmp_path / "dq").exists()
    r = _cli("export", run_dir, "--int8", "--quantize-dense", "--torchscript", "--out", tmp_path / "dq")
    assert r.exit_code == 0 and "dynamic_int8" in r.output, r.output


def test_predict_scores_through_iter_scores_with_its_oov_hook(run, tmp_path, monkeypatch):
    """``predict_file`` has no scoring loop of its own: it runs :func:`iter_scores` (one call,
    logits) and counts out-of-vocabulary ids in its ``on_inputs`` hook, once per batch; its CSV
    scores are ``iter_scores``' scores and its counts :func:`count_oov` over the same inputs."""
    from dlrmctl.inference import predict
    from dlrmctl.inference.export import load_exported

    _, _, run_dir = run
    assert _cli("export", run_dir, "--out", tmp_path / "m").exit_code == 0
    calls, batches = [], []
    real = predict.iter_scores

    def spy(*args, **kwargs):
        calls.append(kwargs.get("logits"))
        hook = kwargs["on_inputs"]
        kwargs["on_inputs"] = lambda d, v, ln, w: (batches.append(d.size(0)), hook(d, v, ln, w))
        return real(*args, **kwargs)

    monkeypatch.setattr(predict, "iter_scores", spy)
    rep = predict.predict_file(tmp_path / "m", RAW, tmp_path / "s.csv", batch_rows=32)
    assert calls == [True] and batches == [32, 32, 32, 4] and rep.rows == 100
    m = load_exported(tmp_path / "m", bulk=True)
    want = np.concatenate([s for s, _ in real(m, RAW, 32)])
    got = np.array([float(r["score"]) for r in csv.DictReader(open(tmp_path / "s.csv"))], dtype=np.float32)
    assert np.allclose(got, want, rtol=1e-7, atol=0)  # the CSV's 8 significant digits
    counts: dict = {}
    oov, names = predict.oov_ids(m), list(m.feature_names)
    for d, v, ln, _, _ in predict.iter_model_inputs(m, RAW, 32):
        predict.count_oov(counts, names, oov, v, ln, d.size(0))
    assert rep.oov == counts and counts
