"""Weighted features end to end (issue 12, item 3).

Setup used throughout: table T0 4 x 4 with row i = [i]*4; one sample whose bag of feature f0 is
ids [1, 2] with weights [10, 100]; sum pooling gives [210]*4 (unweighted it would be [3]*4).
"""

import pytest
import torch

from dlrmctl import HAS_FBGEMM
from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
from dlrmctl.modules.embedding_modules import EmbeddingBagCollection
from dlrmctl.sparse import KeyedJaggedTensor, SparseInputError

from tests.dist_utils import run_multiprocess

KERNELS = ["dense"] + (["fused"] if HAS_FBGEMM else [])
WANT = [[210.0] * 4]


def setup_tables(extra: bool = False) -> list[EmbeddingBagConfig]:
    t = [EmbeddingBagConfig(name="T0", num_embeddings=4, embedding_dim=4, feature_names=["f0"])]
    if extra:  # an unweighted neighbour table
        t.append(EmbeddingBagConfig(name="T1", num_embeddings=3, embedding_dim=4, feature_names=["f1"]))
    return t


def setup_kjt(weighted: bool = True) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(["f0"], torch.tensor([1, 2]), lengths=torch.tensor([2]),
                             weights=torch.tensor([10.0, 100.0]) if weighted else None)


def set_rows(weights: dict[str, torch.Tensor]) -> None:
    """Row i of every table = [i] * dim."""
    with torch.no_grad():
        for w in weights.values():
            w.copy_(torch.arange(w.shape[0], dtype=torch.float32)[:, None].expand_as(w))


# ------------------------------------------------------------------------ EBC
@pytest.mark.parametrize("kernel", KERNELS)
def test_weighted_ebc_pools_the_setup_to_210(kernel):
    ebc = EmbeddingBagCollection(setup_tables(), is_weighted=True, compute_kernel=kernel)
    set_rows(ebc.embedding_weights())
    assert ebc(setup_kjt()).values().tolist() == WANT
    ebc.eval()
    with torch.no_grad():
        assert ebc(setup_kjt()).values().tolist() == WANT


@pytest.mark.parametrize("kernel", KERNELS)
def test_unweighted_ebc_given_weights_raises_naming_tables_and_features(kernel):
    ebc = EmbeddingBagCollection(setup_tables(), compute_kernel=kernel)
    set_rows(ebc.embedding_weights())
    with pytest.raises(SparseInputError, match=r"EmbeddingBagCollection \(tables \['T0'\], features \['f0'\]\) is "
                       r"unweighted.*per-id weights.*TorchRec ignores them silently"):
        ebc(setup_kjt())
    assert ebc(setup_kjt(weighted=False)).values().tolist() == [[3.0] * 4]


def test_weighted_ebc_without_weights_raises():
    ebc = EmbeddingBagCollection(setup_tables(), is_weighted=True, compute_kernel="dense")
    with pytest.raises(SparseInputError, match=r"\['T0'\].*is weighted.*has no per-id weights"):
        ebc(setup_kjt(weighted=False))


SHARDING_TYPES = ["table_wise", "row_wise", "column_wise", "data_parallel", "table_row_wise"]


def _sharded_rank(env):
    """Per sharding type: this rank's pooled output for its local batch of setup samples, and the
    messages of the weights-missing / weights-given-to-unweighted errors."""
    from dlrmctl.distributed.model_parallel import plan_from_types
    from dlrmctl.distributed.sharded_ebc import ShardedEmbeddingBagCollection

    tables = setup_tables()
    B = 1 + env.rank  # local batches differ between ranks
    kjt = KeyedJaggedTensor(["f0"], torch.tensor([1, 2] * B), lengths=torch.tensor([2] * B),
                            weights=torch.tensor([10.0, 100.0] * B))
    out = {}
    for st in SHARDING_TYPES:
        plan = plan_from_types(tables, {"T0": st}, env.world_size)
        ebc = ShardedEmbeddingBagCollection(tables, plan, env, is_weighted=True, seed=0)
        with torch.no_grad():
            for meta, w, _ in ebc.local_shards().get("T0", []):  # table_wise: one rank holds none
                r0 = meta.offsets[0]
                w.copy_(torch.arange(r0, r0 + w.shape[0], dtype=torch.float32)[:, None].expand_as(w))
        res = {"pooled": ebc(kjt).values().tolist()}
        for name, m, k in [("missing", ebc, setup_kjt(weighted=False)),
                           ("extra", ShardedEmbeddingBagCollection(tables, plan, env, seed=0), kjt)]:
            try:
                m(k)
                res[name] = None
            except SparseInputError as e:
                res[name] = str(e)
        out[st] = res
    return out


