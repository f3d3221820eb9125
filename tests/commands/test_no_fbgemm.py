"""Without fbgemm_gpu the package imports and trains on the dense kernel, and the
dense kernel's training matches the fused one step for step."""

import json
import subprocess
import sys

from tests.conftest import REPO


def test_trains_with_the_dense_kernel_when_fbgemm_is_absent(tmp_path):
    from dlrmctl.data.synthetic import generate_synthetic

    data = tmp_path / "data"
    generate_synthetic(data, rows=3000, seed=0, num_embeddings=[40] * 26)
    common = ["train", "configs/demo.yaml", "--set", f"data.path={data}", "--set", f"train.run_dir={tmp_path}",
              "--set", "train.progress=false", "--set", "train.max_steps=5", "--set", "train.log_every=1",
              "--set", "data.batch_size=256"]
    p = subprocess.run([sys.executable, str(REPO / "tests" / "helpers" / "run_without_fbgemm.py"), *common,
                        "--set", "name=nofbgemm"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "HAS_FBGEMM False" in p.stdout and "using the dense" in p.stderr
    # every figure of the fallback says so: the startup line and the epoch's samples/s
    out = p.stdout + p.stderr
    assert "embeddings: dense fallback (fbgemm_gpu is not installed): 26 table shard(s)" in out, out
    assert "pipeline, dense fallback)" in next(line for line in out.splitlines() if line.startswith("epoch 1/1")), out
    from typer.testing import CliRunner

    from dlrmctl.cli import app

    r = CliRunner().invoke(app, common + ["--set", "name=fused"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "dense fallback" not in r.output  # FBGEMM's run

    def losses(name):
        return [x["loss"] for x in map(json.loads, open(tmp_path / name / "metrics.jsonl")) if x["kind"] == "train"]

    dense, fused = losses("nofbgemm"), losses("fused")
    assert len(dense) == 5
    assert all(abs(a - b) < 1e-4 for a, b in zip(dense, fused)), (dense, fused)


def test_plan_without_fbgemm_plans_the_dense_kernel_and_says_so(tmp_path):
    """fbgemm_gpu unimportable: `dlrmctl plan` plans every table on the dense kernel, the one train runs."""
    import yaml

    from dlrmctl.commands.plan import NO_FBGEMM_LINE
    from dlrmctl.distributed.types import ComputeKernel, ShardingPlan

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"embedding_dim": 16, "dense_arch_layer_sizes": [32, 16],
                  "tables": [{"name": "a", "num_embeddings": 100_000}, {"name": "b", "num_embeddings": 50}]},
        "data": {"path": str(tmp_path / "none"), "batch_size": 512}}))
    out = tmp_path / "p.yaml"
    p = subprocess.run([sys.executable, str(REPO / "tests" / "helpers" / "run_without_fbgemm.py"), "plan", str(cfg),
                        "--gpus", "2", "--device", "cpu", "--out", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "HAS_FBGEMM False" in p.stdout and NO_FBGEMM_LINE in p.stdout, p.stdout
    assert {ps.compute_kernel for ps in ShardingPlan.load(out).plan.values()} == {ComputeKernel.DENSE}
