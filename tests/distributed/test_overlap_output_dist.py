"""``sharding.overlap_output_dist`` (issue 17): the pooled embeddings' all-to-all is launched
asynchronously and waited on after the dense arch (TorchRec's ``LazyAwaitable`` output dist).
It must change only *when* things run, never what is computed: training on 2 gloo ranks with the
overlap on and off gives bit-identical losses and parameters (table_wise / row_wise all-to-all,
fp32 and bf16 qcomm, bf16 autocast), the reduce-scatter path is unchanged, and the dense arch
really runs between the launch and the wait, forward and backward."""

from __future__ import annotations

import os

import pytest
import torch

from dlrmctl.config import config_from_dict
from dlrmctl.distributed.env import RunEnv
from dlrmctl.train.trainer import Trainer
from dlrmctl.train.run_dir import prepare_run_dir

from tests.conftest import tiny_synthetic


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_synthetic(tmp_path_factory, "tiny_overlap", rows=3000, seed=3)


def _raw(data, run_root, name, overlap, comm, precision):
    return {
        "name": name,
        "data": {"path": data, "batch_size": 256, "eval_batch_size": 8192},
        "model": {"embedding_dim": 8, "dense_arch_layer_sizes": [32, 8], "over_arch_layer_sizes": [32, 1]},
        "optimizer": {"embedding": {"lr": 0.05}, "dense": {"lr": 0.05}},
        "train": {"epochs": 1, "max_steps": 5, "checkpoint_every": 1000, "log_every": 1000, "run_dir": run_root,
                  "progress": False, "keep_best": "none", "precision": precision, "pipeline": "sparse_dist"},
        "sharding": {"overlap_output_dist": overlap, "comm_precision": comm, "tables": {
            **{f"t_C{i}": {"sharding_type": "table_wise"} for i in range(1, 14)},
            **{f"t_C{i}": {"sharding_type": "row_wise"} for i in range(14, 24)},
            **{f"t_C{i}": {"sharding_type": "data_parallel", "compute_kernel": "dense"}
                for i in range(24, 27)}}},
    }


def _train_worker(env, data, run_root, comm, precision):
    """Per overlap setting: every step's loss and the final parameters of this rank."""
    out = {}
    for overlap in (False, True):
        name = f"ov_{overlap}_{comm}_{precision}"
        cfg = config_from_dict(_raw(data, run_root, name, overlap, comm, precision))
        renv = RunEnv(env.rank, env.world_size, env.local_world_size, env.device, env)
        run = prepare_run_dir(cfg, resume=False, overwrite=False) if env.rank == 0 else os.path.join(run_root, name)
        torch.distributed.barrier()
        t = Trainer(cfg, renv, run)
        assert t.model.overlap_output_dist is overlap
        losses = []
        for step, batch in enumerate(t.train_loader):
            if step == 5:
                break
            losses.append(t.train_step(batch).clone())
        params = {k: v.detach().clone() for k, v in t.model.state_dict().items() if torch.is_tensor(v)}
        out[overlap] = (torch.stack(losses), params)
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("comm,precision", [("fp32", "fp32"), ("bf16", "bf16")])
def test_overlap_is_bit_identical_to_waiting_at_once(tiny, tmp_path, comm, precision):
    from tests.dist_utils import run_multiprocess

    for res in run_multiprocess(_train_worker, 2, tiny, str(tmp_path), comm, precision, timeout_s=300):
        (l0, p0), (l1, p1) = res[False], res[True]
        assert torch.isfinite(l0).all() and l0.numel() == 5
        assert torch.equal(l0, l1), (l0, l1)
        assert p0.keys() == p1.keys()
        diff = [k for k in p0 if not torch.equal(p0[k], p1[k])]
        assert diff == [], f"parameters differ with overlap_output_dist: {diff}"
        # the steps did train (the comparison above could fail)
        assert not torch.equal(l0[0], l0[-1])


