"""torchx launch: the AppDef of `train --nproc --dry-run` and cluster job specs."""

import pytest
from typer.testing import CliRunner

from dlrmctl.cli import app
from dlrmctl.launch import build_appdef

runner = CliRunner()


def test_appdef_runs_torchrun_with_the_worker_module_and_overrides():
    a = build_appdef("configs/demo.yaml", ["train.seed=3"], nproc=4, nnodes=2, resume=True)
    (role,) = a.roles
    cmd = " ".join(role.args)
    assert "torchrun" in cmd and "--nnodes 2" in cmd and "--nproc_per_node 4" in cmd
    assert "-m dlrmctl.train.worker configs/demo.yaml --set train.seed=3 --resume" in cmd
    assert role.num_replicas == 2 and role.resource.cpu == 4


def test_train_dry_run_prints_the_appdef():
    r = runner.invoke(app, ["train", "configs/demo.yaml", "--nproc", "2", "--dry-run"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "AppDef" in r.output and "dlrmctl.train.worker" in r.output and "resources:" in r.output


def test_slurm_dry_run_prints_an_sbatch_script():
    r = runner.invoke(app, ["launch", "configs/criteo_kaggle.yaml", "--scheduler", "slurm", "--dry-run",
                            "--nproc", "8", "--nnodes", "2", "--gpus-per-proc", "1"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "#SBATCH" in r.output and "--nproc_per_node 8" in r.output and "--gpus-per-task=8" in r.output


def test_kubernetes_dry_run_prints_a_volcano_job():
    pytest.importorskip("kubernetes", reason="the kubernetes client (dlrmctl[cluster]) is not installed")
    r = runner.invoke(app, ["launch", "configs/criteo_kaggle.yaml", "--scheduler", "kubernetes", "--dry-run",
                            "--nproc", "8", "--image", "registry/dlrmctl:0.1"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "batch.volcano.sh" in r.output and "registry/dlrmctl:0.1" in r.output


def test_a_stored_plan_that_does_not_match_fails_before_any_process_starts(tmp_path):
    import yaml

    from dlrmctl.data.synthetic import generate_synthetic

    data = tmp_path / "data"
    generate_synthetic(data, rows=500, seed=0, num_embeddings=[20] * 26)
    common = ["--set", f"data.path={data}", "--set", f"train.run_dir={tmp_path}"]
    plan = tmp_path / "plan.yaml"
    r = runner.invoke(app, ["plan", "configs/demo.yaml", "--gpus", "2", "--device", "cpu", "--out", str(plan), *common])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["train", "configs/demo.yaml", "--nproc", "3", "--plan", str(plan), *common])
    assert r.exit_code == 2 and "plan is for world_size 2 but the job has 3 ranks" in r.output
    d = yaml.safe_load(plan.read_text())
    del d["tables"]["t_C5"]
    plan.write_text(yaml.safe_dump(d))
    r = runner.invoke(app, ["train", "configs/demo.yaml", "--nproc", "2", "--plan", str(plan), *common])
    assert r.exit_code == 2 and "no sharding for table(s) ['t_C5']" in r.output
