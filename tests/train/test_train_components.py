"""The training package's components (issue 24): one optimizer container, decisions made at the
depth that owns them (the sharded collection's gradient densification and evaluation precision),
one column-wise moment key rule for save / load / reshard, and the package's shape."""

import ast
import os
import pathlib
import re

import pytest
import torch

from dlrmctl.config import config_from_dict
from dlrmctl.distributed.env import RunEnv

from tests.conftest import REPO, tiny_synthetic

TRAIN = REPO / "dlrmctl" / "train"
#: the modules issue 24 split dlrmctl/train/loop.py and train/checkpoint.py into
SPLIT = ("trainer.py", "optimizers.py", "amp.py", "evaluator.py", "train_log.py", "run_dir.py", "reload.py", "data.py",
         *(f"checkpoint/{m}.py" for m in ("__init__", "format", "rng", "codec", "store", "integrity", "storage",
                                          "save", "load", "reshard", "layout", "checkpointer")))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_synthetic(tmp_path_factory, "components")


def _sebc(weight_decay=0.0, opt="exact_rowwise_adagrad", comm_precision="fp32"):
    from dlrmctl.distributed.env import ShardingEnv
    from dlrmctl.distributed.model_parallel import plan_from_types
    from dlrmctl.distributed.sharded_ebc import ShardedEmbeddingBagCollection
    from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
    from dlrmctl.modules.embedding_modules import EmbeddingOptimizerSpec

    tables = [EmbeddingBagConfig(name="t", num_embeddings=16, embedding_dim=4, feature_names=["f"])]
    plan = plan_from_types(tables, "data_parallel", 1, 1, compute_kernel="dense")
    spec = EmbeddingOptimizerSpec(opt, 0.1, 1e-8, weight_decay)
    return ShardedEmbeddingBagCollection(tables, plan, ShardingEnv(1, 0, None), optimizer=spec, seed=0,
                                         comm_precision=comm_precision)


def test_the_sharded_collection_tracks_looked_up_rows_under_weight_decay_and_adam_by_itself():
    """A densified data_parallel gradient alone would let weight decay reach rows not looked up (and
    Adam skip a looked-up row whose gradient sums to zero): the collection decides from its own
    optimizer spec to carry a lookup count per row with it (issue 25: no sparse path, no host sync)."""
    from dlrmctl.distributed.comm import DENSE_GRAD_MAX_BYTES

    assert _sebc(weight_decay=0.0).dense_grad_max_bytes == DENSE_GRAD_MAX_BYTES
    assert not _sebc(weight_decay=0.0).track_touched_rows
    assert _sebc(weight_decay=0.01).track_touched_rows and _sebc(opt="adam").track_touched_rows
    assert _sebc(weight_decay=0.01).dense_grad_max_bytes == DENSE_GRAD_MAX_BYTES


def test_the_output_dist_is_full_precision_in_eval_mode():
    """``sharding.comm_precision`` applies in training only: the wire dtype follows ``module.training``
    (nothing flips ``comm_dtype`` around an evaluation any more)."""
    ebc = _sebc(comm_precision="bf16")
    assert ebc.output_dist_dtype == torch.bfloat16
    ebc.eval()
    assert ebc.output_dist_dtype is None and ebc.comm_dtype == torch.bfloat16
    ebc.train()
    assert ebc.output_dist_dtype == torch.bfloat16


def test_one_column_wise_moment_key_rule():
    from dlrmctl.train.checkpoint import row_moment_keys

    k = "emb/t/state0"
    assert row_moment_keys(k, 0, 8, 8) == ((k,), k)  # a whole-width shard: the table's key only
    assert row_moment_keys(k, 0, 4, 8).save == (k, f"{k}@cols0-4")  # column 0 also gives the table's moment
    assert row_moment_keys(k, 4, 4, 8).save == (f"{k}@cols4-8",)
    assert row_moment_keys(k, 4, 4, 8, saved={k}).load == k  # another column split: the row's moment
    assert row_moment_keys(k, 4, 4, 8, saved={k, f"{k}@cols4-8"}).load == f"{k}@cols4-8"  # same split: exact


def _trainer(tiny, tmp_path, resume=False, **opt):
    from dlrmctl.train.trainer import Trainer

    cfg = config_from_dict({
        "name": "comp", "data": {"path": tiny, "batch_size": 128, "eval_batch_size": 1024, "prefetch": 0},
        "model": {"embedding_dim": 8, "dense_arch_layer_sizes": [16, 8], "over_arch_layer_sizes": [16, 1],
                  "compute_kernel": "dense"},
        "optimizer": {"embedding": {"type": "exact_rowwise_adagrad", "lr": 0.05}, "dense": {"lr": 0.05},
                      "lr_schedule": {"warmup_steps": 4}, **opt},
        "train": {"max_steps": 2, "log_every": 0, "eval_every": 0, "run_dir": str(tmp_path), "progress": False},
    })
    run = os.path.join(str(tmp_path), cfg.name)
    os.makedirs(run, exist_ok=True)
    return Trainer(cfg, RunEnv(), run, resume=resume)


