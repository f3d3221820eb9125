"""The MLPerf DLRMv2 config: plans on 8 x H100, trains at reduced scale on synthetic
data of the same schema with on-the-fly multi-hot bags."""

import json

import pytest
from typer.testing import CliRunner

from dlrmctl.cli import app
from dlrmctl.config import load_config
from dlrmctl.data.loader import BatchLoader
from dlrmctl.train.data import multi_hot_kwargs

from tests.conftest import REPO

CFG = REPO / "configs" / "criteo_1tb_dlrmv2.yaml"
runner = CliRunner()


def test_dlrmv2_plans_on_8_h100(tmp_path):
    r = runner.invoke(app, ["plan", str(CFG), "--gpus", "8", "--device", "h100", "--out", str(tmp_path / "plan.yaml")],
                      catch_exceptions=False)
    assert r.exit_code == 0, r.output
    from dlrmctl.config import resolve_tables
    from dlrmctl.distributed.types import ShardingPlan

    plan = ShardingPlan.load(tmp_path / "plan.yaml")
    plan.validate(resolve_tables(load_config(CFG)), 8)


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    from dlrmctl.data.synthetic import generate_synthetic

    d = tmp_path_factory.mktemp("dlrmv2")
    generate_synthetic(d, rows=3000, seed=0, num_embeddings=[200] * 26)
    return d


SHRINK = ["model.tables=[]", "model.embedding_dim=8", "model.dense_arch_layer_sizes=[16, 8]",
          "model.over_arch_layer_sizes=[16, 8, 1]", "model.dcn_low_rank_dim=4", "data.batch_size=256",
          "data.eval_batch_size=1024", "train.max_steps=4", "train.eval_every=0", "train.progress=false"]


def test_multi_hot_sizes_give_bags_of_exactly_those_lengths(small_data):
    cfg = load_config(CFG, [f"data.path={small_data}"] + SHRINK)
    meta = json.load(open(small_data / "meta.json"))
    loader = BatchLoader(small_data, "train", 64, prefetch=0, **multi_hot_kwargs(cfg, meta))
    batch = next(iter(loader))
    lengths = batch.sparse_features.lengths_2d()
    for i, size in enumerate(cfg.data.multi_hot_sizes):
        assert lengths[i].tolist() == [size] * 64
    again = next(iter(BatchLoader(small_data, "train", 64, prefetch=0, **multi_hot_kwargs(cfg, meta))))
    assert again.sparse_features.values().equal(batch.sparse_features.values())  # deterministic


def test_dlrmv2_trains_at_reduced_scale_with_dcn_and_multi_hot(small_data, tmp_path):
    args = ["train", str(CFG), "--set", f"data.path={small_data}", "--set", f"train.run_dir={tmp_path}"]
    for s in SHRINK:
        args += ["--set", s]
    r = runner.invoke(app, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    summary = json.load(open(tmp_path / "criteo_1tb_dlrmv2" / "summary.json"))
    assert summary["steps"] == 4 and 0.0 <= summary["final"]["auc"] <= 1.0
