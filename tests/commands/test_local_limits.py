"""What a local run may take from this machine (issue 23): intra-op threads of one process from
the idle CPUs (item 2), a cap on local fan-out (item 12), counts validated at the option level
with one ``error:`` line (item 18)."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from dlrmctl import procs
from dlrmctl.cli import app

runner = CliRunner()


@pytest.fixture
def machine(monkeypatch):
    """A fake machine: ``machine(cpus, load, mem_mb=None)``; OMP_NUM_THREADS and the override unset."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(procs.MAX_PROCS_ENV, raising=False)

    def set_(cpus: int, load: float = 0.0, mem_mb: float | None = 64_000, quota: int | None = None):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
        monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
        monkeypatch.setattr(procs, "_available_memory_mb", lambda: mem_mb)
        monkeypatch.setattr(procs, "_cgroup_cpu_quota", lambda: quota)

    return set_


# ------------------------------------------------------------------ item 2: threads
def test_a_loaded_machine_gets_fewer_intra_op_threads(machine):
    machine(16, load=0.0)
    assert procs.intra_op_threads()[0] == 16
    machine(16, load=12.0)
    n, why = procs.intra_op_threads()
    assert n == 4 and "load 12.0" in why
    machine(2, load=1.9)  # the machine: 1 thread, not 2 spinning against the other work
    assert procs.intra_op_threads()[0] == 1
    machine(2, load=30.0)
    assert procs.intra_op_threads()[0] == 1  # never 0
    machine(8, load=0.0)
    assert procs.intra_op_threads(4)[0] == 2  # shared among the local processes
    machine(64, load=0.0, quota=3)  # a container's CPU quota below its affinity mask
    n, why = procs.intra_op_threads()
    assert n == 3 and "cgroup quota" in why


def test_omp_num_threads_is_honoured(machine, monkeypatch):
    machine(2, load=30.0)
    monkeypatch.setenv("OMP_NUM_THREADS", "6")
    assert procs.intra_op_threads() == (6, "OMP_NUM_THREADS is set")


def test_single_process_train_says_and_uses_its_thread_count(machine, monkeypatch, tmp_path):
    from dlrmctl.data.synthetic import generate_synthetic

    machine(4, load=3.0)  # 1 idle CPU
    generate_synthetic(tmp_path / "d", rows=600, seed=0, num_embeddings=[20] * 26)
    args = ["train", "configs/demo.yaml", "--set", f"data.path={tmp_path / 'd'}",
            "--set", f"train.run_dir={tmp_path / 'runs'}", "--set", "train.max_steps=2", "--set", "train.progress=false"]
    got = {}
    with monkeypatch.context() as m:
        m.setattr("dlrmctl.train.worker.run_training", lambda *a, **k: got.update(k))
        r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert got["threads"] == 1 and got["threads_why"] == "4 CPUs, load 3.0: 1 idle", got
    # the real run says it (once the model is built: an error before that is the only line)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    r = runner.invoke(app, args + ["--overwrite"])
    assert r.exit_code == 0, r.output
    assert "1 intra-op thread(s) (OMP_NUM_THREADS is set; OMP_NUM_THREADS overrides)" in r.output.splitlines(), r.output


