"""Issue 16 item 3: model.dropout (training only), train.early_stopping_patience (stops, keeps the
best checkpoint) and model.embedding_dim: auto (the documented k * n^0.25 widths, projected to
the common width)."""

import json
import os
import math

import pytest
import torch
from typer.testing import CliRunner

from dlrmctl.cli import app
from dlrmctl.config import ConfigError, auto_embedding_dim, config_from_dict, resolve_tables
from dlrmctl.modules.dlrm import ProjectedInteraction
from dlrmctl.modules.mlp import MLP
from dlrmctl.train import checkpoint as ckpt
from dlrmctl.train.factory import build_model

runner = CliRunner()


# ------------------------------------------------------------------------- dropout
def test_mlp_dropout_is_on_in_training_and_off_in_eval():
    torch.manual_seed(0)
    mlp = MLP(8, [64, 64, 1], final_activation=False, dropout=0.5)
    ref = MLP(8, [64, 64, 1], final_activation=False)
    ref.load_state_dict(mlp.state_dict())  # same parameter names with and without dropout
    x = torch.randn(32, 8)
    mlp.eval(), ref.eval()
    torch.testing.assert_close(mlp(x), ref(x), rtol=0, atol=0)  # eval: exactly the model without dropout
    mlp.train()
    a, b = mlp(x), mlp(x)
    assert not torch.equal(a, b)  # two masks
    assert not torch.allclose(a, ref(x))
    # what the second Linear sees: the ReLU output with about half its entries zeroed, the rest x2
    seen = {}
    h1 = mlp.model[1].register_forward_hook(lambda m, i, o: seen.__setitem__("relu", o.detach()))
    h2 = mlp.model[2].register_forward_pre_hook(lambda m, i: seen.__setitem__("lin", i[0].detach()))
    mlp(torch.randn(64, 8))
    h1.remove(), h2.remove()
    relu, lin = seen["relu"], seen["lin"]
    kept = lin != 0
    torch.testing.assert_close(lin[kept], 2.0 * relu[kept])
    alive = relu != 0
    assert 0.4 < (~kept[alive]).float().mean().item() < 0.6
    assert mlp._drop_after == [1, 3]  # not after the logit layer


def test_mlp_rejects_a_dropout_of_one():
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
        MLP(4, [2], dropout=1.0)


def _meta(cards):
    return {"dense_features": ["I1", "I2"],
            "sparse_features": [{"name": f"C{i + 1}", "num_embeddings": n} for i, n in enumerate(cards)]}


def _cfg(**model):
    raw = {"model": {"dense_arch_layer_sizes": [16, 32], "over_arch_layer_sizes": [8, 1],
                     "compute_kernel": "dense", **model}}
    return config_from_dict(raw)


def test_model_dropout_reaches_both_mlps_and_eval_is_deterministic():
    cfg = _cfg(embedding_dim=32, dropout=0.3)
    meta = _meta([10, 20])
    model = build_model(cfg, resolve_tables(cfg, meta), 2, meta=meta)
    assert model.dense_arch.model.dropout == 0.3 and model.over_arch.model.dropout == 0.3
    from dlrmctl.sparse import KeyedJaggedTensor

    kjt = KeyedJaggedTensor.from_lengths_sync(["C1", "C2"], torch.tensor([1, 2, 3, 4, 5, 6]),
                                              torch.tensor([1, 1, 1, 1, 1, 1]))
    dense = torch.randn(3, 2)
    model.eval()
    e1, e2 = model(dense, kjt), model(dense, kjt)
    torch.testing.assert_close(e1, e2, rtol=0, atol=0)
    model.train()
    outs = [model(dense, kjt) for _ in range(4)]
    assert any(not torch.equal(outs[0], o) for o in outs[1:])


