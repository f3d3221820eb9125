"""Edge cases users hit (issue 12 items 7 and 11): LR schedule validation, the KJT stride
message, the exported model's out-of-range message, the checkpointed optimizer step and
``data.drop_last``."""

import os

import pytest
import torch

from dlrmctl import HAS_FBGEMM
from dlrmctl.config import ConfigError, config_from_dict
from dlrmctl.train.optimizers import WarmupPolyDecay


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    from dlrmctl.data.synthetic import generate_synthetic

    d = tmp_path_factory.mktemp("tiny_edges")
    generate_synthetic(d, rows=2000, seed=3, num_embeddings=[50] * 26)  # train 1620, val 194 rows
    return str(d)


def _raw(data, run_dir, **over):
    raw = {
        "name": "edge",
        "data": {"path": data, "batch_size": 192, "eval_batch_size": 64, "prefetch": 0},
        "model": {"embedding_dim": 8, "dense_arch_layer_sizes": [16, 8], "over_arch_layer_sizes": [16, 1]},
        "optimizer": {"embedding": {"lr": 0.05}, "dense": {"lr": 0.05}},
        "train": {"epochs": 1, "log_every": 0, "run_dir": run_dir, "progress": False, "pipeline": "none"},
    }
    for k, v in over.items():
        raw[k].update(v)
    return raw


