"""Issue 16: model.dense_standardize (train-split statistics held in the model, checkpointed and
exported), model.over_arch_bias_init: ctr (output bias = logit(train CTR)) and
model.embedding_init_max (tables start U(-a, a))."""

import math

import numpy as np
import pytest
import torch

from dlrmctl import HAS_FBGEMM
from dlrmctl.config import ConfigError, config_from_dict, resolve_tables
from dlrmctl.data.checksums import record_checksums
from dlrmctl.data.columnar import dense_column_stats
from dlrmctl.modules.dlrm import DenseStandardize


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from dlrmctl.data.synthetic import generate_synthetic

    d = tmp_path_factory.mktemp("init_data")
    generate_synthetic(d, rows=3000, seed=5, num_embeddings=[40] * 26)
    return str(d)


def _cfg(data, runs, sharding=None, **model):
    return config_from_dict({**({"sharding": sharding} if sharding else {}),
        "name": "init", "data": {"path": data, "batch_size": 128, "eval_batch_size": 512, "prefetch": 0},
        "model": {"embedding_dim": 8, "dense_arch_layer_sizes": [16, 8], "over_arch_layer_sizes": [16, 1],
                  "compute_kernel": "dense", **model},
        "optimizer": {"embedding": {"lr": 0.05}, "dense": {"lr": 0.05}},
        "train": {"epochs": 1, "max_steps": 6, "log_every": 0, "run_dir": str(runs), "progress": False},
    })


def _trainer(cfg):
    from dlrmctl.distributed.env import RunEnv
    from dlrmctl.train.trainer import Trainer
    from dlrmctl.train.run_dir import prepare_run_dir

    return Trainer(cfg, RunEnv(), prepare_run_dir(cfg, resume=False, overwrite=False))


def _dense_of(data, split):
    from dlrmctl.data.columnar import open_split, read_meta

    meta = read_meta(data)
    s = open_split(data, split)
    cols = []
    for sh in s.shards:
        loc = sh.locate(np.arange(sh.rows, dtype=np.int64))
        cols.append(np.stack([sh.take(n, loc) for n in meta["dense_features"]], axis=1))
    return np.concatenate(cols).astype(np.float64)