def test_sharded_ebc_on_2_gloo_ranks_carries_the_weights_for_every_sharding_type():
    per_rank = run_multiprocess(_sharded_rank, 2, timeout_s=180)
    for rank, out in enumerate(per_rank):
        for st in SHARDING_TYPES:
            res = out[st]
            assert res["pooled"] == WANT * (1 + rank), (rank, st, res["pooled"])
            assert "is weighted" in res["missing"] and "ShardedEmbeddingBagCollection" in res["missing"]
            assert "is unweighted" in res["extra"] and "['T0']" in res["extra"]


# ------------------------------------------------------------------ config
def _cfg_dict(data: str, runs: str, name: str = "w", **train) -> dict:
    return {
        "name": name,
        "data": {"path": data, "batch_size": 8, "eval_batch_size": 16, "shuffle": False, "prefetch": 0},
        "model": {
            "tables": [{"name": "T0", "num_embeddings": 4, "embedding_dim": 4, "feature_names": ["f0"], "weighted": True},
                       {"name": "T1", "num_embeddings": 3, "embedding_dim": 4, "feature_names": ["f1"]}],
            "dense_arch_layer_sizes": [8, 4], "over_arch_layer_sizes": [8, 1], "compute_kernel": "fused",
        },
        "optimizer": {"embedding": {"lr": 0.05}, "dense": {"lr": 0.05}},
        "train": {"epochs": 2, "run_dir": runs, "progress": False, "pipeline": "none", "device": "cpu",
                  "log_every": 1, "checkpoint_every": 3, **train},
    }


def test_yaml_weighted_key_feature_list_and_errors():
    from dlrmctl.config import ConfigError, config_from_dict, weighted_features

    cfg = config_from_dict(_cfg_dict("d", "r"))
    assert [t.weighted for t in cfg.model.tables] == [True, False]
    assert weighted_features(cfg) == ["f0"]
    raw = _cfg_dict("d", "r")
    raw["model"]["tables"][0]["weighted"] = "yes"
    with pytest.raises(ConfigError, match=r"model.tables\[0\].weighted: expected bool"):
        config_from_dict(raw)
    raw = _cfg_dict("d", "r")
    raw["model"]["tables"][1]["feature_names"] = ["f0"]  # one feature, a weighted and an unweighted table
    with pytest.raises(ConfigError, match=r"feature 'f0' feeds the weighted and the unweighted tables \['T0', 'T1'\]"):
        config_from_dict(raw)
    raw = _cfg_dict("d", "r")
    raw["model"]["tables"][0]["weighted"] = False
    assert weighted_features(config_from_dict(raw)) == []


@pytest.mark.parametrize("kernel", KERNELS)
def test_build_model_is_weighted_from_the_yaml(kernel):
    from dlrmctl.config import config_from_dict, resolve_tables
    from dlrmctl.train.factory import build_model

    cfg = config_from_dict(_cfg_dict("d", "r"))
    model = build_model(cfg, resolve_tables(cfg), 1, compute_kernel=kernel)
    assert model.sparse_arch.is_weighted()
    set_rows(model.sparse_arch.embedding_weights())
    kjt = KeyedJaggedTensor(["f0", "f1"], torch.tensor([1, 2, 0]), lengths=torch.tensor([2, 1]),
                            weights=torch.tensor([10.0, 100.0, 1.0]))
    assert model.sparse_arch(kjt)["f0"].tolist() == WANT
    cfg.model.tables[0].weighted = False
    assert not build_model(cfg, resolve_tables(cfg), 1, compute_kernel=kernel).sparse_arch.is_weighted()


# -------------------------------------------------------------------- data
ROWS = 40