# ------------------------------------------------------------------ item 7: LR schedule
@pytest.mark.parametrize("schedule,match", [
    # the input: the factor jumped from 1.0 to 0.25 at step 4 (the reference refuses it)
    ({"warmup_steps": 4, "decay_start_step": 2, "decay_steps": 4},
     r"optimizer\.lr_schedule\.decay_start_step: warmup must finish before decay starts: decay_start_step 2 < warmup_steps 4"),
    ({"warmup_steps": 4, "decay_start_step": 2}, r"decay_start_step: warmup must finish before decay starts"),
    ({"warmup_steps": 4, "decay_steps": 10}, r"decay_start_step: warmup must finish before decay starts: decay_start_step 0"),
    ({"warmup_steps": -1}, r"optimizer\.lr_schedule\.warmup_steps: must be >= 0, got -1"),
    ({"decay_start_step": -2, "decay_steps": 3}, r"optimizer\.lr_schedule\.decay_start_step: must be >= 0, got -2"),
    ({"decay_steps": -3}, r"optimizer\.lr_schedule\.decay_steps: must be >= 0, got -3"),
    ({"decay_steps": 4, "decay_power": 0.0}, r"optimizer\.lr_schedule\.decay_power: must be a finite number > 0"),
    ({"decay_steps": 4, "decay_power": -1.0}, r"optimizer\.lr_schedule\.decay_power: .* got -1\.0"),
    ({"decay_steps": 4, "end_lr_factor": 1.5}, r"optimizer\.lr_schedule\.end_lr_factor: must be in \[0, 1\]"),
    ({"decay_steps": 4, "end_lr_factor": -0.1}, r"optimizer\.lr_schedule\.end_lr_factor: must be in \[0, 1\]"),
    ({"decay_start_step": 5}, r"optimizer\.lr_schedule\.decay_start_step: 5 but decay_steps is 0 \(no decay\)"),
])
def test_lr_schedules_the_dlrm_reference_refuses_are_refused_at_load_naming_the_key(schedule, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict({"optimizer": {"lr_schedule": schedule}})
    # the same through --set
    sets = [f"optimizer.lr_schedule.{k}={v}" for k, v in schedule.items()]
    with pytest.raises(ConfigError, match=match):
        config_from_dict({}, overrides=sets)


def test_valid_lr_schedules_load_and_have_no_jump():
    for ok in ({}, {"warmup_steps": 4}, {"decay_steps": 5}, {"warmup_steps": 4, "decay_start_step": 4, "decay_steps": 4},
               {"warmup_steps": 2, "decay_start_step": 6, "decay_steps": 4, "decay_power": 1.0, "end_lr_factor": 1.0}):
        config_from_dict({"optimizer": {"lr_schedule": ok}})
    s = WarmupPolyDecay(config_from_dict({"optimizer": {"lr_schedule": {
        "warmup_steps": 4, "decay_start_step": 4, "decay_steps": 4}}}).optimizer.lr_schedule)
    assert [s.factor(i) for i in range(9)] == [0.25, 0.5, 0.75, 1.0, 1.0, 0.5625, 0.25, 0.0625, 0.0]


# ------------------------------------------------------------------ item 11: small cases
def test_kjt_with_the_wrong_number_of_lengths_names_the_stride_and_the_expected_count():
    from dlrmctl.sparse import KeyedJaggedTensor, SparseInputError

    for kw in ({"lengths": torch.ones(11, dtype=torch.int64)}, {"offsets": torch.arange(12)}):
        with pytest.raises(SparseInputError, match=r"stride 4 \* 3 keys != 11 lengths; expected 12 lengths .*'f0', 'f1', 'f2'"):
            KeyedJaggedTensor(["f0", "f1", "f2"], torch.arange(11), stride=4, **kw)


@pytest.mark.skipif(not HAS_FBGEMM, reason="export needs fbgemm_gpu")
@pytest.mark.parametrize("artifact", ["torchscript", "pt2"])
def test_exported_out_of_range_id_error_names_the_table(tmp_path, artifact):
    from dlrmctl.inference.export import ExportError, ExportOptions, export_model, load_exported
    from dlrmctl.modules.dlrm import DLRM
    from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
    from dlrmctl.modules.embedding_modules import EmbeddingBagCollection

    tables = [EmbeddingBagConfig(name="t0", num_embeddings=10, embedding_dim=8, feature_names=["f0", "f1"]),
              EmbeddingBagConfig(name="t1", num_embeddings=20, embedding_dim=8, feature_names=["f2"])]
    model = DLRM(EmbeddingBagCollection(tables, compute_kernel="fused", seed=0), 4, [8], [8, 1], 3, 8).eval()
    export_model(model, tmp_path / "m", ExportOptions("fp32", artifact=artifact))
    m = load_exported(tmp_path / "m")
    B = 2
    dense = torch.zeros(B, 4)
    lengths = torch.ones(3 * B, dtype=torch.int64)
    values = torch.tensor([10, 0, 1, 1, 2, 2])  # feature f0, sample 0: id 10 (t0 has 10 rows)
    want = r"table 't0', feature 'f0', sample 0: id 10 is out of range; expected 0 <= id < 10"
    with pytest.raises(ExportError, match=want):
        m.score(dense, values, lengths)
    with pytest.raises(ExportError, match=want):
        m.logits(dense, values, lengths)
    values = torch.tensor([0, 0, 1, 1, 2, 20])
    with pytest.raises(ExportError, match=r"table 't1', feature 'f2', sample 1: id 20 .*< 20"):
        m.score(dense, values, lengths)


@pytest.mark.parametrize("opt", ["exact_rowwise_adagrad", "exact_adagrad", "exact_sgd"])
def test_checkpoint_stores_the_true_optimizer_step_for_every_embedding_optimizer(tiny_data, tmp_path, opt):
    from dlrmctl.train import checkpoint as ckpt
    from dlrmctl.distributed.env import RunEnv
    from dlrmctl.train.trainer import Trainer

    N = 3
    cfg = config_from_dict(_raw(tiny_data, str(tmp_path), optimizer={"embedding": {"type": opt, "lr": 0.05}},
                                train={"max_steps": N}))
    run = os.path.join(tmp_path, cfg.name)
    os.makedirs(run)
    Trainer(cfg, RunEnv(), run).train()
    path = ckpt.latest_checkpoint(run)
    st = {"meta/fused_optimizer": None, "meta/trainer": None}
    ckpt.load_checkpoint(path, st)
    fused = ckpt.unpack(st["meta/fused_optimizer"])
    assert ckpt.unpack(st["meta/trainer"])["step"] == N
    assert fused["type"] == opt and fused["step"] == N  # was TBE iter: 0 (adagrad, sgd); 7 (row-wise: + 4 eval batches)
    # resuming puts the step into every TBE's counter
    t = Trainer(cfg, RunEnv(), run, resume=True)
    steps = t.optimizers.fused.optimizer_steps()
    assert steps and all(s == N for s in steps)


def test_data_drop_last_drops_the_last_partial_train_batch_but_evaluation_keeps_every_row(tiny_data, tmp_path):
    from dlrmctl.distributed.env import RunEnv
    from dlrmctl.train.trainer import Trainer

    steps = {}
    for drop in (False, True):
        cfg = config_from_dict(_raw(tiny_data, str(tmp_path / str(drop))), overrides=[f"data.drop_last={str(drop).lower()}"])
        assert cfg.data.drop_last is drop
        run = os.path.join(tmp_path, str(drop), cfg.name)
        os.makedirs(run)
        t = Trainer(cfg, RunEnv(), run)
        assert t.train_loader.drop_last is drop
        res = t.train()
        steps[drop] = res["steps"]
        assert res["final"]["num_samples"] == 194  # 194 val rows, eval batch 64: nothing dropped
    assert steps == {False: 9, True: 8}  # 1620 train rows, batch 192
    with pytest.raises(ConfigError, match=r"data\.drop_last: expected bool"):
        config_from_dict({}, overrides=["data.drop_last=3"])
