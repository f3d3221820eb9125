"""The GPU path, checked on the CPU (issue 25): a GPU run is planned for its GPU, a planner
failure on rank 0 reaches every rank at once, the pipeline's order of host reads and
collectives, the host-sync kinds a CUDA step would pay for."""

import types

import pytest
import torch

from dlrmctl.config import config_from_dict
from tests.dist_utils import run_multiprocess

CONFIG = {
    "data": {"path": "/nonexistent", "batch_size": 64},
    "model": {"embedding_dim": 8, "dense_arch_layer_sizes": [16, 8],
              "tables": [{"name": f"t{i}", "num_embeddings": 1000} for i in range(4)]},
}


def _fake_gpu(monkeypatch, name="NVIDIA H100 80GB HBM3", total_memory=3 * 10**9):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: types.SimpleNamespace(total_memory=total_memory))


def _spy_topology(monkeypatch):
    from dlrmctl.planner import planner

    seen = []
    orig = planner.plan_config

    def spy(cfg, topo, *a, **kw):
        seen.append(topo)
        return orig(cfg, topo, *a, **kw)

    monkeypatch.setattr(planner, "plan_config", spy)
    return seen


def test_a_cuda_run_is_planned_in_the_gpus_hbm_not_as_a_cpu_run(monkeypatch):
    from dlrmctl.distributed.env import RunEnv
    from dlrmctl.train.plan import resolve_plan

    _fake_gpu(monkeypatch)
    seen = _spy_topology(monkeypatch)
    cfg = config_from_dict(CONFIG)
    assert cfg.sharding.device == "cpu"  # the default: nothing in the config says GPU
    env = RunEnv(0, 2, 2, torch.device("cuda", 0))  # a fake device: only its type and name are read
    resolve_plan(cfg, [], env, None)
    topo = seen[-1]
    assert topo.compute_device == "cuda" and topo.hbm_cap == 3 * 10**9  # the GPU's own memory
    assert topo.intra_host_bw > 100e9  # NVLink, not gloo loopback
    # an explicit sharding.hbm_gb still wins; a CPU run stays a CPU plan
    cfg.sharding.hbm_gb = 1.5
    resolve_plan(cfg, [], env, None)
    assert seen[-1].hbm_cap == int(1.5e9)
    resolve_plan(cfg, [], RunEnv(0, 2, 2, torch.device("cpu")), None)
    assert seen[-1].compute_device == "cpu" and seen[-1].hbm_cap == 0


def test_the_gpu_preset_follows_the_device_name(monkeypatch):
    from dlrmctl.distributed.env import device_planning_preset

    assert device_planning_preset(torch.device("cpu")) is None
    for name, preset in [("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-40GB", "a100"), ("Tesla T4", "h100")]:
        _fake_gpu(monkeypatch, name, 16 * 10**9)
        assert device_planning_preset(torch.device("cuda", 0)) == (preset, 16.0)


def _plan_fails_on_rank_0(env):
    from dlrmctl.distributed.env import RunEnv
    from dlrmctl.planner import planner
    from dlrmctl.planner.types import PlanError
    from dlrmctl.train.plan import resolve_plan

    def boom(*a, **kw):
        raise PlanError("table 't0' does not fit")

    planner.plan_for_config = boom
    try:
        resolve_plan(config_from_dict(CONFIG), [], RunEnv(env.rank, env.world_size, env.local_world_size,
                                                           env.device, env), None)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return None


@pytest.mark.multiprocess
def test_a_planner_error_on_rank_0_reaches_the_other_ranks_at_once():
    # before: rank 1 waited in broadcast_object for the collective timeout (1800 s); the job
    # timeout here is 60 s
    res = run_multiprocess(_plan_fails_on_rank_0, 2, timeout_s=60)
    assert res[0] == ("PlanError", "table 't0' does not fit")
    assert res[1][0] == "TrainError"
    assert "rank 1: the sharding planner failed on rank 0 (PlanError: table 't0' does not fit)" in res[1][1]


@pytest.fixture
def _matmul_state():
    """Restore the process-wide matmul / cuDNN precision flags the TF32 tests change."""
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(before[0])
    torch.backends.cudnn.allow_tf32 = before[1]


def test_train_tf32_sets_the_matmul_precision_for_a_cuda_device_only(_matmul_state):
    from dlrmctl.distributed.env import apply_matmul_precision, full_fp32_matmul

    cuda = torch.device("cuda", 0)  # a fake device: only its type is read
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    assert apply_matmul_precision(torch.device("cpu"), True) is None  # the CPU ignores the key
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == ("highest", False)
    assert apply_matmul_precision(cuda, True) == "high"
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == ("high", True)
    # evaluation during training: full fp32 inside, the training setting back after
    with full_fp32_matmul(cuda):
        assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == ("highest", False)
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == ("high", True)
    with full_fp32_matmul("cpu"):
        assert torch.get_float32_matmul_precision() == "high"  # cpu: untouched
    assert apply_matmul_precision(cuda, False) == "highest"
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == ("highest", False)


def test_the_trainer_applies_train_tf32_to_its_device(monkeypatch, _matmul_state):
    """The Trainer hands its device and ``train.tf32`` to ``apply_matmul_precision`` before any
    work (the data check that follows fails here: no data), default true."""
    from dlrmctl.distributed.env import RunEnv
    from dlrmctl.errors import UserError
    from dlrmctl.train import trainer as trainer_mod

    calls = []
    monkeypatch.setattr(trainer_mod, "apply_matmul_precision", lambda dev, tf32: calls.append((dev, tf32)))
    for overrides, want in (({}, True), ({"train": {"tf32": False}}, False)):
        cfg = config_from_dict({**CONFIG, **overrides})
        with pytest.raises(UserError):
            trainer_mod.Trainer(cfg, RunEnv(0, 1, 1, torch.device("cuda", 0)), "/nonexistent/run")
        assert calls[-1] == (torch.device("cuda", 0), want)