def write_data(d, weights: bool = True):
    """Hand-made columnar data: dense d0; multi-hot f0 (4 rows; row 0 of the data is the setup
    bag [1, 2] with weights [10, 100]) with a f0__weight column; one-hot f1 (3 rows), no weights."""
    import numpy as np
    import pyarrow as pa

    from dlrmctl.data.columnar import FORMAT_VERSION, ShardWriter, shard_schema, weight_column, write_meta

    rng = np.random.default_rng(0)
    bags = [[1, 2]] + [list(rng.integers(0, 4, size=int(rng.integers(0, 4)))) for _ in range(ROWS - 1)]
    wts = [[10.0, 100.0]] + [list(rng.uniform(0.5, 2.0, size=len(b)).astype(np.float32)) for b in bags[1:]]
    f1 = rng.integers(0, 3, size=ROWS)
    label = (rng.random(ROWS) < 0.4).astype(np.float32)
    cols = {"label": label, "d0": rng.normal(size=ROWS).astype(np.float32),
            "f0": pa.array(bags, type=pa.list_(pa.int64())), "f1": f1}
    if weights:
        cols[weight_column("f0")] = pa.array(wts, type=pa.list_(pa.float32()))
    schema = shard_schema(["d0"], ["f0", "f1"], multi_hot=[True, False], weighted=[weights, False])
    splits = {}
    for split in ("train", "val"):
        w = ShardWriter(d / "parts" / f"{split}.arrow", schema)
        for lo, hi in ((0, 15), (15, ROWS)):  # two record batches
            w.write({k: v[lo:hi] for k, v in cols.items()})
        w.close()
        splits[split] = {"rows": ROWS, "files": [f"parts/{split}.arrow"]}
    write_meta(d, {
        "format_version": FORMAT_VERSION, "dataset": "handmade", "dense_features": ["d0"],
        "sparse_features": [{"name": "f0", "num_embeddings": 4, "multi_hot": True, **({"weighted": True} if weights else {})},
                            {"name": "f1", "num_embeddings": 3, "multi_hot": False}],
        "label": "label", "splits": splits, "vocab_files": {},
    })
    return str(d)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("wdata"))


def test_loader_reads_weights_of_weighted_features_and_1_for_the_others(data, tmp_path):
    from dlrmctl.data.columnar import DataError
    from dlrmctl.data.loader import BatchLoader

    b = next(iter(BatchLoader(data, "train", 2, features=["f0", "f1"], weighted_features=["f0"], prefetch=0)))
    kjt = b.sparse_features
    n0 = int(kjt.lengths()[:2].sum())
    assert kjt.values()[:2].tolist() == [1, 2] and kjt.weights()[:2].tolist() == [10.0, 100.0]
    assert kjt.weights().dtype == torch.float32 and kjt.weights().numel() == kjt.values().numel()
    assert kjt.weights()[n0:].tolist() == [1.0, 1.0]  # f1: unweighted table -> 1.0
    # with shuffling and several record batches the weights stay with their ids
    every = BatchLoader(data, "train", ROWS, features=["f0"], weighted_features=["f0"], prefetch=0)
    ref = next(iter(every)).sparse_features.to_dict()["f0"]
    pairs = {(tuple(v.tolist()), tuple(w.tolist())) for v, w in zip(ref.to_dense(), ref.to_dense_weights())}
    assert len(pairs) > 20
    for batch in BatchLoader(data, "train", 7, shuffle=True, seed=3, weighted_features=["f0"], prefetch=1):
        jt = batch.sparse_features.to_dict()["f0"]
        assert jt.weights().numel() == jt.values().numel()
        for v, w in zip(jt.to_dense(), jt.to_dense_weights()):
            assert (tuple(v.tolist()), tuple(w.tolist())) in pairs
    # no weighted features: no weights (the unweighted model's input is unchanged)
    assert next(iter(BatchLoader(data, "train", 2, prefetch=0))).sparse_features.weights_or_none() is None
    with pytest.raises(DataError, match=r"feature 'f1' is weighted .*no 'f1__weight' column"):
        BatchLoader(data, "train", 2, weighted_features=["f1"])
    with pytest.raises(DataError, match=r"feature 'f0' is weighted"):
        BatchLoader(write_data(tmp_path, weights=False), "train", 2, weighted_features=["f0"])


def test_loader_repeats_a_one_hot_weight_over_its_multi_hot_expansion(tmp_path):
    import numpy as np

    from dlrmctl.data.loader import BatchLoader
    from dlrmctl.data.synthetic import generate_synthetic

    generate_synthetic(tmp_path, rows=50, seed=1, num_embeddings=30, weighted_features=["C2"])
    ld = BatchLoader(tmp_path, "train", 5, features=["C1", "C2"], weighted_features=["C2"], prefetch=0,
                     multi_hot_sizes={"C2": 3})
    k = next(iter(ld)).sparse_features
    plain = next(iter(BatchLoader(tmp_path, "train", 5, features=["C2"], weighted_features=["C2"], prefetch=0)))
    w2 = k.to_dict()["C2"].weights()
    assert k.lengths()[5:].tolist() == [3] * 5
    np.testing.assert_array_equal(w2.numpy(), np.repeat(plain.sparse_features.weights().numpy(), 3))
    assert k.to_dict()["C1"].weights().tolist() == [1.0] * 5