def test_one_optimizer_container_steps_sets_lr_and_hands_its_state_to_the_checkpoint_layout(tiny, tmp_path):
    from dlrmctl.train.checkpoint.layout import optimizer_entries

    t = _trainer(tiny, tmp_path)
    opts = t.optimizers
    assert opts.embedding_dense is not None  # dense-kernel tables: a torch optimizer over them
    assert opts.set_lr(0) == 0.25  # warmup: (0 + 1) / 4 on every member
    assert opts.fused.lr == pytest.approx(0.0125) and opts.dense.param_groups[0]["lr"] == pytest.approx(0.0125)
    assert opts.embedding_dense.param_groups[0]["lr"] == pytest.approx(0.0125)
    batch = next(iter(t.train_loader))
    t.train_step(batch)
    assert set(opts.state_dict(t.step)) == {"fused", "dense", "embedding_dense", "lr_schedule"}  # plain state
    keys = set(optimizer_entries(opts, t.step))  # its checkpoint keys are the layout's
    assert {"meta/fused_optimizer", "meta/dense_optimizer", "meta/embedding_dense_optimizer", "meta/lr_schedule"} <= keys
    assert all(k.startswith(("dense_opt/", "meta/")) for k in keys)  # the shards' moments travel with the tables
    # step(dense=False): the dense layers hold, the dense-kernel tables move (what an fp16 skip needs)
    dense0 = [p.detach().clone() for p in t.model.dense_parameters()]
    emb0 = [p.detach().clone() for p in t.model.embedding_dense_parameters()]
    t.logits(batch.to(t.device)).sum().backward()
    opts.step(dense=False)
    assert all(torch.equal(a, p) for a, p in zip(dense0, t.model.dense_parameters()))
    assert any(not torch.equal(a, p) for a, p in zip(emb0, t.model.embedding_dense_parameters()))
    opts.zero_grad()
    assert all(p.grad is None for p in t.model.dense_parameters())


def _function_lines(path: pathlib.Path, cls: str, name: str) -> int:
    tree = ast.parse(path.read_text())
    c = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    f = next(n for n in c.body if isinstance(n, ast.FunctionDef) and n.name == name)
    return f.end_lineno - f.lineno + 1


def test_the_train_package_is_split_by_concern():
    assert not (TRAIN / "loop.py").exists()
    assert not (TRAIN / "checkpoint.py").exists() and not (TRAIN / "checkpoint_state.py").exists()
    assert all((TRAIN / name).is_file() for name in SPLIT)  # (their 500-line rule: tests/test_package_shape.py)
    assert _function_lines(TRAIN / "trainer.py", "Trainer", "train") <= 40
    assert _function_lines(TRAIN / "trainer.py", "Trainer", "train_step") <= 20
    assert _function_lines(TRAIN / "trainer.py", "Trainer", "run_step") <= 20


def test_private_state_is_read_only_where_it_is_owned():
    owners = {"_tbes": {"dlrmctl/modules/lookup.py"}, "_per_optimizer_states": {"dlrmctl/train/amp.py"}}
    unwraps = []
    for p in sorted((REPO / "dlrmctl").rglob("*.py")) + sorted((REPO / "tests").rglob("*.py")):
        rel = p.relative_to(REPO).as_posix()
        src = p.read_text()
        if rel == "tests/train/test_train_components.py":
            continue
        for attr, where in owners.items():
            assert rel in where or not re.search(rf"\.{attr}\b", src), f"{rel} reads .{attr}"
        if rel.startswith("dlrmctl/"):
            unwraps += [rel] * src.count('getattr(model, "module"')
    assert len(unwraps) <= 1, unwraps


def test_no_test_imports_a_private_name_of_the_train_package():
    for p in sorted((REPO / "tests").rglob("*.py")):  # every subfolder; multi-line imports too
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[:2] == ["dlrmctl", "train"]:
                names = [a.name for a in node.names]
                assert not [n for n in names if n.startswith("_")], f"{p.relative_to(REPO)}:{node.lineno}: {names}"


def test_a_resume_reads_latest_once(tiny, tmp_path, monkeypatch):
    """Issue 25: the checkpoint a resume restores is resolved once (LATEST was read at Trainer.__init__
    and twice more while restoring: a run publishing meanwhile could split those answers)."""
    from dlrmctl.train import checkpoint as ckpt
    from dlrmctl.train.checkpoint import store

    t = _trainer(tiny, tmp_path)
    t.train_step(next(iter(t.train_loader)))
    path = t.save()
    reads = []
    real = store.marked

    def counting(run_dir, marker):
        reads.append(marker)
        return real(run_dir, marker)

    monkeypatch.setattr(store, "marked", counting)
    r = _trainer(tiny, tmp_path, resume=True)
    assert reads.count(ckpt.LATEST) == 1, reads
    assert r.step == 1 and r.checkpointer.saved_path == path  # resumed from it, known as the newest