def test_first_order_adds_a_zero_initialised_linear_term_of_dense_and_pooled_embeddings():
    from dlrmctl.sparse import KeyedJaggedTensor

    meta = _meta([10, 20])
    dense = torch.randn(3, 2)
    kjt = KeyedJaggedTensor.from_lengths_sync(["C1", "C2"], torch.tensor([1, 2, 3, 4, 5, 6]),
                                              torch.tensor([1, 1, 1, 1, 1, 1]))
    cfg = _cfg(embedding_dim="auto", embedding_dim_factor=1.0, first_order=True)
    model = build_model(cfg, resolve_tables(cfg, meta), 2, meta=meta).eval()
    plain = build_model(_cfg(embedding_dim="auto", embedding_dim_factor=1.0), resolve_tables(cfg, meta), 2, meta=meta).eval()
    assert plain.first_order is None
    widths = [t.embedding_dim for t in resolve_tables(cfg, meta)]
    fo = model.first_order
    assert fo.dense.weight.shape == (1, 2) and fo.sparse.weight.shape == (1, sum(widths))
    # zero-initialised: the same logits as the plain DLRM (same seed, same other parameters)
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("first_order.")})
    torch.testing.assert_close(model(dense, kjt), plain(dense, kjt), rtol=0, atol=0)
    # then logit = plain logit + w_dense . x + sum_f w_f . e_f, e_f the pooled rows of each table
    with torch.no_grad():
        fo.dense.weight.normal_()
        fo.sparse.weight.normal_()
    pooled = model.sparse_arch(kjt).values()
    expected = plain(dense, kjt) + dense @ fo.dense.weight.T + pooled @ fo.sparse.weight.T
    torch.testing.assert_close(model(dense, kjt), expected)
    # trained by the dense optimizer: it is a dense (non sparse_arch) parameter with a gradient
    model.train()
    model(dense, kjt).sum().backward()
    assert fo.sparse.weight.grad is not None and float(fo.sparse.weight.grad.abs().sum()) > 0


@pytest.mark.parametrize("bad", [-0.1, 1.0])
def test_config_rejects_dropout_outside_0_1(bad):
    with pytest.raises(ConfigError, match="model.dropout: must be in"):
        _cfg(dropout=bad)


# ---------------------------------------------------------------- embedding_dim auto
@pytest.mark.parametrize("n, dim", [(1, 8), (5, 12), (100, 20), (685, 32), (10_000, 60), (10 ** 6, 192)])
def test_auto_embedding_dim_is_6_n_quarter_rounded_up_to_4(n, dim):
    assert auto_embedding_dim(n, 6.0, 10_000) == dim == 4 * math.ceil(6 * n ** 0.25 / 4)


def test_auto_embedding_dim_cap_and_factor():
    assert auto_embedding_dim(10 ** 6, 6.0, 64) == 64
    assert auto_embedding_dim(81, 1.0, 64) == 4  # the blog's rule: 81 ** 0.25 = 3, rounded up to 4
    with pytest.raises(ConfigError, match="embedding_dim auto"):
        auto_embedding_dim(0, 6.0, 64)


def test_auto_gives_the_documented_table_dims_and_projects_the_narrow_ones():
    cfg = _cfg(embedding_dim="auto")
    meta = _meta([5, 100, 685, 10 ** 6])
    tables = resolve_tables(cfg, meta)
    assert [t.embedding_dim for t in tables] == [12, 20, 32, 32]  # 12, 20, 32, 192 capped at d = 32
    model = build_model(cfg, tables, 2, meta=meta)
    inter = model.inter_arch
    assert isinstance(inter, ProjectedInteraction)
    # one bias-free Linear(dim, 32) per table narrower than 32
    assert [tuple(p.weight.shape) for p in inter.projections] == [(32, 12), (32, 20)]
    from dlrmctl.sparse import KeyedJaggedTensor

    kjt = KeyedJaggedTensor.from_lengths_sync(["C1", "C2", "C3", "C4"], torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]),
                                              torch.ones(8, dtype=torch.int64))
    out = model(torch.randn(2, 2), kjt)
    assert out.shape == (2, 1)
    out.sum().backward()
    assert all(p.weight.grad is not None and p.weight.grad.abs().sum() > 0 for p in inter.projections)
    # the dot interaction sees F = 4 vectors of width 32 after the projections
    assert model.over_arch.model.model[0].in_features == 32 + 4 * 5 // 2