def _order_worker(env, reduce_scatter):
    """Events of one DMP forward + backward, with the overlap off and on; the sharded EBC's
    output, gradient and updated weights must match bit for bit (with ``reduce_scatter`` the
    row-wise group uses the reduce-scatter collective, done before the awaitable is returned)."""
    from dlrmctl.distributed import comm
    from dlrmctl.distributed.model_parallel import DistributedModelParallel, plan_from_types
    from dlrmctl.modules.dlrm import DLRM
    from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
    from dlrmctl.modules.embedding_modules import EmbeddingBagCollection, EmbeddingOptimizerSpec
    from dlrmctl.sparse import KeyedJaggedTensor, KeyedTensor

    events: list[str] = []
    a2a = comm.all_to_all
    start_bwd, wait_fwd, wait_bwd = (a2a._PooledAllToAllStart.backward, a2a._PooledAllToAllWait.forward,
                                     a2a._PooledAllToAllWait.backward)

    def rec(name, fn):
        def wrapped(*a):
            events.append(name)
            return fn(*a)
        return staticmethod(wrapped)

    comm.all_to_all._PooledAllToAllStart.backward = rec("start_bwd", start_bwd)
    comm.all_to_all._PooledAllToAllWait.forward = rec("wait_fwd", wait_fwd)
    comm.all_to_all._PooledAllToAllWait.backward = rec("wait_bwd", wait_bwd)
    tables = [EmbeddingBagConfig(num_embeddings=40, embedding_dim=8, name=f"t{i}", feature_names=[f"f{i}"])
              for i in range(3)]
    plan = plan_from_types(tables, {"t0": "table_wise", "t1": "table_wise", "t2": "row_wise"}, env.world_size)
    g = torch.Generator().manual_seed(5 + env.rank)
    B = 6 if reduce_scatter else 6 + env.rank  # the reduce_scatter collective needs equal local batches
    lengths = torch.randint(1, 4, (3 * B,), generator=g)
    kjt = KeyedJaggedTensor(["f0", "f1", "f2"], torch.randint(0, 40, (int(lengths.sum()),), generator=g),
                            lengths=lengths)
    dense = torch.randn(B, 5, generator=g)
    res = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        model = DLRM(EmbeddingBagCollection(tables), 5, [16, 8], [16, 1], 3, 8)
        dmp = DistributedModelParallel(model, env, plan, EmbeddingOptimizerSpec(), seed=1, check_ids=False,
                                       overlap_output_dist=overlap)
        if reduce_scatter:
            ebc = dmp.sparse_arch
            for grp in ebc.groups:
                if grp.row_wise:
                    grp.use_reduce_scatter = True
            ebc._a2a_out = [i for i in ebc._comm if not getattr(ebc.groups[i], "use_reduce_scatter", False)]
        lin = next(m for m in dmp.module.dense_arch.modules() if isinstance(m, torch.nn.Linear))
        h1 = dmp.module.dense_arch.register_forward_hook(lambda *a: events.append("dense_fwd"))
        h2 = lin.weight.register_hook(lambda grad: events.append("dense_bwd"))
        events.clear()
        emb = dmp.compute_and_output_dist(dmp.sparse_input_dist(kjt).wait())
        assert isinstance(emb, KeyedTensor) is not overlap
        kept = {}
        if overlap:
            inner = emb

            class _Keep:
                def wait(self):
                    kept["kt"] = inner.wait()
                    kept["kt"].values().retain_grad()
                    return kept["kt"]
            emb = _Keep()
        else:
            kept["kt"] = emb
            emb.values().retain_grad()
        logits = dmp.dense_forward(dense, emb)
        (logits.square().sum() / 7).backward()
        h1.remove()
        h2.remove()
        w = dmp.sparse_arch.gather_full_weights()
        res[overlap] = (list(events), logits.detach(), kept["kt"].values().detach(), kept["kt"].values().grad,
                        {k: v.clone() for k, v in w.items()},
                        {n: p.grad.clone() for n, p in dmp.module.named_parameters() if p.grad is not None})
    return res


@pytest.mark.multiprocess
@pytest.mark.parametrize("reduce_scatter", [False, True])
def test_dense_arch_runs_between_launch_and_wait(reduce_scatter):
    from tests.dist_utils import run_multiprocess

    for res in run_multiprocess(_order_worker, 2, reduce_scatter, timeout_s=180):
        off, on = res[False], res[True]
        assert off[0] == ["wait_fwd", "dense_fwd", "dense_bwd", "wait_bwd", "start_bwd"], off[0]
        # forward: the dense arch runs while the embeddings travel; backward: the gradient
        # all-to-all is launched before the dense arch's backward and waited on after it
        assert on[0] == ["dense_fwd", "wait_fwd", "wait_bwd", "dense_bwd", "start_bwd"], on[0]
        for a, b in zip(off[1:4], on[1:4]):
            assert torch.equal(a, b)
        for a, b in zip(off[4:], on[4:]):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert off[5], "no dense gradients (the comparison above could not fail)"


def test_overlap_key_defaults_on_and_is_validated():
    from dlrmctl.config import ConfigError

    base = {"model": {"embedding_dim": 16}}
    assert config_from_dict(base).sharding.overlap_output_dist is True
    assert config_from_dict(base, ["sharding.overlap_output_dist=false"]).sharding.overlap_output_dist is False
    with pytest.raises(ConfigError, match="sharding.overlap_output_dist: expected bool"):
        config_from_dict({**base, "sharding": {"overlap_output_dist": "maybe"}})