def test_synthetic_weighted_features_flag_writes_weight_columns_and_leaves_the_rest(tmp_path):
    import numpy as np

    from dlrmctl.data.columnar import open_split, read_meta
    from dlrmctl.data.synthetic import generate_synthetic

    generate_synthetic(tmp_path / "w", rows=400, seed=2, num_embeddings=50, weighted_features=["C1", "C9"])
    generate_synthetic(tmp_path / "p", rows=400, seed=2, num_embeddings=50)
    mw, mp = read_meta(tmp_path / "w"), read_meta(tmp_path / "p")
    assert [f["name"] for f in mw["sparse_features"] if f.get("weighted")] == ["C1", "C9"]
    assert not any(f.get("weighted") for f in mp["sparse_features"]) and "weights" not in mp["transforms"]
    w, p = open_split(tmp_path / "w", "train"), open_split(tmp_path / "p", "train")
    assert w.shards[0].columns == p.shards[0].columns + ["C1__weight", "C9__weight"]
    for c in ["I1", "C1", "C9", "C26"]:  # ids and dense values: the same rows
        np.testing.assert_array_equal(w.shards[0].read_column(c), p.shards[0].read_column(c))
    wc = w.shards[0].read_column("C1__weight")
    assert wc.dtype == np.float32 and 0.5 <= wc.min() and wc.max() <= 2.0
    from typer.testing import CliRunner

    from dlrmctl.cli import app

    r = CliRunner().invoke(app, ["preprocess", "synthetic", "--out", str(tmp_path / "c"), "--rows", "100",
                                 "--num-embeddings", "20", "--weighted-features", "C3"])
    assert r.exit_code == 0, r.output
    assert [f["name"] for f in read_meta(tmp_path / "c")["sparse_features"] if f.get("weighted")] == ["C3"]


# ------------------------------------------------------- training / resume
def _trainer(env, cfg_dict, resume=False, plan=None):
    from dlrmctl.config import config_from_dict
    from dlrmctl.distributed.env import RunEnv
    from dlrmctl.train.trainer import Trainer
    from dlrmctl.train.run_dir import prepare_run_dir

    cfg = config_from_dict(cfg_dict)
    renv = RunEnv() if env is None else RunEnv(env.rank, env.world_size, env.local_world_size, env.device, env)
    if renv.is_main:
        prepare_run_dir(cfg, resume=resume, overwrite=False)
    renv.barrier()
    torch.manual_seed(cfg.train.seed)
    return Trainer(cfg, renv, f"{cfg.train.run_dir}/{cfg.name}", resume=resume, plan=plan)


def _losses(run_dir):
    import json

    return {r["step"]: r["loss"] for r in map(json.loads, open(f"{run_dir}/metrics.jsonl")) if r["kind"] == "train"}


def _setup_batch_output(trainer):
    """The pooled f0 of data row 0 (the setup bag) in train and in eval mode, with T0's rows set to [i]*4."""
    sa = trainer.model.sparse_arch
    set_rows({"T0": sa.embedding_weights()["T0"]})
    batch = next(iter(trainer.train_loader))
    out = [sa(batch.sparse_features)["f0"][:1].tolist()]
    trainer.model.eval()
    with torch.no_grad():
        out.append(sa(batch.sparse_features)["f0"][:1].tolist())
    trainer.model.train()
    return out


def test_trainer_feeds_the_weights_in_training_and_eval(data, tmp_path):
    t = _trainer(None, _cfg_dict(data, str(tmp_path)))
    assert t.model.sparse_arch.is_weighted() and t.weighted
    assert _setup_batch_output(t) == [WANT, WANT]
    m = t.evaluate()  # the eval loader carries the weights too (a weighted EBC without them raises)
    assert m["num_samples"] == ROWS


def test_tables_derived_from_the_data_are_weighted_where_meta_json_marks_the_feature(data, tmp_path):
    from dlrmctl.config import ConfigError, config_from_dict, read_data_meta, resolve_tables, weighted_features
    from dlrmctl.train.factory import build_model

    raw = _cfg_dict(data, str(tmp_path), "derived")
    raw["model"]["tables"] = []  # t_f0 (meta.json: weighted) and t_f1
    raw["model"]["embedding_dim"] = 4
    cfg = config_from_dict(raw)
    meta = read_data_meta(cfg)
    assert weighted_features(cfg) == [] and weighted_features(cfg, meta) == ["f0"]
    assert build_model(cfg, resolve_tables(cfg, meta), 1).sparse_arch.is_weighted()  # meta read from data.path
    # without meta.json there: the file named, not an unweighted model by default
    gone = config_from_dict(dict(raw, data=dict(raw["data"], path=str(tmp_path / "nodata"))))
    with pytest.raises(ConfigError, match=rf"{tmp_path / 'nodata' / 'meta.json'}: not found; model.tables is empty"):
        build_model(gone, resolve_tables(cfg, meta), 1)
    t = _trainer(None, raw)
    assert t.weighted and t.model.sparse_arch.is_weighted()
    sa = t.model.sparse_arch
    set_rows({"t_f0": sa.embedding_weights()["t_f0"]})
    assert sa(next(iter(t.train_loader)).sparse_features)["f0"][:1].tolist() == WANT  # 10 * 1 + 100 * 2
    assert t.evaluate()["num_samples"] == ROWS


