"""Sharded checkpoints (torch.distributed.checkpoint): resume parity on 1 and 2 ranks, loading a
2-rank checkpoint (table-wise + row-wise + data-parallel + column-wise tables) into 3 ranks with a
row-wise / column-wise plan and into 1 process (directly and through ``dlrmctl checkpoint
reshard``) with every weight and optimizer moment exact, SIGKILL during saves, damaged files and
mismatched models refused with a message naming the file / table.

The 2-rank / reshard tests run for row-wise Adagrad (one ``[rows]`` moment), Adam (two
``[rows, dim]`` moments) and partial row-wise Adam (``[rows, dim]`` + ``[rows]``); with the Adam
family the bias-correction step is restored with the rows.  Each (optimizer, world size) is
spawned once: one 2-rank job (straight run, interrupted run, resumed run) and one 3-rank job
(direct load + load of the offline-resharded copy)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from tests import conftest

try:
    from tests.dist_utils import run_multiprocess
except ImportError:  # pragma: no cover - tests run as a plain directory
    from dist_utils import run_multiprocess
from dlrmctl import HAS_FBGEMM
from dlrmctl.cli import app
from dlrmctl.train import checkpoint as ckpt

pytestmark = pytest.mark.skipif(not HAS_FBGEMM, reason="fbgemm_gpu is not installed")

REPO = str(conftest.REPO)
runner = CliRunner()
STRAIGHT, INTERRUPTED_AT, RESUMED_TO = 14, 4, 14  # 10 steps after the resume


def invoke(*args):
    r = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.output


def _cfg(data, runs, name, max_steps, *extra):
    from dlrmctl.config import load_config

    return load_config(os.path.join(REPO, "configs/demo.yaml"), [
        f"data.path={data}", f"train.run_dir={runs}", f"name={name}", "train.progress=false",
        "data.batch_size=256", "data.eval_batch_size=4096", "train.log_every=1", "train.checkpoint_every=3",
        f"train.max_steps={max_steps}", "train.keep_last_checkpoints=2", "train.epochs=3", *extra])


def _snapshot(trainer):
    """This rank's shards (weight + moments), dense state, dense-optimizer state and the embedding
    optimizer's step (the Adam family's bias-correction step) as numpy."""
    from dlrmctl.train.checkpoint import dense_state_dict, local_embedding_shards

    shards = [(n, tuple(o), tuple(s), w.detach().cpu().numpy().copy(), [m.detach().cpu().numpy().copy() for m in st])
              for n, o, s, w, st in local_embedding_shards(trainer.model, trainer.optimizers.embedding_dense)]
    dense = {k: v.cpu().numpy().copy() for k, v in dense_state_dict(trainer.model).items()}
    opt = {i: {k: (v.cpu().numpy().copy() if torch.is_tensor(v) else v) for k, v in st.items()}
           for i, st in trainer.optimizers.dense.state_dict()["state"].items()}
    emb_step = None if trainer.optimizers.embedding_dense is None else trainer.optimizers.embedding_dense.param_groups[0].get("step")
    return {"shards": shards, "dense": dense, "dense_opt": opt, "step": trainer.step, "emb_step": emb_step}


def _train(env, cfg, run_dir, resume, plan):
    from dlrmctl.distributed.env import RunEnv
    from dlrmctl.train.trainer import Trainer
    from dlrmctl.train.run_dir import prepare_run_dir

    renv = RunEnv() if env is None else RunEnv(env.rank, env.world_size, env.local_world_size, env.device, env)
    if renv.is_main:
        prepare_run_dir(cfg, resume=resume, overwrite=False)
    renv.barrier()
    torch.manual_seed(cfg.train.seed)
    t = Trainer(cfg, renv, run_dir, resume=resume, plan=plan)
    return t


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"))) if r["kind"] == "train"}


# ---------------------------------------------------------------- jobs
def _opt(optimizer):
    return [f"optimizer.embedding.type={optimizer}"] + (["optimizer.embedding.lr=0.01"] if "adam" in optimizer else [])


def _two_rank_job(env, data, runs, plan_dict, optimizer):
    from dlrmctl.distributed.types import ShardingPlan

    plan = ShardingPlan.from_dict(plan_dict)
    o = _opt(optimizer)
    _train(env, _cfg(data, runs, "straight", STRAIGHT, *o), os.path.join(runs, "straight"), False, plan).train()
    _train(env, _cfg(data, runs, "resumed", INTERRUPTED_AT, *o), os.path.join(runs, "resumed"), False, plan).train()
    t = _train(env, _cfg(data, runs, "resumed", RESUMED_TO, *o), os.path.join(runs, "resumed"), True, plan)
    assert t.step == INTERRUPTED_AT
    if t.optimizers.embedding_dense is not None and "adam" in optimizer:
        assert t.optimizers.embedding_dense.param_groups[0]["step"] == INTERRUPTED_AT  # bias correction continues
    t.train()
    return _snapshot(t)


def _three_rank_job(env, data, runs, plan_dict, resharded_runs, optimizer):
    from dlrmctl.distributed.types import ShardingPlan

    plan = ShardingPlan.from_dict(plan_dict)
    o = _opt(optimizer)
    direct = _train(env, _cfg(data, runs, "resumed", RESUMED_TO, *o), os.path.join(runs, "resumed"), True, plan)
    offline = _train(env, _cfg(data, resharded_runs, "r3", RESUMED_TO, *o), os.path.join(resharded_runs, "r3"), True, plan)
    return _snapshot(direct), _snapshot(offline)


# ------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt_data")
    invoke("preprocess", "synthetic", "--out", d, "--rows", 3000, "--seed", 3, "--num-embeddings", 40)
    return str(d)


def _tables(data):
    from dlrmctl.config import read_data_meta, resolve_tables

    cfg = _cfg(data, "/nonexistent", "x", 1)
    return resolve_tables(cfg, read_data_meta(cfg))


SOURCE_TYPES = ["table_wise", "row_wise", "data_parallel", "column_wise"]  # by table index mod 4
TARGET_TYPES = ["row_wise", "column_wise"]


#: row-wise Adagrad (one [rows] moment), Adam (two [rows, dim]), partial row-wise Adam ([rows, dim] + [rows])
OPTIMIZERS = ["exact_rowwise_adagrad", "adam", "partial_rowwise_adam"]
N_STATES = {"exact_rowwise_adagrad": 1, "adam": 2, "partial_rowwise_adam": 2}


#: the default run keeps the default optimizer's multi-rank jobs; the other two are marked slow
OPTIMIZER_PARAMS = [o if o == "exact_rowwise_adagrad" else pytest.param(o, marks=pytest.mark.slow) for o in OPTIMIZERS]


@pytest.fixture(scope="module", params=OPTIMIZER_PARAMS)
def two_rank(request, data, tmp_path_factory):
    from dlrmctl.distributed.model_parallel import plan_from_types

    optimizer = request.param
    tables = _tables(data)
    plan = plan_from_types(tables, {t.name: SOURCE_TYPES[i % 4] for i, t in enumerate(tables)}, 2)
    runs = str(tmp_path_factory.mktemp("runs2"))
    t0 = time.perf_counter()
    snaps = run_multiprocess(_two_rank_job, 2, data, runs, plan.to_dict(), optimizer, timeout_s=300)
    print(f"2-rank job ({optimizer}): {time.perf_counter() - t0:.1f}s")
    return {"runs": runs, "snaps": snaps, "plan": plan, "tables": tables, "optimizer": optimizer}


def _reference(snaps, tables, plan, n_states):
    """Full weights and, per state index, full per-element moments ``[rows, dim]`` / per-row
    moments ``[rows]`` (column-wise tables: the column-0 shard's, the loading rule) of the 2-rank run."""
    full = {t.name: np.full((t.num_embeddings, t.embedding_dim), np.nan, dtype=np.float32) for t in tables}
    states: dict[tuple[str, int], np.ndarray] = {}
    colm: dict[tuple[str, int], dict[int, np.ndarray]] = {}
    for s in snaps:
        for name, (r0, c0), (nr, nc), w, st in s["shards"]:
            R, D = full[name].shape
            full[name][r0:r0 + nr, c0:c0 + nc] = w
            assert len(st) == n_states, (name, len(st))
            for i, m in enumerate(st):
                if m.ndim == 2:
                    states.setdefault((name, i), np.full((R, D), np.nan, dtype=np.float32))[r0:r0 + nr, c0:c0 + nc] = m
                elif plan.plan[name].sharding_type.value == "column_wise":
                    colm.setdefault((name, i), {})[c0] = m
                else:
                    states.setdefault((name, i), np.full(R, np.nan, dtype=np.float32))[r0:r0 + nr] = m
    for key, cm in colm.items():
        states[key] = cm[0]  # the rule: column-wise sources give the column-0 shard's per-row moment
    for name in full:
        assert not np.isnan(full[name]).any(), name
        for i in range(n_states):
            assert not np.isnan(states[(name, i)]).any(), (name, i)
    return full, states


def _assert_exact(snap, full, states, where, n_states):
    n = 0
    for name, (r0, c0), (nr, nc), w, st in snap["shards"]:
        np.testing.assert_array_equal(w, full[name][r0:r0 + nr, c0:c0 + nc], err_msg=f"{where}: {name} weight")
        assert len(st) == n_states, (where, name)
        for i, m in enumerate(st):
            ref = states[(name, i)]
            want = ref[r0:r0 + nr, c0:c0 + nc] if ref.ndim == 2 else ref[r0:r0 + nr]
            np.testing.assert_array_equal(m, want, err_msg=f"{where}: {name} moment {i}")
        n += 1
    assert n > 0


# ---------------------------------------------------------------- tests
def test_resume_gives_the_same_per_step_losses_on_2_ranks_with_tw_rw_dp_cw_tables(two_rank):
    runs = two_rank["runs"]
    straight, resumed = _losses(os.path.join(runs, "straight")), _losses(os.path.join(runs, "resumed"))
    assert sorted(straight) == list(range(1, STRAIGHT + 1))
    after = list(range(INTERRUPTED_AT + 1, RESUMED_TO + 1))
    assert len(after) == 10
    for step in after:
        assert resumed[step] == straight[step], step
    # keep_last_checkpoints: 2 (saves at 3, 6, 9, 12 and the final 14)
    names = sorted(d for d in os.listdir(os.path.join(runs, "straight", "checkpoints")) if d.startswith("step_"))
    # ... plus the best evaluation's checkpoint (train.keep_best: auc), which pruning never removes
    best = os.path.basename(ckpt.best_checkpoint(os.path.join(runs, "straight")) or "step_00000014")
    assert names == sorted({"step_00000012", "step_00000014", best})
    meta = ckpt.load_checkpoint_meta(ckpt.latest_checkpoint(os.path.join(runs, "straight")))
    assert meta["world_size"] == 2 and set(meta["files"]) >= {".metadata", "__0_0.distcp", "__1_0.distcp"}


@pytest.mark.parametrize("optimizer", ["exact_rowwise_adagrad", pytest.param("adam", marks=pytest.mark.slow)])
def test_resume_gives_the_same_per_step_losses_on_1_process(data, tmp_path, optimizer):
    runs, o = str(tmp_path), _opt(optimizer)
    _train(None, _cfg(data, runs, "s", STRAIGHT, *o), os.path.join(runs, "s"), False, None).train()
    _train(None, _cfg(data, runs, "r", INTERRUPTED_AT, *o), os.path.join(runs, "r"), False, None).train()
    t = _train(None, _cfg(data, runs, "r", RESUMED_TO, *o), os.path.join(runs, "r"), True, None)
    assert t.step == INTERRUPTED_AT
    t.train()
    straight, resumed = _losses(os.path.join(runs, "s")), _losses(os.path.join(runs, "r"))
    for step in range(INTERRUPTED_AT + 1, RESUMED_TO + 1):
        assert resumed[step] == straight[step], step


@pytest.mark.slow  # three short trainings
def test_loader_worker_processes_train_and_resume_with_the_thread_loaders_losses(data, tmp_path):
    runs = str(tmp_path)  # straight: the loader's thread; interrupted with 2 workers, resumed with 3
    _train(None, _cfg(data, runs, "s", STRAIGHT, "data.workers=0"), os.path.join(runs, "s"), False, None).train()
    _train(None, _cfg(data, runs, "r", INTERRUPTED_AT, "data.workers=2"), os.path.join(runs, "r"), False, None).train()
    t = _train(None, _cfg(data, runs, "r", RESUMED_TO, "data.workers=3"), os.path.join(runs, "r"), True, None)
    assert t.step == INTERRUPTED_AT and t.cfg.data.workers == 3
    t.train()
    straight, resumed = _losses(os.path.join(runs, "s")), _losses(os.path.join(runs, "r"))
    assert sorted(resumed) == sorted(straight)[:RESUMED_TO]
    for step in range(1, RESUMED_TO + 1):
        assert resumed[step] == straight[step], step


def test_2_rank_checkpoint_loads_exactly_into_3_ranks_rw_cw_directly_and_after_offline_reshard(data, two_rank, tmp_path):
    from dlrmctl.distributed.model_parallel import plan_from_types

    tables, runs, opt = two_rank["tables"], two_rank["runs"], two_rank["optimizer"]
    ns = N_STATES[opt]
    full, states = _reference(two_rank["snaps"], tables, two_rank["plan"], ns)
    plan3 = plan_from_types(tables, {t.name: TARGET_TYPES[i % 2] for i, t in enumerate(tables)}, 3)
    plan3.save(tmp_path / "plan3.yaml")
    out = invoke("checkpoint", "reshard", os.path.join(runs, "resumed"), "--nproc", 3, "--plan", tmp_path / "plan3.yaml",
                 "--out", tmp_path / "r3")
    assert "from 2 to 3 rank(s)" in out
    meta = ckpt.load_checkpoint_meta(ckpt.latest_checkpoint(str(tmp_path / "r3")))
    assert meta["world_size"] == 3 and {f"__{r}_0.distcp" for r in range(3)} <= set(meta["files"])
    snaps = run_multiprocess(_three_rank_job, 3, data, runs, plan3.to_dict(),
                             str(tmp_path), opt, timeout_s=300)
    for r, (direct, offline) in enumerate(snaps):
        _assert_exact(direct, full, states, f"3 ranks (direct), rank {r}", ns)
        _assert_exact(offline, full, states, f"3 ranks (resharded), rank {r}", ns)
        assert direct["step"] == offline["step"] == RESUMED_TO
        if "adam" in opt:
            assert direct["emb_step"] == offline["emb_step"] == RESUMED_TO
    ref = two_rank["snaps"][0]
    for k, v in snaps[0][0]["dense"].items():
        np.testing.assert_array_equal(v, ref["dense"][k], err_msg=k)
    for i, st in ref["dense_opt"].items():
        for k, v in st.items():
            np.testing.assert_array_equal(snaps[0][0]["dense_opt"][i][k], v, err_msg=f"dense optimizer {i}.{k}")


def test_2_rank_checkpoint_loads_exactly_into_1_process_directly_offline_and_for_export(data, two_rank, tmp_path):
    from dlrmctl.train.reload import load_trained_model

    tables, runs, opt = two_rank["tables"], two_rank["runs"], two_rank["optimizer"]
    ns = N_STATES[opt]
    full, states = _reference(two_rank["snaps"], tables, two_rank["plan"], ns)
    t = _train(None, _cfg(data, runs, "resumed", RESUMED_TO, *_opt(opt)), os.path.join(runs, "resumed"), True, None)
    snap = _snapshot(t)
    _assert_exact(snap, full, states, "1 process (direct)", ns)
    assert len(snap["shards"]) == len(tables)
    invoke("checkpoint", "reshard", os.path.join(runs, "resumed"), "--nproc", 1, "--out", tmp_path / "r1")
    _, model, _ = load_trained_model(str(tmp_path / "r1"), compute_kernel="fused")
    w = model.sparse_arch.embedding_weights()
    for tb in tables:
        np.testing.assert_array_equal(w[tb.name].detach().numpy(), full[tb.name], err_msg=tb.name)
    if opt == "exact_rowwise_adagrad":  # fused on CPU: the TBE holds the moment
        mom = model.sparse_arch.fused_optimizer().momentum()
        for tb in tables:
            np.testing.assert_array_equal(mom[tb.name][0].numpy(), states[(tb.name, 0)], err_msg=tb.name)
    # the offline-resharded copy resumes in one process with every moment and the step
    r1 = _train(None, _cfg(data, str(tmp_path), "r1", RESUMED_TO, *_opt(opt)), str(tmp_path / "r1"), True, None)
    snap1 = _snapshot(r1)
    _assert_exact(snap1, full, states, "1 process (resharded)", ns)
    assert snap1["step"] == RESUMED_TO and (snap1["emb_step"] == RESUMED_TO or "adam" not in opt)
    # evaluate / export path: full tables assembled from the 2-rank checkpoint in one process
    _, model, _ = load_trained_model(os.path.join(runs, "resumed"))
    for tb in tables:
        np.testing.assert_array_equal(model.sparse_arch.embedding_weights()[tb.name].detach().numpy(), full[tb.name])


# ------------------------------------------------------------- safety
SAVER = r"""
import sys, torch
from dlrmctl.train import checkpoint as ckpt
run = sys.argv[1]
p = ckpt.latest_checkpoint(run)
i = 0 if p is None else ckpt.load_checkpoint_meta(p)["step"]
while True:
    i += 1
    st = {"emb/t/weight": torch.full((512, 1024), float(i)), "dense/x": torch.full((64,), float(i)),
          "meta/trainer": ckpt.pack({"step": i})}
    ckpt.save_checkpoint(run, i, st, keep_last=2)
    if i == 1 or p is not None:
        print("saved", i, flush=True)
        p = None
"""


@pytest.mark.slow  # three saver processes, each importing torch, SIGKILLed
def test_sigkill_during_saves_leaves_the_latest_checkpoint_loadable(tmp_path):
    run = str(tmp_path / "run")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    rng = random.Random(0)
    last = 0
    for _ in range(3):
        p = subprocess.Popen([sys.executable, "-c", SAVER, run], stdout=subprocess.PIPE, text=True, env=env)
        assert p.stdout.readline().startswith("saved")  # at least one new save completed
        time.sleep(rng.uniform(0.05, 0.6))
        p.send_signal(signal.SIGKILL)
        p.wait()
        path = ckpt.latest_checkpoint(run)
        st = {"emb/t/weight": torch.zeros(512, 1024), "dense/x": torch.zeros(64), "meta/trainer": None}
        ckpt.load_checkpoint(path, st)
        step = ckpt.unpack(st["meta/trainer"])["step"]
        assert step > last and ckpt.load_checkpoint_meta(path)["step"] == step
        assert torch.all(st["emb/t/weight"] == step) and torch.all(st["dense/x"] == step)
        last = step
    complete = [d for d in os.listdir(os.path.join(run, "checkpoints")) if d.startswith("step_")]
    assert 1 <= len(complete) <= 3


@pytest.fixture(scope="module")
def small_run(data, tmp_path_factory):
    runs = str(tmp_path_factory.mktemp("small"))
    _train(None, _cfg(data, runs, "s", 2), os.path.join(runs, "s"), False, None).train()
    return runs


def _resume_error(data, runs, *extra):
    with pytest.raises(ckpt.CheckpointError) as e:
        _train(None, _cfg(data, runs, "s", 4, *extra), os.path.join(runs, "s"), True, None)
    return str(e.value)


def test_truncated_or_corrupted_files_are_refused_naming_the_file(data, small_run):
    path = ckpt.latest_checkpoint(os.path.join(small_run, "s"))
    f = os.path.join(path, "__0_0.distcp")
    orig = open(f, "rb").read()
    try:
        with open(f, "wb") as h:
            h.write(orig[: len(orig) // 2])
        msg = _resume_error(data, small_run)
        assert f in msg and f"{len(orig) // 2} bytes, expected {len(orig)}" in msg and "truncated" in msg
        bad = bytearray(orig)
        bad[len(bad) // 2] ^= 0xFF
        with open(f, "wb") as h:
            h.write(bytes(bad))
        msg = _resume_error(data, small_run)
        assert f in msg and "CRC-32" in msg and "corrupted" in msg
        r = runner.invoke(app, ["evaluate", os.path.join(small_run, "s")])
        assert r.exit_code == 2 and "corrupted" in r.output
    finally:
        with open(f, "wb") as h:
            h.write(orig)
    m = os.path.join(path, ".metadata")
    orig_m = open(m, "rb").read()
    try:
        with open(m, "wb") as h:
            h.write(orig_m[:10])
        msg = _resume_error(data, small_run)
        assert m in msg and "truncated" in msg
    finally:
        with open(m, "wb") as h:
            h.write(orig_m)


def test_checkpoint_of_a_different_model_is_refused_naming_the_table_and_shapes(data, small_run):
    msg = _resume_error(data, small_run, "model.embedding_dim=8", "model.dense_arch_layer_sizes=[64,32,8]")
    assert "meta.json" in msg and "x 16 (rows x dim), the model's is" in msg and "x 8" in msg
    msg = _resume_error(data, small_run, "optimizer.embedding.type=exact_adagrad")
    assert "exact_rowwise_adagrad" in msg and "exact_adagrad" in msg


def test_saving_a_step_twice_publishes_a_new_directory_and_prunes_to_keep_last(tmp_path):
    run = str(tmp_path)
    for i, step in enumerate([1, 2, 2, 3]):
        ckpt.save_checkpoint(run, step, {"w": torch.full((4,), float(i))}, keep_last=2)
    names = sorted(d for d in os.listdir(os.path.join(run, "checkpoints")) if d.startswith("step_"))
    assert names == ["step_00000002.1", "step_00000003"]
    st = {"w": torch.zeros(4)}
    ckpt.load_checkpoint(os.path.join(run, "checkpoints", "step_00000002.1"), st)
    assert torch.all(st["w"] == 2)
    assert ckpt.latest_checkpoint(run).endswith("step_00000003")


def test_resuming_mid_epoch_with_another_batch_order_is_refused_naming_the_setting(data, small_run, tmp_path):
    # the data position is a count of global batches (step 2 of a 10-batch epoch): under another
    # data.batch_size or shuffle setting those are other rows (repeated or skipped ones), silently
    import shutil

    from dlrmctl.train.run_dir import TrainError

    runs = str(tmp_path)
    shutil.copytree(os.path.join(small_run, "s"), os.path.join(runs, "s"))
    for extra, what in ((["data.batch_size=128"], "batch_size: 128 now, 256 when saved"),
                        (["data.shuffle_window_rows=1000"], "shuffle_window_rows: 1000 now, 262144 when saved")):
        with pytest.raises(TrainError, match=r"step_00000002: train split: cannot resume inside epoch 1 \(after 2 "
                                             rf"batches\) with another batch order \({what}\)"):
            _train(None, _cfg(data, runs, "s", 4, *extra), os.path.join(runs, "s"), True, None)
    t = _train(None, _cfg(data, runs, "s", 4), os.path.join(runs, "s"), True, None)  # the saved settings resume
    assert t.step == 2 and t.train_loader.state_dict() == {"epoch": 0, "batches_yielded": 2}


def test_resume_of_a_checkpoint_written_by_the_per_parameter_loop_runs_foreach(data, tmp_path, monkeypatch):
    """A checkpoint written when the dense optimizer ran torch's per-parameter loop (param_groups
    with ``foreach: None``/``False``, as before dlrmctl chose ``foreach`` on the CPU) resumes on
    the multi-tensor form (the implementation is not state), with the same losses as a straight run."""
    from dlrmctl.optim import dense as optim
    from dlrmctl.train import optimizers

    runs = str(tmp_path)
    _train(None, _cfg(data, runs, "s", STRAIGHT), os.path.join(runs, "s"), False, None).train()
    real = optim.dense_optimizer

    def loop_optimizer(params, cfg):
        opt = real(params, cfg)
        for g in opt.param_groups:
            g["foreach"] = None  # what a checkpoint of the old code recorded
        return opt

    monkeypatch.setattr(optimizers, "dense_optimizer", loop_optimizer)
    _train(None, _cfg(data, runs, "r", INTERRUPTED_AT), os.path.join(runs, "r"), False, None).train()
    monkeypatch.setattr(optimizers, "dense_optimizer", real)
    t = _train(None, _cfg(data, runs, "r", RESUMED_TO), os.path.join(runs, "r"), True, None)
    assert all(g["foreach"] is True for g in t.optimizers.dense.param_groups)
    t.train()
    straight, resumed = _losses(os.path.join(runs, "s")), _losses(os.path.join(runs, "r"))
    for step in range(INTERRUPTED_AT + 1, RESUMED_TO + 1):
        assert resumed[step] == straight[step], step


def test_checkpoint_inspect_lists_steps_markers_metrics_and_integrity(data, tmp_path):
    """Issue 23: `dlrmctl checkpoint inspect RUN` lists every checkpoint (step, size, world size, plan,
    the val metrics recorded at its step, LATEST / BEST) and checks integrity from sizes (``--verify``:
    every block); `--checkpoint` describes one; damaged / incomplete checkpoints are flagged (exit 1),
    a wrong run or step is one error line (exit 2); never a traceback."""
    runs = str(tmp_path)
    run = os.path.join(runs, "i")
    _train(None, _cfg(data, runs, "i", 6, "train.eval_every=3"), run, False,
           None).train()
    evals = {r["step"]: r for r in map(json.loads, open(os.path.join(run, "metrics.jsonl"))) if r["kind"] == "eval"}
    have = ckpt.list_checkpoints(run)
    assert [s for s, _ in have] == [3, 6]
    best = os.path.basename(ckpt.best_checkpoint(run))

    def cli(*args):
        r = runner.invoke(app, ["checkpoint", "inspect", *map(str, args)])
        assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit)), r.output
        return r

    r = cli(run)
    assert r.exit_code == 0, r.output
    rows = {ln.split()[0]: ln for ln in r.output.splitlines() if ln.strip().startswith("step_")}
    assert set(rows) == {"step_00000003", "step_00000006"}, r.output
    assert "LATEST" in rows["step_00000006"] and "LATEST" not in rows["step_00000003"], r.output
    assert "BEST" in rows[best] and all("BEST" not in v for k, v in rows.items() if k != best)
    for s in (3, 6):
        ln = rows[f"step_{s:08d}"]
        assert f" {s} " in ln and f"{evals[s]['auc']:.4f}" in ln and f"{evals[s]['logloss']:.4f}" in ln, ln
        assert " 1 " in ln and "none" in ln  # world size 1, no plan
    assert "all files present with their recorded sizes" in r.output

    r = cli(run, "--checkpoint", "3", "--verify")
    assert r.exit_code == 0, r.output
    nbytes = sum(f["bytes"] for f in ckpt.load_checkpoint_meta(have[0][1])["files"].values())
    assert "step 3" in r.output and f"{nbytes:,} bytes" in r.output and "world size   1" in r.output
    assert f"auc {evals[3]['auc']:.4f}" in r.output and "checksum blocks" in r.output and "verified" in r.output

    # a flipped byte keeps the size: only --verify reads it; a truncated file shows in the listing
    f = os.path.join(have[0][1], "__0_0.distcp")
    orig = open(f, "rb").read()
    bad = bytearray(orig)
    bad[len(bad) // 2] ^= 0xFF
    open(f, "wb").write(bytes(bad))
    assert cli(run).exit_code == 0
    r = cli(run, "--verify")
    assert r.exit_code == 1 and "DAMAGED" in r.output and f in r.output and "CRC-32" in r.output, r.output
    open(f, "wb").write(orig[:100])
    r = cli(run)
    assert r.exit_code == 1 and "DAMAGED" in r.output and "truncated" in r.output, r.output
    os.makedirs(os.path.join(run, "checkpoints", "step_00000009"))  # no meta.json: not a complete checkpoint
    r = cli(run)
    assert r.exit_code == 1 and "step_00000009" in r.output and "not a complete checkpoint" in r.output, r.output

    for args, want in (([os.path.join(runs, "nope")], "no such run directory"),
                       ([run, "--checkpoint", "99"], "no checkpoint of step 99; it has steps 3")):
        r = cli(*args)
        assert r.exit_code == 2 and r.output.startswith("error: ") and want in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1, r.output
    empty = os.path.join(runs, "empty")
    os.makedirs(os.path.join(empty, "checkpoints", ".step_00000001.tmp"))
    r = cli(empty)
    assert r.exit_code == 2 and "no checkpoint" in r.output and "interrupted" in r.output, r.output
