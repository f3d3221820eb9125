"""Train pipelines give per-step losses identical to the plain loop, on 1 and 2
ranks, across an epoch end with a partial last batch; uneven ranks never hang;
torchx launch writes the same metrics as the in-process two-rank run."""

import json
import os

import pytest
import torch

from dlrmctl.config import config_from_dict
from dlrmctl.distributed.env import RunEnv
from dlrmctl.train.trainer import Trainer
from tests.dist_utils import run_multiprocess


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    from dlrmctl.data.synthetic import generate_synthetic

    d = tmp_path_factory.mktemp("tiny")
    # 2,000 rows -> ~1,600 train rows; batch 192 -> 9 batches per epoch, the last one partial
    generate_synthetic(d, rows=2000, seed=3, num_embeddings=[50] * 26)
    return str(d)


def _cfg(data, run_dir, pipeline, **over):
    # column_wise is left out on purpose: row-wise Adagrad keeps one accumulator per row
    # *per column shard*, so a CW table is not the same optimizer as the unsharded one.
    raw = {
        "name": f"p_{pipeline}",
        "data": {"path": data, "batch_size": 192, "eval_batch_size": 1024, "prefetch": 2},
        "model": {"embedding_dim": 8, "dense_arch_layer_sizes": [16, 8], "over_arch_layer_sizes": [16, 1]},
        "optimizer": {"embedding": {"lr": 0.05}, "dense": {"lr": 0.05}},
        "train": {"epochs": 3, "max_steps": 20, "log_every": 1, "seed": 0, "run_dir": run_dir,
                  "pipeline": pipeline, "progress": False, "eval_every": 0},
        "sharding": {"tables": {"t_C1": {"sharding_type": "row_wise"}, "t_C2": {"sharding_type": "table_wise", "ranks": [1]},
                                "t_C3": {"sharding_type": "data_parallel", "compute_kernel": "dense"}}},
    }
    for k, v in over.items():
        raw[k].update(v)
    return config_from_dict(raw)