def test_hand_written_tables_checked_against_meta_json(data, tmp_path):
    from dlrmctl.config import ConfigError, check_tables_against_meta, config_from_dict, read_data_meta

    raw = _cfg_dict(data, str(tmp_path))
    meta = read_data_meta(config_from_dict(raw))
    assert check_tables_against_meta(config_from_dict(raw), meta) == []
    raw["model"]["tables"][0]["weighted"] = False
    (w,) = check_tables_against_meta(config_from_dict(raw), meta)
    assert "model.tables[0].weighted is false" in w and "feature 'f0' of table 'T0'" in w and "ignored" in w
    raw = _cfg_dict(data, str(tmp_path))
    raw["model"]["tables"][0]["num_embeddings"] = 3  # meta.json: f0 has 4 ids
    with pytest.raises(ConfigError, match=r"model.tables\[0\].num_embeddings: table 'T0' has 3 rows but .*meta.json "
                       r"gives feature 'f0' 4 ids \(0 .. 3\); set num_embeddings >= 4"):
        check_tables_against_meta(config_from_dict(raw), meta)
    raw["model"]["on_invalid_id"] = "zero"  # a deliberate cap: those ids pool to zero
    (w,) = check_tables_against_meta(config_from_dict(raw), meta)
    assert "'T0' has 3 rows" in w and "ids >= 3 pool to zero vectors" in w
    raw["model"]["tables"][0]["num_embeddings"] = None  # sized from the data
    assert check_tables_against_meta(config_from_dict(raw), meta) == []


def test_train_refuses_a_table_smaller_than_meta_json_before_training(data, tmp_path):
    import yaml
    from typer.testing import CliRunner

    from dlrmctl.cli import app

    raw = _cfg_dict(data, str(tmp_path / "runs"), "small")
    raw["model"]["tables"][0]["num_embeddings"] = 3
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    r = CliRunner().invoke(app, ["train", str(tmp_path / "c.yaml")])
    assert r.exit_code == 2, r.output
    assert "error: model.tables[0].num_embeddings: table 'T0' has 3 rows" in r.output and "'f0' 4 ids" in r.output
    assert not (tmp_path / "runs" / "small" / "metrics.jsonl").exists()


def test_weighted_run_resumes_with_the_same_per_step_losses(data, tmp_path):
    runs = str(tmp_path)
    _trainer(None, _cfg_dict(data, runs, "s", max_steps=8)).train()
    _trainer(None, _cfg_dict(data, runs, "r", max_steps=4)).train()
    t = _trainer(None, _cfg_dict(data, runs, "r", max_steps=8), resume=True)
    assert t.step == 4
    t.train()
    s, r = _losses(f"{runs}/s"), _losses(f"{runs}/r")
    assert sorted(s) == list(range(1, 9))
    for step in range(5, 9):
        assert r[step] == s[step], step
    # the weights matter: the same run on unweighted tables learns something else
    raw = _cfg_dict(data, runs, "u", max_steps=8)
    raw["model"]["tables"][0]["weighted"] = False
    _trainer(None, raw).train()
    assert _losses(f"{runs}/u")[8] != s[8]


def _two_rank_cfg(data, runs, name):
    raw = _cfg_dict(data, runs, name, max_steps=7)
    raw["data"]["num_samples"] = 33  # the last global batch has 1 row: rank 1 steps on an empty batch
    return raw


def _two_rank_training(env, data, runs):
    from dlrmctl.distributed.model_parallel import plan_from_types
    from dlrmctl.modules.embedding_configs import EmbeddingBagConfig

    tables = [EmbeddingBagConfig(name="T0", num_embeddings=4, embedding_dim=4, feature_names=["f0"]),
              EmbeddingBagConfig(name="T1", num_embeddings=3, embedding_dim=4, feature_names=["f1"])]
    out = {}
    for st in ("row_wise", "table_wise"):
        plan = plan_from_types(tables, {"T0": st, "T1": "data_parallel"}, env.world_size)
        t = _trainer(env, _two_rank_cfg(data, runs, f"d_{st}"), plan=plan)
        assert t.model.sparse_arch.is_weighted()
        t.train()
        out[st] = _losses(f"{runs}/d_{st}") if env.rank == 0 else None
    return out