def test_auto_plans_a_sharded_run_counting_the_projections():
    # the planner's dense-model reservation did `embedding_dim + ...` with embedding_dim == "auto":
    # TypeError in `dlrmctl train --nproc N`, `dlrmctl plan` and `dlrmctl checkpoint reshard`
    from dlrmctl.planner.planner import count_dense_params, plan_for_config

    meta = _meta([5, 100, 685, 10 ** 6])
    for model_kw in (dict(embedding_dim="auto"), dict(embedding_dim=32), dict(embedding_dim="auto", first_order=True),
                     dict(embedding_dim="auto", interaction="dcn")):
        cfg = _cfg(**model_kw)
        tables = resolve_tables(cfg, meta)
        model = build_model(cfg, tables, 2, device="meta", meta=meta)
        dense = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("sparse_arch"))
        assert count_dense_params(cfg, len(tables), 2, [t.embedding_dim for t in tables]) == dense
        plan = plan_for_config(cfg, 2, meta=meta)
        assert sorted(plan.plan) == sorted(t.name for t in tables)


def test_auto_is_refused_with_explicit_tables():
    with pytest.raises(ConfigError, match="model.embedding_dim: auto sizes the tables derived from the data"):
        _cfg(embedding_dim="auto", tables=[{"name": "t", "num_embeddings": 10}])
    with pytest.raises(ConfigError, match="model.embedding_dim: expected int | 'auto'"):
        _cfg(embedding_dim="big")


# ---------------------------------------------------------------------- early stopping
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from dlrmctl.data.synthetic import generate_synthetic

    d = tmp_path_factory.mktemp("es")
    generate_synthetic(d, rows=4000, seed=3, num_embeddings=[30] * 26)
    return d


def _train(data, runs, name, *extra):
    args = ["train", "configs/demo.yaml", "--set", f"data.path={data}", "--set", f"train.run_dir={runs}",
            "--set", f"name={name}", "--set", "train.progress=false", "--set", "data.batch_size=128",
            "--set", "train.eval_every=2", "--set", "train.log_every=1", "--set", "train.epochs=3",
            "--set", "model.compute_kernel=dense", *extra]
    r = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.output


def _scripted_evaluate(monkeypatch, aucs):
    """The trainer's evaluator (:class:`~dlrmctl.train.evaluator.Evaluator`, the component every
    validation goes through) returns the validation AUCs ``aucs`` in turn (then 0.5)."""
    from dlrmctl.train.evaluator import Evaluator

    seq = iter(aucs)

    def fake(self, split=None, data_dir=None):
        a = next(seq, 0.5)
        return {"auc": a, "logloss": 0.5, "ne": 1.0 - a, "calibration": 1.0, "accuracy": 0.7, "ctr": 0.25,
                "num_samples": 100}

    monkeypatch.setattr(Evaluator, "evaluate", fake)


def test_early_stopping_stops_after_patience_evaluations_without_improvement(data, tmp_path, monkeypatch):
    # evals at steps 2, 4, 6, ...: best at 2, 4, then 8 (resets the count), then 10 and 12 do not improve
    _scripted_evaluate(monkeypatch, [0.60, 0.70, 0.65, 0.72, 0.71, 0.69, 0.80])
    out = _train(data, tmp_path, "es", "--set", "train.early_stopping_patience=2")
    run = tmp_path / "es"
    evals = [json.loads(x) for x in open(run / "metrics.jsonl") if '"eval"' in x]
    assert [e["step"] for e in evals] == [2, 4, 6, 8, 10, 12]  # never reaches the 0.80 at step 14
    s = json.loads((run / "summary.json").read_text())
    assert s["steps"] == 12 and s["early_stopped"] is True and s["best"]["step"] == 8
    assert "early stopping at step 12: 2 evaluation(s) without a better val AUC than step 8" in out
    assert ckpt.best_checkpoint(str(run)).endswith("step_00000008")  # the best checkpoint is kept
    assert ckpt.latest_checkpoint(str(run)).endswith("step_00000012")
    # resuming a run that stopped early trains no further
    _scripted_evaluate(monkeypatch, [])
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    summary = (run / "summary.json").read_text()
    out = _train(data, tmp_path, "es", "--set", "train.early_stopping_patience=2", "--resume")
    assert (run / "summary.json").read_text() == summary  # the training's summary (its train_seconds) stays
    assert "the run had already finished at step 12: nothing to train" in out and "early stopping" not in out, out
    # ... and writes no second copy of its last checkpoint (it used to add step_00000012.1)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    assert ckpt.latest_checkpoint(str(run)).endswith("step_00000012")


