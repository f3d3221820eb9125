"""A diverging run stops with one line and keeps nothing of the diverged model: a table bound
whose dot products overflow fp32 is refused before training; a model whose validation scores are
not finite (its weights went inf/nan after the last finite loss) ends with exit 2, no best, no
checkpoint, no evaluation record."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import yaml

from tests.conftest import one_error_line, tiny_synthetic


def _config(tmp_path, data, **model):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"name": "d", "data": {"path": str(data), "batch_size": 64, "prefetch": 0},
                                 "model": {"embedding_dim": 8, "dense_arch_layer_sizes": [16, 8],
                                           "over_arch_layer_sizes": [8, 1], **model},
                                 "train": {"run_dir": str(tmp_path / "runs"), "max_steps": 4, "eval_every": 2,
                                           "checkpoint_every": 2, "progress": False}}))
    return p


@pytest.mark.parametrize("a", [1e30, 1e15, 1.5])
def test_an_embedding_init_bound_above_1_is_refused_naming_the_key(tmp_path, a):
    """1e30 overflowed the dot products; 1e15 (finite everywhere) trained to NaN."""
    one_error_line(["train", _config(tmp_path, tmp_path / "none", embedding_init_max=a)],
                   "model.embedding_init_max", "must be a number in (0, 1]", repr(a))


def test_non_finite_validation_scores_stop_the_run_before_any_checkpoint(tmp_path_factory, tmp_path, monkeypatch):
    import dlrmctl.train.evaluator as ev

    data = tiny_synthetic(tmp_path_factory, "diverge", rows=600)
    real = ev.compute_metrics_from_logits
    monkeypatch.setattr(ev, "compute_metrics_from_logits",
                        lambda z, *a, **k: real(np.full_like(np.asarray(z), np.nan), *a, **k))
    from typer.testing import CliRunner

    from dlrmctl.cli import app

    r = CliRunner().invoke(app, ["train", str(_config(tmp_path, data))])
    errors = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert r.exit_code == 2 and "Traceback" not in r.output and len(errors) == 1, r.output
    assert "the model diverged: its val scores at step 2 are not finite" in errors[0]
    assert "best val" not in r.output
    run = tmp_path / "runs" / "d"
    assert not os.path.exists(run / "checkpoints") or not [n for n in os.listdir(run / "checkpoints")
                                                           if n.startswith("step_")]
    recs = [json.loads(x) for x in open(run / "metrics.jsonl")] if (run / "metrics.jsonl").exists() else []
    assert not [r for r in recs if r.get("kind") == "eval"]