def test_weighted_training_on_2_gloo_ranks_matches_one_process(data, tmp_path):
    runs = str(tmp_path)
    _trainer(None, _two_rank_cfg(data, runs, "one")).train()
    one = _losses(f"{runs}/one")
    res = run_multiprocess(_two_rank_training, 2, data, runs, timeout_s=240)
    for st, two in res[0].items():
        assert sorted(two) == sorted(one)
        for step in one:
            assert two[step] == pytest.approx(one[step], abs=1e-5), (st, step)


# ------------------------------------------------------------------ export
LOGIT = 0.01 * 210.0  # setup_dlrm: logit = sum_j d_j * pooled_j with d = [0.001, 0.002, 0.003, 0.004]


def setup_dlrm(weighted: bool = True, extra: bool = False, kernel: str = "dense"):
    """A DLRM over the setup tables whose logit is ``sum_j d_j * pooled_f0_j`` (+ the same for f1
    with ``extra``), d = [0.001 .. 0.004]: 2.1 for the setup sample (0.03 unweighted)."""
    from dlrmctl.modules.dlrm import DLRM

    ebc = EmbeddingBagCollection(setup_tables(extra), is_weighted=weighted, compute_kernel=kernel)
    set_rows(ebc.embedding_weights())
    F = len(ebc.feature_names())
    model = DLRM(ebc, 1, [4], [1], F, 4)
    with torch.no_grad():
        lin = model.dense_arch.model.model[0]
        lin.weight.zero_()
        lin.bias.copy_(torch.tensor([0.001, 0.002, 0.003, 0.004]))
        over = model.over_arch.model.model[0]
        over.weight.zero_()
        over.bias.zero_()
        # interaction output: [d (4), d.e_1, .., d.e_F, then e_i.e_j pairs]
        over.weight[0, 4:4 + F] = 1.0
    return model.eval()


def setup_inputs(extra: bool = False):
    dense = torch.zeros(1, 1)
    if not extra:
        return dense, torch.tensor([1, 2]), torch.tensor([2]), torch.tensor([10.0, 100.0])
    # f1: id 2 with weight 5.0, which the unweighted table T1 ignores
    return dense, torch.tensor([1, 2, 2]), torch.tensor([2, 1]), torch.tensor([10.0, 100.0, 5.0])


needs_fbgemm = pytest.mark.skipif(not HAS_FBGEMM, reason="export needs fbgemm_gpu")


@needs_fbgemm
@pytest.mark.parametrize("artifact", ["pt2", "torchscript"])
@pytest.mark.parametrize("dtype", ["fp32", "int8", "int4"])
def test_weighted_export_gives_210_and_the_eager_score(tmp_path, dtype, artifact):
    import math

    from dlrmctl.inference.export import ExportError, ExportOptions, export_model, load_exported

    model = setup_dlrm()
    dense, values, lengths, weights = setup_inputs()
    with torch.no_grad():
        eager = torch.sigmoid(model(dense, setup_kjt())).item()
    assert eager == pytest.approx(1 / (1 + math.exp(-LOGIT)), abs=1e-6)
    res = export_model(model, tmp_path / "m", ExportOptions(dtype, artifact=artifact))
    man = res.manifest
    assert man["weighted_features"] == ["f0"] and man["tables"][0]["weighted"] is True
    assert man["inputs"]["weights"]["features"] == ["f0"] and man["inputs"]["weights"]["dtype"] == "float32"
    m = load_exported(tmp_path / "m")
    assert m.weighted_features == ["f0"]
    if artifact == "torchscript":  # the TorchScript module's parts (the .pt2 program is one graph)
        # rows [i]*4 are constant rows: exact in int8 / int4 (scale 0, bias = i)
        assert m.module.embeddings(values, lengths, weights).tolist() == WANT
        assert m.module.logits(dense, values, lengths, weights).tolist() == pytest.approx([LOGIT], abs=1e-6)
    assert m.score(dense, values, lengths, weights).tolist() == pytest.approx([eager], abs=1e-6)
    assert m.score_kjt(dense, setup_kjt()).tolist() == pytest.approx([eager], abs=1e-6)
    with pytest.raises(ExportError, match=r"has weighted features \['f0'\]: pass weights \[N\] float32"):
        m.score(dense, values, lengths)
    with pytest.raises(ExportError, match=r"weights must be \[N\] float32 with N = len\(values\) = 2"):
        m.score(dense, values, lengths, torch.tensor([10.0]))
    with pytest.raises(ExportError, match=r"weights must be \[N\] float32"):
        m.score(dense, values, lengths, torch.tensor([10, 100]))