def test_resuming_a_finished_run_does_not_save_its_last_step_again(data, tmp_path):
    _train(data, tmp_path, "done", "--set", "train.max_steps=4")
    ckdir = tmp_path / "done" / "checkpoints"
    before = sorted(p.name for p in ckdir.iterdir())
    assert "step_00000004" in before
    evals = [x for x in open(tmp_path / "done" / "metrics.jsonl") if '"eval"' in x]
    final = json.loads((tmp_path / "done" / "summary.json").read_text())["final"]
    _train(data, tmp_path, "done", "--set", "train.max_steps=4", "--resume")
    assert sorted(p.name for p in ckdir.iterdir()) == before
    # ... nor evaluates that step again (a second eval record of step 4 in metrics.jsonl); its summary's
    # final metrics are the ones the checkpoint recorded
    assert [x for x in open(tmp_path / "done" / "metrics.jsonl") if '"eval"' in x] == evals
    again = json.loads((tmp_path / "done" / "summary.json").read_text())["final"]
    assert again["auc"] == final["auc"] and again["num_samples"] == final["num_samples"]
    # a resume that trains on saves as before
    _train(data, tmp_path, "done", "--set", "train.max_steps=6", "--resume")
    assert ckpt.latest_checkpoint(str(tmp_path / "done")).endswith("step_00000006")


def test_without_patience_the_same_run_trains_every_epoch(data, tmp_path, monkeypatch):
    _scripted_evaluate(monkeypatch, [0.60, 0.70, 0.65, 0.72, 0.71, 0.69, 0.80])
    _train(data, tmp_path, "full")
    s = json.loads((tmp_path / "full" / "summary.json").read_text())
    steps_per_epoch = math.ceil(3200 / 128)  # about 80% of 4000 rows are train
    assert s["early_stopped"] is False and s["steps"] >= 3 * (steps_per_epoch - 3) and s["best"]["step"] == 14


def test_early_stopping_on_real_training_keeps_the_best(data, tmp_path):
    # lr 0: every evaluation equals the first, so the run stops after patience + 1 evaluations
    out = _train(data, tmp_path, "flat", "--set", "train.early_stopping_patience=3", "--set", "optimizer.dense.lr=0",
                 "--set", "optimizer.embedding.lr=0")
    s = json.loads((tmp_path / "flat" / "summary.json").read_text())
    assert s["steps"] == 8 and s["best"]["step"] == 2 and s["early_stopped"] is True, out
    assert ckpt.best_checkpoint(str(tmp_path / "flat")).endswith("step_00000002")


def test_early_stopping_needs_a_keep_best_metric():
    with pytest.raises(ConfigError, match="train.early_stopping_patience: stops on the keep_best metric"):
        config_from_dict({"train": {"early_stopping_patience": 2, "keep_best": "none"}})
    with pytest.raises(ConfigError, match="train.early_stopping_patience: must be >= 0"):
        config_from_dict({"train": {"early_stopping_patience": -1}})


def test_summary_json_is_replaced_whole_or_kept(data, tmp_path, monkeypatch):
    """summary.json was opened "w" and then dumped: a failure mid-write (disk full, a value json cannot
    write) left the previous run's summary truncated.  Now a temp file is renamed over it."""
    import dlrmctl.fileio as fileio

    _train(data, tmp_path, "sj", "--set", "train.max_steps=2")
    p = tmp_path / "sj" / "summary.json"
    before = p.read_text()
    real = os.replace

    def failing(src, dst):  # the new summary is written in full, then the rename fails (disk full)
        if str(dst).endswith("summary.json"):
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(fileio.os, "replace", failing)
    with pytest.raises(AssertionError, match="summary.json: no space left on device"):  # one error line, exit 2
        _train(data, tmp_path, "sj", "--set", "train.max_steps=4", "--resume")
    assert p.read_text() == before and json.loads(before)["steps"] == 2
    assert not [f.name for f in p.parent.iterdir() if f.name.endswith(".tmp")]  # the temp file is removed