def test_run_training_sets_torchs_thread_count(monkeypatch):
    import torch

    from dlrmctl.train import worker

    before = torch.get_num_threads()
    monkeypatch.setattr(worker, "load_config", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("stop")))
    try:
        with pytest.raises(RuntimeError, match="stop"):
            worker.run_training("x.yaml", [], threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------ item 12: local fan-out
def test_local_process_limit_from_cpus_memory_and_the_override(machine, monkeypatch):
    machine(2, mem_mb=64_000)
    assert procs.local_process_limit()[0] == 8  # the suite's 2-4 gloo ranks on 2 CPUs fit
    machine(64, mem_mb=24_000)  # memory bound: 24 GB at ~300 MB each
    n, why = procs.local_process_limit()
    assert n == 80 and "GiB available memory" in why
    monkeypatch.setenv(procs.MAX_PROCS_ENV, "1000")
    assert procs.local_process_limit()[0] == 1000
    monkeypatch.setenv(procs.MAX_PROCS_ENV, "lots")
    with pytest.raises(procs.FanoutError, match="DLRMCTL_MAX_LOCAL_PROCS='lots': expected a positive integer"):
        procs.local_process_limit()


def _one_error_line(args: list[str], *needles: str) -> str:
    r = runner.invoke(app, args)
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.output
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("args, option", [
    (["train", "configs/demo.yaml", "--nproc", "1000"], "--nproc 1000"),
    (["train", "configs/demo.yaml", "--nproc", "4", "--nnodes", "3"], "--nproc 4 x --nnodes 3"),
    (["checkpoint", "reshard", "runs/none", "--nproc", "1000"], "--nproc 1000"),
    (["preprocess", "criteo", "--input", "x.tsv", "--out", "o", "--workers", "1000"], "--workers 1000"),
])
def test_local_fan_out_above_the_machine_is_refused_in_one_line(machine, args, option, tmp_path, monkeypatch):
    machine(2)
    monkeypatch.chdir(tmp_path) if args[0] == "preprocess" else None
    _one_error_line(args, option, "more than it runs (8: 4 per CPU, 2 CPUs)", "use 8 or fewer",
                    procs.MAX_PROCS_ENV)


def test_sweep_jobs_above_the_machine_are_refused(machine, tmp_path):
    machine(2)
    grid = ",".join(str(i / 100) for i in range(20))
    _one_error_line(["sweep", "configs/demo.yaml", "--grid", f"model.dropout={grid}", "--jobs", "20",
                     "--set", f"train.run_dir={tmp_path}"], "--jobs 20", "use 8 or fewer")


def test_cluster_launches_are_not_capped_by_this_machine(machine):
    machine(2)
    r = runner.invoke(app, ["launch", "configs/criteo_kaggle.yaml", "--scheduler", "slurm", "--dry-run",
                            "--nproc", "64", "--nnodes", "16"])
    assert r.exit_code == 0 and "--nproc_per_node 64" in r.output, r.output


# ------------------------------------------------------------------ item 18: counts >= 1
@pytest.mark.parametrize("args, option", [
    (["train", "configs/demo.yaml", "--nproc", "0"], "--nproc"),
    (["train", "configs/demo.yaml", "--nproc", "-1"], "--nproc"),
    (["train", "configs/demo.yaml", "--nnodes", "0"], "--nnodes"),
    (["launch", "configs/demo.yaml", "--nproc", "0", "--dry-run"], "--nproc"),
    (["launch", "configs/demo.yaml", "--nnodes", "0", "--dry-run"], "--nnodes"),
    (["sweep", "configs/demo.yaml", "--grid", "model.dropout=0,0.1", "--jobs", "0"], "--jobs"),
    (["preprocess", "criteo", "--input", "x.tsv", "--out", "o", "--workers", "0"], "--workers"),
    (["preprocess", "criteo", "--input", "x.tsv", "--out", "o", "--workers", "-1"], "--workers"),
    (["checkpoint", "reshard", "runs/none", "--nproc", "0"], "--nproc"),
])
def test_a_count_below_one_is_one_error_line(args, option):
    line = _one_error_line(args, f"'{option}'", "greater than or equal to 1", "--help")
    assert "Usage" not in line


def test_other_usage_errors_are_one_line_too():
    _one_error_line(["train", "configs/demo.yaml", "--nproc", "abc"], "'--nproc'", "valid integer")
    _one_error_line(["train"], "Missing argument")
    _one_error_line(["no-such-verb"], "No such command")
    r = runner.invoke(app, ["preprocess"])  # no arguments: the group's help, as before
    assert "criteo" in r.output
