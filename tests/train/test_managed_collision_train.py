"""Training with managed-collision tables on raw Criteo ids: evictions happen, the remapper state is
in the checkpoint, and a run interrupted and resumed equals one that was not (losses, remappers,
tables), with the fused and the dense kernel."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from dlrmctl.cli import app

runner = CliRunner()


def invoke(*args):
    r = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.output


@pytest.fixture(scope="module")
def raw_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("mc")
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(1200):
        cats = ["%08x" % (int(rng.zipf(1.2)) * 2654435761 % 2**32) for _ in range(26)]
        dense = [str(int(x)) for x in rng.integers(0, 20, 13)]
        lines.append("\t".join([str(int(rng.integers(2)))] + dense + cats))
    (d / "t.tsv").write_text("\n".join(lines) + "\n")
    invoke("preprocess", "criteo", "-i", d / "t.tsv", "-o", d / "data", "--raw-ids", "--val-ratio", "0.1", "-q")
    return d


def _train(raw_data, runs, steps, kernel, *extra):
    return invoke("train", os.path.join(os.path.dirname(__file__), "..", "..", "configs", "demo.yaml"),
                  "--set", f"data.path={raw_data / 'data'}", "--set", f"train.run_dir={runs}", "--set", "name=mc",
                  "--set", "data.batch_size=32", "--set", "model.embedding_dim=8",
                  "--set", "model.dense_arch_layer_sizes=[16, 8]", "--set", "model.over_arch_layer_sizes=[8, 1]",
                  "--set", "model.managed_collision.size=64", "--set", "model.managed_collision.eviction=lfu",
                  "--set", f"model.compute_kernel={kernel}", "--set", "train.log_every=1",
                  "--set", "train.checkpoint_every=4", "--set", "train.eval_every=0", "--set", "train.progress=false",
                  "--set", f"train.max_steps={steps}", *extra)


def _mc_state(run):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    p = os.path.join(run, "checkpoints", sorted(x for x in os.listdir(os.path.join(run, "checkpoints"))
                                                if x.startswith("step_"))[-1])
    md = FileSystemReader(p).read_metadata()
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
          if (k.startswith("mc/") or k.startswith("emb")) and hasattr(m, "size")}
    dcp.load(sd, checkpoint_id=p)
    return sd


def _losses(run):
    return {r["step"]: r["loss"] for r in map(json.loads, open(os.path.join(run, "metrics.jsonl"))) if r["kind"] == "train"}


@pytest.mark.parametrize("kernel", ["fused", "dense"])
def test_resume_mid_run_equals_an_uninterrupted_run_with_evictions(raw_data, tmp_path, kernel):
    from dlrmctl import HAS_FBGEMM

    if kernel == "fused" and not HAS_FBGEMM:
        pytest.skip("fbgemm_gpu is not installed")
    _train(raw_data, tmp_path / "a", 16, kernel)
    _train(raw_data, tmp_path / "b", 8, kernel)
    _train(raw_data, tmp_path / "b", 16, kernel, "--resume")
    a, b = _mc_state(tmp_path / "a" / "mc"), _mc_state(tmp_path / "b" / "mc")
    mc = [k for k in a if k.startswith("mc/")]
    assert mc and set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert _losses(tmp_path / "a" / "mc") == _losses(tmp_path / "b" / "mc")
    # 1,200 Zipf rows: many more distinct ids than 64 rows, so rows were evicted and re-used
    held = a["mc/t_C1.row_ids"][:64]
    assert int((held != (1 << 63) - 1).sum()) == 64 and int(a["mc/t_C1.step"]) == 16