def _losses(run_dir, name):
    with open(os.path.join(run_dir, name, "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f) if r["kind"] == "train"]


def _train_on_rank(env, data, run_dir, pipeline):
    cfg = _cfg(data, run_dir, pipeline)
    renv = RunEnv(env.rank, env.world_size, env.local_world_size, env.device, env)
    run = os.path.join(run_dir, cfg.name)
    if env.rank == 0:
        os.makedirs(run, exist_ok=True)
    Trainer(cfg, renv, run).train()
    return _losses(run_dir, cfg.name) if env.rank == 0 else None


@pytest.mark.parametrize("pipeline", ["base", "sparse_dist"])
def test_pipelines_match_the_plain_loop_on_one_process_across_an_epoch_end(tiny_data, tmp_path, pipeline):
    out = {}
    for p in ("none", pipeline):
        cfg = _cfg(tiny_data, str(tmp_path), p)
        Trainer(cfg, RunEnv(), os.path.join(tmp_path, cfg.name)).train()
        out[p] = _losses(tmp_path, cfg.name)
    assert len(out["none"]) == 20  # 9 batches per epoch: crosses two epoch ends
    assert out[pipeline] == out["none"]


@pytest.mark.multiprocess
def test_pipelines_match_the_plain_loop_on_two_ranks_and_one_rank(tiny_data, tmp_path):
    ref = Trainer(_cfg(tiny_data, str(tmp_path / "ref"), "none"), RunEnv(), str(tmp_path / "ref" / "p_none"))
    ref.train()
    single = _losses(tmp_path / "ref", "p_none")
    res = {}
    for p in ("none", "base", "sparse_dist"):
        res[p] = run_multiprocess(_train_on_rank, 2, tiny_data, str(tmp_path / p), p, timeout_s=240)[0]
    assert res["base"] == res["none"]
    assert res["sparse_dist"] == res["none"]
    # the sharded run is the same model: losses agree with one process to float tolerance
    assert res["none"] == pytest.approx(single, rel=1e-5, abs=1e-6)


def _uneven(env, steps_per_rank):
    import torch

    from dlrmctl.train.data import empty_batch_like, exactly
    from dlrmctl.train.pipeline import make_pipeline

    seen = []

    def fake_batches(n):
        from dlrmctl.data.batch import Batch
        from dlrmctl.sparse import KeyedJaggedTensor

        for i in range(n):
            yield Batch(torch.zeros(2, 1), KeyedJaggedTensor(["f"], torch.zeros(2, dtype=torch.int64),
                                                             lengths=torch.ones(2, dtype=torch.int64)), torch.ones(2))

    def step(batch, ctx):
        # a collective every step: a rank that stopped early would leave the other waiting here
        t = torch.tensor([batch.labels.numel()], dtype=torch.int64)
        torch.distributed.all_reduce(t)
        seen.append(int(t))
        return 0.0

    n = max(steps_per_rank)
    pipe = make_pipeline("base", torch.device("cpu"), step)
    for _epoch in range(2):  # the pipeline is reused for a second epoch
        pipe.reset(exactly(fake_batches(steps_per_rank[env.rank]), n, lambda: empty_batch_like(1, ["f"])))
        while pipe.progress() is not None:
            pass
    return seen


@pytest.mark.multiprocess
def test_two_ranks_with_three_and_two_batches_finish_the_epoch_without_hanging():
    seen = run_multiprocess(_uneven, 2, [3, 2], timeout_s=60)
    assert seen[0] == seen[1] == [4, 4, 2] * 2


def test_ten_samples_batch_four_is_three_steps_of_4_4_2(tmp_path):
    import torch

    from dlrmctl.train.data import exactly
    from dlrmctl.train.pipeline import make_pipeline

    sizes = []
    pipe = make_pipeline("base", torch.device("cpu"), lambda b, c: sizes.append(b.labels.numel()) or 0.0)

    class B:
        def __init__(self, n):
            self.labels = torch.zeros(n)

        def to(self, d, non_blocking=False):
            return self

    pipe.reset(exactly(iter([B(4), B(4), B(2)]), 3, None))
    while pipe.progress() is not None:
        pass
    assert sizes == [4, 4, 2] and pipe.stats.steps == 3 and pipe.stats.samples == 10


@pytest.mark.multiprocess
@pytest.mark.slow
def test_torchx_launch_writes_the_same_metrics_as_the_in_process_two_rank_run(tiny_data, tmp_path):
    from typer.testing import CliRunner

    from dlrmctl.cli import app

    inproc = run_multiprocess(_train_on_rank, 2, tiny_data, str(tmp_path / "inproc"), "sparse_dist", timeout_s=240)[0]
    import yaml

    from dlrmctl.config import to_dict

    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(to_dict(_cfg(tiny_data, str(tmp_path / "torchx"), "sparse_dist"))))
    r = CliRunner().invoke(app, ["train", str(cfg_path), "--nproc", "2"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert _losses(tmp_path / "torchx", "p_sparse_dist") == inproc


# ----------------------------------------------------- stream choreography
class _RecordingStreams:
    """A StreamProvider that logs every stream/event operation (for the order test)."""

    def __init__(self, log):
        self.log = log
        self._active = ["default"]
        self._n = 0

    def new_stream(self, name):
        return name

    def current_stream(self):
        return "default"

    def use(self, stream):
        import contextlib

        @contextlib.contextmanager
        def cm():
            self._active.append(stream)
            try:
                yield
            finally:
                self._active.pop()
        return cm()

    def record_event(self, stream):
        self._n += 1
        ev = f"ev{self._n}@{stream}"
        self.log.append(("record_event", stream, ev))
        return ev

    def wait_event(self, stream, event):
        self.log.append(("wait_event", stream, event))

    def record_stream(self, obj, stream):
        self.log.append(("record_stream", getattr(obj, "name", type(obj).__name__), stream))

    def on(self):
        return self._active[-1]


class _FakeKJT:
    def __init__(self, name):
        self.name = name


class _FakeBatch:
    def __init__(self, i, streams=None, log=None, on_device=False):
        self.i, self.streams, self.log, self.on_device = i, streams, log, on_device
        self.name = f"b{i}" if on_device else f"host{i}"
        self.sparse_features = _FakeKJT(f"kjt{i}")
        self.labels = torch.zeros(3)

    def to(self, device, non_blocking=False):
        self.log.append(("copy", f"b{self.i}", self.streams.on(), non_blocking))
        return _FakeBatch(self.i, self.streams, self.log, on_device=True)


def _order_run(calls_hook=True, n=5, steps_n=3):
    from dlrmctl.train.pipeline import make_pipeline

    log = []
    streams = _RecordingStreams(log)

    class Aw:
        def __init__(self, name):
            self.name = name

        def wait(self):
            log.append(("dist_wait", self.name, streams.on()))
            return _FakeKJT(f"ctx_{self.name}")

    def start(kjt):
        log.append(("dist_start", kjt.name, streams.on()))
        return Aw(kjt.name)

    def run_step(batch, ctx, after_forward=None):
        log.append(("forward", batch.name, ctx.name, streams.on()))
        if calls_hook:
            after_forward()
        log.append(("backward", batch.name, streams.on()))
        return 0.0

    pipe = make_pipeline("sparse_dist", torch.device("cpu"), run_step, start, streams=streams)
    pipe.reset(iter([_FakeBatch(i, streams, log) for i in range(n)]))
    steps = []
    for _ in range(steps_n):
        log.clear()
        assert pipe.progress() is not None
        steps.append(list(log))
    return steps


def test_sparse_dist_stream_order_wait_i_forward_i_then_dist_i_plus_1_then_backward_i():
    # TorchRec's order: batch i's input_dist is waited on and its forward queued BEFORE batch
    # i+1's input_dist starts (its size exchange is a blocking read that NCCL would queue behind
    # step i-1's backward collectives), and the default stream's wait event is recorded on the
    # data-dist stream before any of batch i+1's work is queued there
    steps = _order_run()
    # priming (step 0 only): b0 copied, b0's input_dist started after its copy event, b1 copied
    assert steps[0][:7] == [
        ("copy", "b0", "memcpy", True), ("record_event", "memcpy", "ev1@memcpy"),
        ("wait_event", "data_dist", "ev1@memcpy"), ("record_stream", "kjt0", "data_dist"),
        ("dist_start", "kjt0", "data_dist"),
        ("copy", "b1", "memcpy", True), ("record_event", "memcpy", "ev2@memcpy"),
    ]
    flat = [e for st in steps for e in st]
    copy_event = {e[1]: flat[k + 1][2] for k, e in enumerate(flat) if e[0] == "copy"}  # batch -> its copy event
    steady = [steps[0][7:], steps[1], steps[2]]
    for i, s in enumerate(steady):
        ev_copy_next, ev_copy_cur = copy_event[f"b{i + 1}"], copy_event[f"b{i}"]
        names = [e[0] for e in s]
        assert names == ["copy", "record_event",  # 1. batch i+2 host->device on memcpy
                         "dist_wait", "record_event", "wait_event", "record_stream",  # 2. default waits for i's dist
                         "wait_event", "record_stream",  # ... and i's copy
                         "forward",  # 3. forward i queued
                         "wait_event", "record_stream", "dist_start",  # ... then batch i+1's input_dist
                         "backward"], s  # 4. backward i
        assert s[0] == ("copy", f"b{i + 2}", "memcpy", True)
        assert s[2] == ("dist_wait", f"kjt{i}", "data_dist")
        assert s[3][:2] == ("record_event", "data_dist") and s[4] == ("wait_event", "default", s[3][2])
        assert s[5] == ("record_stream", f"ctx_kjt{i}", "default")
        assert s[6] == ("wait_event", "default", ev_copy_cur) and s[7] == ("record_stream", f"b{i}", "default")
        assert s[8] == ("forward", f"b{i}", f"ctx_kjt{i}", "default")
        assert s[9] == ("wait_event", "data_dist", ev_copy_next)
        assert s[10] == ("record_stream", f"kjt{i + 1}", "data_dist") and s[11] == ("dist_start", f"kjt{i + 1}", "data_dist")
        assert s[12] == ("backward", f"b{i}", "default")


def test_sparse_dist_starts_the_next_input_dist_after_a_run_step_that_ignores_the_hook():
    for s in _order_run(calls_hook=False)[1:]:
        names = [e[0] for e in s]
        assert names.index("dist_wait") < names.index("forward") < names.index("backward") < names.index("dist_start")


def test_comm_wait_counts_the_blocking_start_of_an_input_dist():
    import time

    from dlrmctl.train.pipeline import make_pipeline

    class Aw:
        def wait(self):
            return _FakeKJT("ctx")

    def start(kjt):
        time.sleep(0.05)  # the size exchange's blocking host read
        return Aw()

    log = []
    streams = _RecordingStreams(log)
    pipe = make_pipeline("sparse_dist", torch.device("cpu"), lambda b, c, **kw: 0.0, start, streams=streams)
    pipe.reset(iter([_FakeBatch(i, streams, log) for i in range(3)]))
    while pipe.progress() is not None:
        pass
    assert pipe.stats.steps == 3 and pipe.stats.comm_wait_s >= 3 * 0.05  # every batch's start counted


def test_sparse_dist_pipeline_drains_short_epochs_without_losing_batches():
    from dlrmctl.train.pipeline import make_pipeline

    for n in range(0, 5):
        log = []
        streams = _RecordingStreams(log)

        class Aw:
            def __init__(self, name):
                self.name = name

            def wait(self):
                return _FakeKJT(f"ctx_{self.name}")

        done = []
        pipe = make_pipeline("sparse_dist", torch.device("cpu"), lambda b, c, **kw: done.append((b.name, c.name)) or 0.0,
                             lambda k: Aw(k.name), streams=streams)
        pipe.reset(iter([_FakeBatch(i, streams, log) for i in range(n)]))
        while pipe.progress() is not None:
            pass
        assert done == [(f"b{i}", f"ctx_kjt{i}") for i in range(n)]


def test_a_non_finite_loss_stops_training_before_any_checkpoint_or_evaluation(tiny_data, tmp_path):
    from dlrmctl.train.run_dir import TrainError

    cfg = _cfg(tiny_data, str(tmp_path), "sparse_dist", optimizer={"dense": {"type": "sgd", "lr": 1e30}},
               train={"log_every": 0, "checkpoint_every": 2, "eval_every": 2, "max_steps": 10})
    cfg.optimizer.embedding.lr = 1e30
    cfg.sharding.tables = {}
    t = Trainer(cfg, RunEnv(), os.path.join(tmp_path, cfg.name))
    with pytest.raises(TrainError, match=r"loss became nan in steps 1\.\.2.*no evaluation or checkpoint"):
        t.train()
    assert not os.path.exists(os.path.join(tmp_path, cfg.name, "checkpoints"))


def test_evaluation_range_checks_ids_like_training(tiny_data, tmp_path):
    from dlrmctl.data.synthetic import generate_synthetic
    from dlrmctl.sparse.validation import EmbeddingIdError

    other = tmp_path / "wide"
    generate_synthetic(other, rows=400, seed=1, num_embeddings=[5000] * 26)  # ids beyond the model's 50 rows
    cfg = _cfg(tiny_data, str(tmp_path), "none")
    t = Trainer(cfg, RunEnv(), os.path.join(tmp_path, cfg.name))
    with pytest.raises(EmbeddingIdError, match=r"val split, epoch 1, batch 1: table 't_C\d+', feature 'C\d+': id \d+"):
        t.evaluate(data_dir=str(other))
