"""Every evaluation path computes AUC / log loss from the logits in float64 (issue 12 item 6).

A float32 sigmoid rounds to exactly 1.0 above a logit of ~16.6: shifting every logit of a trained
model by +40 used to tie every sample (AUC 0.5) and clip the log loss.
"""

import numpy as np
import pytest
import torch
from torch import nn

from dlrmctl import HAS_FBGEMM
from dlrmctl.config import config_from_dict
from dlrmctl.distributed.env import RunEnv
from dlrmctl.train.trainer import Trainer
from dlrmctl.train.reload import evaluate_run
from dlrmctl.train.run_dir import prepare_run_dir
from dlrmctl.metrics import compute_metrics, compute_metrics_from_logits

SHIFT = 40.0


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    from dlrmctl.data.synthetic import generate_synthetic

    d = tmp_path_factory.mktemp("tiny_eval")
    generate_synthetic(d, rows=2000, seed=3, num_embeddings=[50] * 26)
    return str(d)


def _val_logits(t: Trainer) -> tuple[np.ndarray, np.ndarray]:
    """The model's val logits (float32, as the model computes them) and labels, in one batch."""
    from dlrmctl.data.loader import BatchLoader

    loader = BatchLoader(t.cfg.data.path, "val", 1 << 20, shuffle=False, features=t.feature_names)
    (batch,) = list(loader)
    t.model.eval()
    with torch.no_grad():
        z = t.model(batch.dense_features, batch.sparse_features).squeeze(1).float().numpy()
    t.model.train()
    return z, batch.labels.numpy()


@pytest.mark.skipif(not HAS_FBGEMM, reason="export needs fbgemm_gpu")
def test_metrics_of_logits_shifted_by_40_match_the_logits_on_every_evaluation_path(tiny_data, tmp_path):
    from dlrmctl.inference.export import evaluate_exported, export_run

    cfg = config_from_dict({
        "name": "shift",
        "data": {"path": tiny_data, "batch_size": 128, "eval_batch_size": 256, "prefetch": 0},
        "model": {"embedding_dim": 8, "dense_arch_layer_sizes": [16, 8], "over_arch_layer_sizes": [16, 1]},
        "optimizer": {"embedding": {"lr": 0.05}, "dense": {"lr": 0.05}},
        "train": {"epochs": 1, "max_steps": 12, "log_every": 0, "run_dir": str(tmp_path), "progress": False},
    })
    run = prepare_run_dir(cfg, resume=False, overwrite=False)  # config.yaml + data_meta.json
    t = Trainer(cfg, RunEnv(), run)
    t.train()
    z0, y = _val_logits(t)
    before = t.evaluate()
    assert before["auc"] == pytest.approx(compute_metrics_from_logits(z0, y)["auc"], abs=1e-12)
    assert before["auc"] > 0.6  # the model ranks: not a degenerate case

    last = [m for m in t.model.over_arch.modules() if isinstance(m, nn.Linear)][-1]
    with torch.no_grad():
        last.bias += SHIFT  # every logit + 40
    z, _ = _val_logits(t)
    assert z.min() > 17  # float32 sigmoid is exactly 1.0 for all of them
    assert compute_metrics(torch.sigmoid(torch.from_numpy(z)).numpy(), y)["auc"] == 0.5  # the old figure
    # reference: float64 from the unshifted logits (float32 rounding of z0 + 40 may tie a few pairs)
    z64 = z0.astype(np.float64) + SHIFT
    ll = float(np.mean(np.logaddexp(0.0, z64) - y * z64))
    want = compute_metrics_from_logits(z64, y)
    assert want["auc"] == before["auc"]
    got = {"Trainer.evaluate": t.evaluate()}
    t.save()
    # the checkpoint just saved (the shifted model) is the last one; "best" is the trained one
    got["evaluate_run"] = evaluate_run(run, checkpoint="last")
    got["evaluate_run batch 7"] = evaluate_run(run, batch_size=7, checkpoint="last")
    out = export_run(run, "fp32", tmp_path / "export", checkpoint="last").model_dir
    got["evaluate_exported"] = evaluate_exported(out, tiny_data, "val", batch_size=100)
    for path, m in got.items():
        assert m["auc"] == pytest.approx(want["auc"], abs=2e-3), path
        assert m["logloss"] == pytest.approx(ll, rel=1e-5), path
        assert m["ne"] == pytest.approx(want["ne"], rel=1e-5), path
        assert m["calibration"] == pytest.approx(want["calibration"], rel=1e-6), path
        assert m["num_samples"] == y.size, path
    # the figure does not depend on the eval batch size beyond the logits' own float32 rounding: the
    # BLAS may pick another GEMM kernel for 7 rows than for 256 (MKL on Intel CPUs does), which moves
    # a logit by an ulp or so; the metrics of equal logits are exact (tests/train/test_metrics.py)
    assert got["evaluate_run batch 7"]["auc"] == got["evaluate_run"]["auc"]
    assert got["evaluate_run batch 7"]["logloss"] == pytest.approx(got["evaluate_run"]["logloss"], rel=1e-6)