@needs_fbgemm
@pytest.mark.parametrize("artifact", ["pt2", "torchscript"])
def test_weighted_export_ignores_the_weights_of_unweighted_tables(tmp_path, artifact):
    from dlrmctl.inference.export import ExportOptions, export_model, load_exported

    model = setup_dlrm(extra=True)
    dense, values, lengths, weights = setup_inputs(extra=True)
    export_model(model, tmp_path / "m", ExportOptions("int8", weighted_features=["f0"], artifact=artifact))
    m = load_exported(tmp_path / "m")
    assert m.manifest["weighted_features"] == ["f0"]
    assert [t["weighted"] for t in m.manifest["tables"]] == [True, False]
    if artifact == "torchscript":
        assert m.module.embeddings(values, lengths, weights).tolist() == [[210.0] * 4 + [2.0] * 4]
    # what the loader gives the weighted EBC: 1.0 for the unweighted table's ids
    kjt = KeyedJaggedTensor(["f0", "f1"], values, lengths=lengths, weights=torch.tensor([10.0, 100.0, 1.0]))
    with torch.no_grad():
        assert model.sparse_arch(kjt).values().tolist() == [[210.0] * 4 + [2.0] * 4]
        eager = torch.sigmoid(model(dense, kjt)).reshape(-1).tolist()
    assert m.score(dense, values, lengths, weights).tolist() == pytest.approx(eager, abs=1e-6)


@needs_fbgemm
@pytest.mark.parametrize("artifact", ["pt2", "torchscript"])
def test_unweighted_export_keeps_its_interface_and_refuses_weights(tmp_path, artifact):
    from dlrmctl.inference.export import ExportError, ExportOptions, export_model, load_exported

    model = setup_dlrm(weighted=False)
    dense, values, lengths, weights = setup_inputs()
    res = export_model(model, tmp_path / "m", ExportOptions("int8", artifact=artifact))
    assert res.manifest["weighted_features"] == [] and "weights" not in res.manifest["inputs"]
    assert res.manifest["format_version"] == 1
    m = load_exported(tmp_path / "m")
    if artifact == "torchscript":
        assert m.module.embeddings(values, lengths).tolist() == [[3.0] * 4]
        assert m.module(dense, values, lengths).tolist() == pytest.approx(m.score(dense, values, lengths).tolist())
    with pytest.raises(ExportError, match=r"no weighted features .* takes no weights"):
        m.score(dense, values, lengths, weights)
    with pytest.raises(ExportError, match=r"EmbeddingBagCollection is unweighted but weighted_features is \['f0'\]"):
        export_model(model, tmp_path / "x", ExportOptions("int8", weighted_features=["f0"]))
    with pytest.raises(ExportError, match=r"weighted_features \['nope'\] are not features"):
        export_model(setup_dlrm(), tmp_path / "y", ExportOptions("int8", weighted_features=["nope"]))


@needs_fbgemm
def test_export_run_evaluate_and_predict_of_a_weighted_run(data, tmp_path):
    from dlrmctl.inference.export import ExportError, evaluate_exported, export_run, load_exported
    from dlrmctl.inference.predict import predict_file
    from dlrmctl.train.reload import evaluate_run

    runs = str(tmp_path)
    _trainer(None, _cfg_dict(data, runs, "e", max_steps=6)).train()
    res = export_run(f"{runs}/e", "fp32", tmp_path / "m")
    assert res.manifest["weighted_features"] == ["f0"]
    assert [t["weighted"] for t in res.manifest["tables"]] == [True, False]
    want = evaluate_run(f"{runs}/e", "val")
    got = evaluate_exported(tmp_path / "m", data, "val")
    assert got["num_samples"] == want["num_samples"] == ROWS
    for k in ("auc", "logloss"):
        assert got[k] == pytest.approx(want[k], abs=1e-6), k
    raw = tmp_path / "raw.tsv"
    raw.write_text("0\t1\n")
    with pytest.raises(ExportError, match=r"weighted features \['f0'\] and needs per-id weights"):
        predict_file(tmp_path / "m", raw, tmp_path / "out.csv")
    assert not (tmp_path / "out.csv").exists()
    assert load_exported(tmp_path / "m").weighted_features == ["f0"]