def test_dense_column_stats_equal_numpy_over_blocks(data):
    x = _dense_of(data, "train")
    mean, std = dense_column_stats(data, "train", block_rows=333)  # several blocks merged (Chan et al.)
    np.testing.assert_allclose(mean, x.mean(axis=0), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(std, np.where(x.std(axis=0) > 0, x.std(axis=0), 1.0), rtol=1e-9)


def test_standardised_train_inputs_have_mean_0_std_1_and_the_stats_survive_a_checkpoint(data, tmp_path):
    from dlrmctl.train.reload import load_trained_model

    t = _trainer(_cfg(data, tmp_path, dense_standardize=True))
    norm = t.model.dense_norm
    assert isinstance(norm, DenseStandardize)
    z = norm(torch.from_numpy(_dense_of(data, "train")).float()).double()
    varying = z.std(dim=0, unbiased=False) > 0
    assert float(z.mean(dim=0).abs().max()) < 1e-4
    assert torch.allclose(z.std(dim=0, unbiased=False)[varying], torch.ones(int(varying.sum()), dtype=torch.float64),
                          atol=1e-4)
    # the model reads standardised features: its dense arch sees norm(x), not x
    seen = {}
    h = t.model.dense_arch.register_forward_pre_hook(lambda m, i: seen.__setitem__("x", i[0].detach()))
    from dlrmctl.data.loader import BatchLoader

    batch = next(iter(BatchLoader(data, "val", 64, shuffle=False, features=t.feature_names)))
    t.model(batch.dense_features, batch.sparse_features)
    h.remove()
    torch.testing.assert_close(seen["x"], (batch.dense_features - norm.mean) / norm.std)
    t.train()  # checkpoints the statistics with the dense state
    _, model, _ = load_trained_model(t.run_dir)
    torch.testing.assert_close(model.dense_norm.mean, norm.mean, rtol=0, atol=0)
    torch.testing.assert_close(model.dense_norm.std, norm.std, rtol=0, atol=0)


def test_without_the_key_the_model_has_no_standardisation(data, tmp_path):
    assert _trainer(_cfg(data, tmp_path)).model.dense_norm is None


def test_dense_standardize_rejects_bad_statistics():
    n = DenseStandardize(3)
    with pytest.raises(ValueError, match="shape"):
        n.set_stats(torch.zeros(2), torch.ones(2))
    with pytest.raises(ValueError, match="finite and > 0"):
        n.set_stats(torch.zeros(3), torch.tensor([1.0, 0.0, 1.0]))


def test_a_nan_or_inf_dense_column_is_named_by_the_trainer(data, tmp_path):
    """A NaN / inf in the train split's dense columns was a ValueError traceback from set_stats that
    listed plausible stds (NaN was turned into std 1) and named no column."""
    import shutil

    import pyarrow as pa
    import pyarrow.ipc as ipc

    from dlrmctl.data.columnar import read_meta
    from dlrmctl.train.run_dir import TrainError

    d = tmp_path / "nan_data"
    shutil.copytree(data, d)
    meta = read_meta(str(d))
    path = d / meta["splits"]["train"]["files"][0]
    with pa.memory_map(str(path)) as f:
        t = ipc.open_file(f).read_all()
    cols = {n: t.column(n).to_numpy().copy() for n in t.schema.names}
    a, b = meta["dense_features"][2], meta["dense_features"][4]
    cols[a][3], cols[b][5] = np.nan, np.inf
    t = pa.Table.from_arrays([pa.array(cols[n], type=t.schema.field(n).type) for n in t.schema.names], schema=t.schema)
    with ipc.new_file(str(path), t.schema) as w:
        w.write_table(t)
    record_checksums(d)  # a planted value, not damage
    mean, std = dense_column_stats(str(d), "train")
    assert not np.isfinite(std[2]) and not np.isfinite(std[4])  # not disguised as a constant column's 1
    with pytest.raises(TrainError, match=rf"dense column\(s\) \['{a}', '{b}'\] .* NaN or inf"):
        _trainer(_cfg(str(d), tmp_path / "runs", dense_standardize=True))


def test_over_arch_bias_starts_at_the_train_ctr_logit(data, tmp_path):
    from dlrmctl.data.columnar import read_meta

    p = read_meta(data)["ctr"]["train"]
    t = _trainer(_cfg(data, tmp_path, over_arch_bias_init="ctr"))
    last = t.model.over_arch.model.model[-1]
    assert isinstance(last, torch.nn.Linear) and last.out_features == 1
    assert float(last.bias.detach()) == pytest.approx(math.log(p / (1 - p)), abs=1e-6)
    default = _trainer(_cfg(data, tmp_path / "r2"))  # random: the MLP init, not the CTR logit
    assert float(default.model.over_arch.model.model[-1].bias.detach()) != pytest.approx(math.log(p / (1 - p)), abs=1e-3)


def test_embedding_init_max_bounds_every_table(data, tmp_path):
    a = 0.01
    t = _trainer(_cfg(data, tmp_path, embedding_init_max=a))
    for name, w in t.model.sparse_arch.state_dict().items():
        w = w.float()
        assert float(w.abs().max()) <= a and float(w.abs().max()) > 0.9 * a, name
    for tc in resolve_tables(_cfg(data, tmp_path), {"dense_features": [], "sparse_features": [
            {"name": "C1", "num_embeddings": 100}]}):  # default: the DLRM reference's sqrt(1/n)
        assert tc.get_weight_init_max() == pytest.approx(0.1)


@pytest.mark.parametrize("bad", [0, -0.1, float("inf"), "x", True])
def test_embedding_init_max_must_be_a_positive_number(bad, tmp_path):
    with pytest.raises(ConfigError, match="model.embedding_init_max"):
        _cfg("d", tmp_path, embedding_init_max=bad)


@pytest.mark.parametrize("bad,precision", [(1e300, "fp32"), (1e15, "fp32"), (1e5, "fp16"), (1.01, "fp16")])
def test_embedding_init_max_above_1_is_refused(bad, precision, tmp_path):
    """1e300 crashed uniform_ with 'from is out of bounds for float'; 1e5 on fp16 tables started them
    at inf; 1e15 (finite in fp32, dot products too) trained to NaN."""
    with pytest.raises(ConfigError, match=r"model.embedding_init_max: must be a number in \(0, 1\]"):
        _cfg("d", tmp_path, embedding_init_max=bad, embedding_precision=precision)
    _cfg("d", tmp_path, embedding_init_max=1.0, embedding_precision=precision)  # the largest accepted


@pytest.mark.skipif(not HAS_FBGEMM, reason="export needs fbgemm_gpu")
def test_the_standardisation_is_exported(tmp_path):
    from dlrmctl.inference.export import ExportOptions, export_model, load_exported
    from dlrmctl.modules.dlrm import DLRM
    from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
    from dlrmctl.modules.embedding_modules import EmbeddingBagCollection
    from dlrmctl.sparse import KeyedJaggedTensor

    torch.manual_seed(0)
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", num_embeddings=20, embedding_dim=8,
                                                     feature_names=["a"])], compute_kernel="fused")
    model = DLRM(ebc, 4, [16, 8], [16, 1], 1, 8, dense_standardize=True, first_order_width=8).eval()
    model.dense_norm.set_stats(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0.5, 2.0, 1.0, 4.0]))
    with torch.no_grad():
        model.first_order.dense.weight.normal_()
    export_model(model, tmp_path / "m", ExportOptions("fp32"))
    dense = torch.rand(6, 4) * 5
    kjt = KeyedJaggedTensor(["a"], torch.arange(6) % 20, lengths=torch.ones(6, dtype=torch.long))
    with torch.no_grad():
        want = torch.sigmoid(model(dense, kjt).squeeze(1))
    got = load_exported(tmp_path / "m").score(dense, kjt.values(), kjt.lengths())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    model.dense_norm.set_stats(torch.zeros(4), torch.ones(4))
    with torch.no_grad():
        assert float((got - torch.sigmoid(model(dense, kjt).squeeze(1))).abs().max()) > 1e-3


