"""Managed-collision tables sharded row_wise by zone over 2 and 4 gloo ranks train as one process:
the same losses (to fp32 rounding: partial sums are added across ranks), exactly the same remapper
state in the checkpoint, and the same evaluation (misses included); unsupported layouts are
refused before any rank starts."""

from __future__ import annotations

import json
import os

import pytest
import torch
from typer.testing import CliRunner

from dlrmctl.cli import app
from dlrmctl.config import load_config
from dlrmctl.distributed.env import RunEnv
from dlrmctl.train.trainer import Trainer
from tests.conftest import REPO
from tests.dist_utils import run_multiprocess
from tests.helpers.raw_ids import write_zipf_criteo_lines

runner = CliRunner()
STEPS = 12


@pytest.fixture(scope="module")
def raw_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("mc_sharded")
    write_zipf_criteo_lines(d / "t.tsv", 700, 1.1, seed=1)
    r = runner.invoke(app, ["preprocess", "criteo", "-i", str(d / "t.tsv"), "-o", str(d / "data"), "--raw-ids",
                            "--val-ratio", "0.15", "-q"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return str(d / "data")


def _overrides(data, run_root, name, kernel, optimizer="exact_rowwise_adagrad", steps=STEPS):
    return [f"data.path={data}", f"train.run_dir={run_root}", f"name={name}", "data.batch_size=32",
            "model.embedding_dim=8", "model.dense_arch_layer_sizes=[16, 8]", "model.over_arch_layer_sizes=[8, 1]",
            "model.dropout=0", "model.managed_collision.size=128", "model.managed_collision.buckets=4",
            "model.managed_collision.eviction=lru", f"model.compute_kernel={kernel}",
            f"optimizer.embedding.type={optimizer}", "train.log_every=1", f"train.checkpoint_every={steps}",
            "train.eval_every=0", "train.progress=false", f"train.max_steps={steps}",
            "train.early_stopping_patience=0"]


def _run(env, data, run_root, name, kernel, steps=STEPS, resume=False):
    cfg = load_config(REPO / "configs" / "demo.yaml", _overrides(data, run_root, name, kernel, steps=steps))
    renv = RunEnv() if env is None else RunEnv(env.rank, env.world_size, env.local_world_size, env.device, env)
    run = os.path.join(run_root, name)
    if renv.is_main:
        os.makedirs(run, exist_ok=True)
    t = Trainer(cfg, renv, run, resume=resume)
    plan = None if t.plan is None else {n: (ps.sharding_type.value, [m.to_dict() for m in ps.shards])
                                        for n, ps in t.plan.plan.items()}
    out = t.train()
    if not renv.is_main:
        return None
    with open(os.path.join(run, "metrics.jsonl")) as f:
        losses = [r["loss"] for r in map(json.loads, f) if r["kind"] == "train"]
    return plan, losses, out["final"]


def _train_cli(data, run_root, name, steps):
    sets = [a for o in _overrides(data, run_root, name, "dense", steps=steps) for a in ("--set", o)]
    r = runner.invoke(app, ["train", str(REPO / "configs" / "demo.yaml"), *sets], catch_exceptions=False)
    assert r.exit_code == 0, r.output


def _mc_state(run, name=f"step_{STEPS:08d}"):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    p = os.path.join(run, "checkpoints", name)
    md = FileSystemReader(p).read_metadata()
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
          if k.startswith("mc/")}
    dcp.load(sd, checkpoint_id=p)
    return sd


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["fused", "dense"])
def test_row_wise_managed_collision_on_2_and_4_ranks_equals_one_process(raw_data, tmp_path, kernel):
    from dlrmctl import HAS_FBGEMM

    if kernel == "fused" and not HAS_FBGEMM:
        pytest.skip("fbgemm_gpu is not installed")
    _, single, final1 = _run(None, raw_data, str(tmp_path), "one", kernel)
    ref = _mc_state(tmp_path / "one")
    assert ref and len(single) == STEPS
    held = int((ref["mc/t_C1.row_ids"][:128] != (1 << 63) - 1).sum())
    assert held == 128  # the table filled up: later steps evicted
    for world in (2, 4):
        plan, losses, final = run_multiprocess(_run, world, raw_data, str(tmp_path), f"w{world}", kernel,
                                               timeout_s=400)[0]
        st, shards = plan["t_C1"]
        assert st == "row_wise" and [s["offsets"][0] for s in shards] == [r * 128 // world for r in range(world)]
        diffs = [abs(a - b) for a, b in zip(single, losses)]
        assert len(losses) == STEPS and max(diffs) < 1e-5, (world, diffs)
        got = _mc_state(tmp_path / f"w{world}")
        assert set(got) == set(ref)
        for k in ref:
            assert torch.equal(got[k], ref[k]), (world, k)
        assert final["num_samples"] == final1["num_samples"]
        assert abs(final["logloss"] - final1["logloss"]) < 1e-5, (world, final, final1)


def test_a_managed_collision_table_given_another_sharding_or_buckets_not_a_multiple_of_the_ranks_is_refused_before_launch(
        raw_data, tmp_path):
    base = ["train", str(REPO / "configs" / "demo.yaml"), "--nproc", "2"]
    ov = _overrides(raw_data, tmp_path, "x", "dense")
    sets = [a for o in ov for a in ("--set", o)]
    r = runner.invoke(app, base + sets + ["--set", "sharding.tables={t_C3: {sharding_type: table_wise}}"])
    assert r.exit_code == 2 and "sharding.tables.t_C3.sharding_type" in r.output and "row_wise" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1
    r = runner.invoke(app, base + sets + ["--set", "model.managed_collision.buckets=1"])
    assert r.exit_code == 2 and "model.managed_collision.buckets" in r.output and "multiple of 2" in r.output, r.output
    assert "e.g. --set model.managed_collision.buckets=2" in r.output, r.output  # the fix, ready to paste
    assert not os.path.exists(tmp_path / "x" / "logs")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_one_process_checkpoint_resharded_to_2_ranks_resumes_as_the_uninterrupted_run(raw_data, tmp_path):
    """``checkpoint reshard --nproc 2`` lays the managed table out by zone and copies the remapper
    entries; 2 ranks resuming from it continue exactly as one process that never stopped."""
    _, single, _ = _run(None, raw_data, str(tmp_path), "one", "dense")
    _train_cli(raw_data, tmp_path, "r", STEPS // 2)
    r = runner.invoke(app, ["checkpoint", "reshard", str(tmp_path / "r"), "--nproc", "2"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    name = f"step_{STEPS // 2:08d}_ws2"
    with open(tmp_path / "r" / "checkpoints" / name / "meta.json") as f:
        shards = json.load(f)["plan"]["tables"]["t_C1"]["shards"]
    assert [(s["rank"], s["offsets"][0], s["sizes"][0]) for s in shards] == [(0, 0, 64), (1, 64, 65)]
    src = _mc_state(tmp_path / "r", f"step_{STEPS // 2:08d}")
    moved = _mc_state(tmp_path / "r", name)
    assert set(src) == set(moved) and all(torch.equal(src[k], moved[k]) for k in src)
    _, losses, _ = run_multiprocess(_run, 2, raw_data, str(tmp_path), "r", "dense", STEPS, True, timeout_s=400)[0]
    diffs = [abs(a - b) for a, b in zip(single, losses)]
    assert len(losses) == STEPS and max(diffs) < 1e-5, diffs
    ref, got = _mc_state(tmp_path / "one"), _mc_state(tmp_path / "r")
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_a_reshard_to_ranks_that_cannot_hold_the_managed_tables_is_one_line_naming_the_key(raw_data, tmp_path):
    _train_cli(raw_data, tmp_path, "r", 2)
    r = runner.invoke(app, ["checkpoint", "reshard", str(tmp_path / "r"), "--nproc", "3"])
    assert r.exit_code == 2 and "model.managed_collision.buckets" in r.output and "multiple of 3" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1
    # a trained run's buckets cannot change (reshard has no --set): the world sizes they allow, and a new run
    assert "--set" not in r.output, r.output
    assert "this run's 4 buckets split over 1, 2, 4 rank(s)" in r.output and "train a new run" in r.output, r.output
    sets = [a for o in _overrides(raw_data, tmp_path, "r", "dense", steps=4) for a in ("--set", o)]
    r = runner.invoke(app, ["train", str(REPO / "configs" / "demo.yaml"), *sets, "--resume", "--nproc", "3"])
    assert r.exit_code == 2 and "--set" not in r.output and "train a new run" in r.output, r.output  # resuming: the same


def test_plan_lays_managed_collision_tables_out_as_train_does_and_refuses_ranks_the_buckets_cannot_split(
        raw_data, tmp_path):
    """`dlrmctl plan --gpus N` writes the row_wise-by-zone layout training applies to managed-collision
    tables (so `train --plan` follows it unchanged), and refuses N that does not divide the buckets."""
    from dlrmctl.config import resolve_tables
    from dlrmctl.distributed.sharded_mc import managed_collision_sharding
    from dlrmctl.distributed.types import ShardingPlan

    ov = _overrides(raw_data, tmp_path, "p", "dense")
    sets = [a for o in ov for a in ("--set", o)]
    out = tmp_path / "plan2.yaml"
    r = runner.invoke(app, ["plan", str(REPO / "configs" / "demo.yaml"), "--gpus", "2", "--device", "cpu",
                            "--out", str(out), "--report", str(tmp_path / "r.txt"), *sets])
    assert r.exit_code == 0, r.output
    plan = ShardingPlan.load(str(out))
    cfg = load_config(REPO / "configs" / "demo.yaml", ov)
    tables = resolve_tables(cfg, json.loads(open(os.path.join(raw_data, "meta.json")).read()))
    assert tables
    for t in tables:
        want = managed_collision_sharding(t.num_embeddings, t.embedding_dim, 2, plan.plan[t.name].compute_kernel)
        assert plan.plan[t.name] == want, t.name
    r = runner.invoke(app, ["plan", str(REPO / "configs" / "demo.yaml"), "--gpus", "3", "--device", "cpu",
                            "--out", str(tmp_path / "plan3.yaml"), "--report", str(tmp_path / "r3.txt"), *sets])
    assert r.exit_code == 2 and "model.managed_collision.buckets" in r.output and "multiple of 3" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "plan3.yaml").exists()