def test_cpp_input_file_carries_the_weights(tmp_path):
    import struct

    import numpy as np

    from dlrmctl.inference.predict import write_cpp_input

    dense, values, lengths, weights = setup_inputs()
    write_cpp_input(tmp_path / "w.bin", dense, values, lengths, weights)
    raw = (tmp_path / "w.bin").read_bytes()
    assert raw[:8] == b"DLRMIN02" and struct.unpack("<4q", raw[8:40]) == (1, 1, 2, 1)
    assert np.frombuffer(raw[-8:], dtype="<f4").tolist() == [10.0, 100.0]
    write_cpp_input(tmp_path / "p.bin", dense, values, lengths)
    assert (tmp_path / "p.bin").read_bytes()[:8] == b"DLRMIN01" and len(raw) == (tmp_path / "p.bin").stat().st_size + 8
    with pytest.raises(ValueError, match="one entry per value"):
        write_cpp_input(tmp_path / "x.bin", dense, values, lengths, weights[:1])


def test_a_run_from_before_the_weighted_record_is_refused_until_the_record_says_how_it_trained(data, tmp_path):
    """Each checkpoint's meta.json records the resolved weighted features.  A checkpoint written
    before that record, of tables derived from the data while meta.json marks f0 weighted, may have
    trained either way (older versions ignored the mark, later ones read it): evaluate, export and
    resume refuse it, naming the file and f0.  With the record added by hand they build the model
    it names: ``[]`` unweighted (the weighted model would pool f0's bags with their weights: other
    scores), ``["f0"]`` weighted."""
    import glob
    import json

    import yaml

    from dlrmctl.config import ConfigError
    from dlrmctl.inference.export import export_run
    from dlrmctl.train.checkpoint import load_checkpoint_meta
    from dlrmctl.train.reload import evaluate_run

    runs = str(tmp_path)
    derived = _cfg_dict(data, runs, "d", max_steps=3)
    derived["model"]["tables"], derived["model"]["embedding_dim"] = [], 4  # t_f0 (meta.json: weighted), t_f1
    _trainer(None, derived).train()
    assert [load_checkpoint_meta(p)["weighted_features"] for p in glob.glob(f"{runs}/d/checkpoints/step_*")] == [["f0"]]
    want_weighted = evaluate_run(f"{runs}/d", "val")

    # an old run: the tables derivation gave (t_f0 4 x 4, t_f1 3 x 4), unweighted
    raw = _cfg_dict(data, runs, "old", max_steps=6)
    raw["model"]["tables"] = [{"name": "t_f0", "num_embeddings": 4, "embedding_dim": 4, "feature_names": ["f0"]},
                              {"name": "t_f1", "num_embeddings": 3, "embedding_dim": 4, "feature_names": ["f1"]}]
    _trainer(None, raw).train()
    run = f"{runs}/old"
    want = evaluate_run(run, "val")

    def set_record(run_dir, record):  # as written before the record (None), or with the record a user adds
        ps = glob.glob(f"{run_dir}/checkpoints/step_*/meta.json")
        assert ps
        for p in ps:
            m = json.load(open(p))
            m.pop("weighted_features", None)
            json.dump(m if record is None else dict(m, weighted_features=record), open(p, "w"))
        return ps

    set_record(run, None)
    cfg = yaml.safe_load(open(f"{run}/config.yaml"))
    cfg["model"]["tables"], cfg["model"]["embedding_dim"] = [], 4  # as derived from the data
    yaml.safe_dump(cfg, open(f"{run}/config.yaml", "w"))

    old = dict(derived, name="old", train=dict(derived["train"], max_steps=8))
    for refused in (lambda: evaluate_run(run, "val"), lambda: export_run(run, "fp32", tmp_path / "x"),
                    lambda: _trainer(None, old, resume=True)):
        with pytest.raises(ConfigError, match=rf'^{run}/checkpoints/step_\d+/meta.json: no "weighted_features" record.*marks "f0" weighted'):
            refused()
    assert not (tmp_path / "x").exists()

    set_record(run, [])  # "trained unweighted"
    got = evaluate_run(run, "val")
    assert got["logloss"] == want["logloss"] and got["auc"] == want["auc"]
    assert export_run(run, "fp32", tmp_path / "m").manifest["weighted_features"] == []
    t = _trainer(None, old, resume=True)
    assert t.step == 6 and not t.weighted and not t.model.sparse_arch.is_weighted()
    t.train()
    assert load_checkpoint_meta(f"{run}/checkpoints/step_00000008")["weighted_features"] == []

    set_record(f"{runs}/d", None)  # the weighted run without its record: refused, then read as "f0"
    with pytest.raises(ConfigError, match='marks "f0" weighted'):
        evaluate_run(f"{runs}/d", "val")
    set_record(f"{runs}/d", ["f0"])
    assert evaluate_run(f"{runs}/d", "val") == want_weighted