KEYS = {"dense_standardize": True, "over_arch_bias_init": "ctr", "embedding_init_max": 0.05}


def _rank_run(env, data, runs):
    """One rank of a 2-rank table-wise run with the three keys: its dense statistics, bias, final AUC."""
    import os

    from dlrmctl.distributed.env import RunEnv

    from dlrmctl.train.trainer import Trainer

    cfg = _cfg(data, runs, sharding={"tables": {f"t_C{i}": {"sharding_type": "table_wise"} for i in range(1, 27)}},
               **KEYS)
    renv = RunEnv(env.rank, env.world_size, env.local_world_size, env.device, env)
    run = os.path.join(runs, "init")
    if env.rank == 0:
        os.makedirs(run, exist_ok=True)
    t = Trainer(cfg, renv, run)
    m = t.model.module
    stats = (m.dense_norm.mean.clone(), m.dense_norm.std.clone(), float(m.over_arch.model.model[-1].bias.detach()))
    return stats, t.train()["final"]["auc"]


@pytest.mark.multiprocess
def test_two_ranks_take_the_same_initial_values_and_match_one_process(data, tmp_path):
    from tests.dist_utils import run_multiprocess

    single = _trainer(_cfg(data, tmp_path / "one", **KEYS))
    want = (single.model.dense_norm.mean, single.model.dense_norm.std,
            float(single.model.over_arch.model.model[-1].bias.detach()))
    auc1 = single.train()["final"]["auc"]
    out = run_multiprocess(_rank_run, 2, data, str(tmp_path / "two"), timeout_s=240)
    for (mean, std, bias), auc in out:
        torch.testing.assert_close(mean, want[0], rtol=0, atol=0)
        torch.testing.assert_close(std, want[1], rtol=0, atol=0)
        assert bias == want[2]
        assert auc == pytest.approx(auc1, abs=1e-4)


def test_dense_column_stats_of_a_big_split_read_a_bounded_spread_sample(data):
    """Above max_rows the statistics come from max_rows rows in evenly spaced blocks (the cost
    does not grow with the split): close to the full figures, and the same on every call."""
    x = _dense_of(data, "train")
    n = len(x)
    mean, std = dense_column_stats(data, "train", block_rows=50, max_rows=n // 4)
    again = dense_column_stats(data, "train", block_rows=50, max_rows=n // 4)
    assert np.array_equal(mean, again[0]) and np.array_equal(std, again[1])
    full_std = np.where(x.std(axis=0) > 0, x.std(axis=0), 1.0)
    # a quarter of the rows: within a few standard errors of the full mean, std within 15 %
    assert np.all(np.abs(mean - x.mean(axis=0)) <= 5 * full_std / np.sqrt(n // 4) + 1e-12)
    assert np.all(np.abs(std / full_std - 1) < 0.15)
    assert not np.array_equal(mean, x.mean(axis=0))  # it did read a subset
    with pytest.raises(ValueError, match="max_rows must be >= 1"):
        dense_column_stats(data, "train", max_rows=0)


def test_a_resumed_run_takes_the_statistics_from_its_checkpoint_without_reading_the_train_split(data, tmp_path,
                                                                                                monkeypatch):
    """--resume restores the standardisation statistics and the output bias from the checkpoint, so
    the pass over the train split's dense columns is not made again (it would be overwritten)."""
    from dlrmctl.data import columnar
    from dlrmctl.distributed.env import RunEnv
    from dlrmctl.train.trainer import Trainer
    from dlrmctl.train.run_dir import prepare_run_dir

    cfg = _cfg(data, tmp_path, dense_standardize=True)
    t = _trainer(cfg)
    t.train()
    saved = (t.model.dense_norm.mean.clone(), t.model.dense_norm.std.clone())

    def no_read(*a, **k):
        raise AssertionError("the train split's dense statistics were read")

    monkeypatch.setattr(columnar, "dense_column_stats", no_read)
    resumed = Trainer(cfg, RunEnv(), prepare_run_dir(cfg, resume=True, overwrite=False), resume=True)
    assert torch.equal(resumed.model.dense_norm.mean, saved[0]) and torch.equal(resumed.model.dense_norm.std, saved[1])
    # a fresh run does read them (the patched reader is reached)
    fresh = _cfg(data, tmp_path / "fresh", dense_standardize=True)
    with pytest.raises(AssertionError, match="dense statistics were read"):
        _trainer(fresh)
