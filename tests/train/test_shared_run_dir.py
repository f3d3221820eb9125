"""A run over several nodes checks at start that every rank sees the checkpoint directory.

Two gloo ranks posing as two nodes (``local_world_size`` 1), each with its own path to the run
directory: a symlink to rank 0's (a shared filesystem) passes; a separate directory (a node-local
disk) fails on both ranks with the same one-line error naming rank 0's directory, the rank and
host that cannot see it and the remedy, before any training step (the Trainer raises it before
it reads the data).  One host: nothing is written and no collective is issued.  `dlrmctl launch`
of several nodes on a cluster scheduler says that train.run_dir must be shared.
"""

from __future__ import annotations

import os

import pytest
import torch
from typer.testing import CliRunner

from dlrmctl.cli import app
from tests.dist_utils import run_multiprocess

pytestmark = pytest.mark.multiprocess


def _node_paths(base: str, shared: bool) -> list[str]:
    """Rank 0's and rank 1's path to the run directory ``run`` (rank 1's through ``node1``)."""
    os.makedirs(os.path.join(base, "node0", "run"), exist_ok=True)
    if shared:
        os.symlink(os.path.join(base, "node0"), os.path.join(base, "node1"))
    else:
        os.makedirs(os.path.join(base, "node1", "run"), exist_ok=True)
    return [os.path.join(base, f"node{r}", "run") for r in range(2)]


def _check_worker(env, paths):
    from dlrmctl.train.checkpoint import CheckpointError, check_shared_checkpoint_dir

    try:
        check_shared_checkpoint_dir(paths[env.rank], env.rank, env.world_size, 1, env.pg)
    except CheckpointError as e:
        return str(e)
    return None


def _trainer_worker(env, paths):
    from dlrmctl.config import config_from_dict
    from dlrmctl.distributed.env import RunEnv
    from dlrmctl.errors import UserError
    from dlrmctl.train.trainer import Trainer

    cfg = config_from_dict({"data": {"path": "/nonexistent/data"},
                            "model": {"embedding_dim": 8, "dense_arch_layer_sizes": [16, 8]},
                            "train": {"run_dir": os.path.dirname(paths[env.rank])}})
    try:
        Trainer(cfg, RunEnv(env.rank, 2, 1, torch.device("cpu"), env), paths[env.rank])
    except UserError as e:
        return type(e).__name__, str(e)
    return None


def test_a_shared_run_directory_passes_and_leaves_nothing_behind(tmp_path):
    paths = _node_paths(str(tmp_path), shared=True)
    assert run_multiprocess(_check_worker, 2, paths, local_world_size=1, timeout_s=120) == [None, None]
    assert os.listdir(paths[0]) == []


def test_a_directory_one_node_cannot_see_fails_every_rank_with_one_line(tmp_path):
    paths = _node_paths(str(tmp_path), shared=False)
    errs = run_multiprocess(_check_worker, 2, paths, local_world_size=1, timeout_s=120)
    assert errs[0] is not None and errs[0] == errs[1]  # every rank alike, none waits out a timeout
    msg = errs[0]
    assert "\n" not in msg
    assert f"train.run_dir is not shared by all nodes: {paths[0]} (rank 0 on host " in msg
    assert f"rank 1 on host {os.uname().nodename}" in msg and f"(its path {paths[1]})" in msg
    assert "cannot see the check file rank 0 wrote there" in msg
    assert "put train.run_dir on a filesystem every node mounts at the same path" in msg
    assert os.listdir(paths[0]) == [] and os.listdir(paths[1]) == []  # the check files are gone


def test_the_trainer_checks_before_it_reads_anything(tmp_path):
    paths = _node_paths(str(tmp_path), shared=False)
    for kind, msg in run_multiprocess(_trainer_worker, 2, paths, local_world_size=1, timeout_s=120):
        assert kind == "CheckpointError" and "not shared by all nodes" in msg
    # shared: the check passes and the Trainer goes on to the data (which is missing here)
    paths = _node_paths(str(tmp_path / "ok"), shared=True)
    for kind, msg in run_multiprocess(_trainer_worker, 2, paths, local_world_size=1, timeout_s=120):
        assert kind == "TrainError" and "has no meta.json" in msg


def test_one_host_writes_nothing_and_issues_no_collective(tmp_path, monkeypatch):
    from dlrmctl.distributed import comm
    from dlrmctl.train.checkpoint import check_shared_checkpoint_dir

    def refuse(*a, **k):
        raise AssertionError("a collective on one host")

    monkeypatch.setattr(comm, "broadcast_object", refuse)
    monkeypatch.setattr(comm, "all_gather_object", refuse)
    run = tmp_path / "run"
    check_shared_checkpoint_dir(str(run), 0, 4, 4, object())  # 4 ranks, one host
    check_shared_checkpoint_dir(str(run), 0, 1, 1, None)  # one process
    assert not run.exists()


def test_launch_of_several_nodes_says_the_run_dir_must_be_shared():
    runner = CliRunner()
    args = ["launch", "configs/criteo_kaggle.yaml", "--scheduler", "slurm", "--dry-run", "--nproc", "8",
            "--gpus-per-proc", "1"]
    r = runner.invoke(app, args + ["--nnodes", "2", "--set", "train.run_dir=/shared/runs"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    lines = [ln for ln in r.output.splitlines() if "must be on a filesystem every node mounts" in ln]
    assert lines == ["note: 2 nodes: train.run_dir (/shared/runs) must be on a filesystem every node mounts at the "
                     "same path (every rank writes its checkpoint shards there; the run checks it before the first "
                     "step)"]
    r = runner.invoke(app, args, catch_exceptions=False)  # one node: not a word
    assert r.exit_code == 0 and "every node mounts" not in r.output
