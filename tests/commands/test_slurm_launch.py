"""`launch --scheduler slurm` and `jobs` against stand-in Slurm clients (scripts on PATH): what the
generated job asks for, sbatch refusals and an unreachable controller as one line, status without
accounting storage.  The real cluster is tests/commands/test_slurm.py."""

import os
import stat
import sys

import pytest
from typer.testing import CliRunner

from dlrmctl.cli import app

runner = CliRunner()


def _fake(bin_dir, name, body):
    p = bin_dir / name
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """A PATH whose sinfo knows no cluster and whose other Slurm clients the test writes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake(bin_dir, "sinfo", "exit 1")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    return bin_dir


def test_a_cpu_dry_run_asks_no_gpus_no_memory_and_runs_this_interpreter():
    r = runner.invoke(app, ["launch", "configs/demo.yaml", "--scheduler", "slurm", "--nproc", "2", "--set",
                            "train.device=cpu", "--dry-run"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    sbatch = [ln for ln in r.output.splitlines() if ln.startswith("#SBATCH --job-name")]
    assert sbatch and "--gpus" not in sbatch[0] and "--mem" not in sbatch[0] and "--cpus-per-task=2" in sbatch[0]
    srun = next(ln for ln in r.output.splitlines() if ln.startswith("srun "))
    assert f"{sys.executable} -m torch.distributed.run" in srun and "torchrun" not in srun
    assert "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE=[${rank}]:" in srun  # global ranks in the node's log


def test_mem_and_cpus_per_proc_are_asked_per_process():
    r = runner.invoke(app, ["launch", "configs/demo.yaml", "--scheduler", "slurm", "--nproc", "2", "--set",
                            "train.device=cpu", "--mem", "3G", "--cpus-per-proc", "4", "--scheduler-arg",
                            "partition=cpu", "--dry-run"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.output.splitlines() if ln.startswith("#SBATCH --job-name"))
    assert "--mem=6144" in line and "--cpus-per-task=8" in line and "--partition=cpu" in line
    assert "OMP_NUM_THREADS=4" in r.output


@pytest.mark.parametrize("mem", ["lots", "0", "-5G"])
def test_a_bad_mem_is_one_error_line(mem):
    r = runner.invoke(app, ["launch", "configs/demo.yaml", "--scheduler", "slurm", "--mem", mem, "--dry-run"])
    assert r.exit_code == 2 and r.output.startswith("error: --mem") and len(r.output.strip().splitlines()) == 1


@pytest.mark.parametrize("message, remedy", [
    ("sbatch: error: Memory specification can not be satisfied", "--mem"),
    ("sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)",
     "scontrol ping"),
    ("sbatch: error: invalid partition specified: gpu", "partition=NAME"),
])
def test_an_sbatch_refusal_is_one_line_with_slurms_message_and_the_remedy(fake_slurm, message, remedy):
    _fake(fake_slurm, "sbatch", f"echo '{message}' >&2; exit 1")
    r = runner.invoke(app, ["launch", "configs/demo.yaml", "--scheduler", "slurm", "--nproc", "2",
                            "--gpus-per-proc", "0"])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if not ln.startswith("GPUs per process")]
    assert len(lines) == 1 and lines[0].startswith("error: sbatch refused the job: sbatch: "), r.output
    assert message.split("error: ")[-1] in lines[0] and remedy in lines[0] and "Traceback" not in r.output


def test_without_sbatch_the_launch_is_one_line(fake_slurm, monkeypatch):
    monkeypatch.setenv("PATH", str(fake_slurm))
    r = runner.invoke(app, ["launch", "configs/demo.yaml", "--scheduler", "slurm", "--gpus-per-proc", "0"])
    assert r.exit_code == 2 and "`sbatch` is not on PATH" in r.output and "Traceback" not in r.output


def test_status_without_accounting_falls_back_to_scontrol_and_sacct_says_nothing(fake_slurm):
    _fake(fake_slurm, "sacct", "echo 'Slurm accounting storage is disabled' >&2; exit 1")
    _fake(fake_slurm, "scontrol", 'echo "JobId=7 JobName=worker-0 UserId=root(0) JobState=RUNNING Reason=None '
                                  'BatchHost=n1"')
    r = runner.invoke(app, ["jobs", "status", "slurm://dlrmctl/7"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert r.output == "slurm://dlrmctl/7: RUNNING (1 node(s))\n"  # and no sacct message leaked
    _fake(fake_slurm, "scontrol", 'echo "JobId=7 JobName=worker-0 JobState=FAILED Reason=NonZeroExitCode"')
    r = runner.invoke(app, ["jobs", "status", "7"], catch_exceptions=False)
    assert r.output == "slurm://dlrmctl/7: FAILED (scheduler: FAILED (NonZeroExitCode); 1 node(s))\n"


def test_status_of_an_unknown_job_and_an_unreachable_controller_are_one_line(fake_slurm):
    _fake(fake_slurm, "sacct", "exit 1")
    _fake(fake_slurm, "scontrol", "echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1")
    r = runner.invoke(app, ["jobs", "status", "slurm://dlrmctl/8"])
    assert r.exit_code == 2 and r.output.startswith("error: job slurm://dlrmctl/8 is not known to the scheduler")
    _fake(fake_slurm, "scontrol", "echo 'slurm_load_jobs error: Unable to contact slurm controller (connect "
                                  "failure)' >&2; exit 1")
    for verb in ("status", "cancel", "logs"):
        r = runner.invoke(app, ["jobs", verb, "8"])
        assert r.exit_code == 2, r.output
        assert len(r.output.strip().splitlines()) == 1 and "Unable to contact slurm controller" in r.output
        assert "scontrol ping" in r.output


def test_a_malformed_handle_is_one_line():
    r = runner.invoke(app, ["jobs", "logs", "slurm-42"])
    assert r.exit_code == 2 and r.output.startswith("error: job handle 'slurm-42': expected SCHEDULER://SESSION/ID")


def test_a_missing_scheduler_extra_is_one_line(monkeypatch):
    import dlrmctl.launch

    def no_client(*a, **k):
        raise ModuleNotFoundError("No module named 'kubernetes'")

    monkeypatch.setattr(dlrmctl.launch, "launch", no_client)
    r = runner.invoke(app, ["launch", "configs/demo.yaml", "--scheduler", "kubernetes", "--image", "i",
                            "--gpus-per-proc", "0"])
    assert r.exit_code == 2 and "pip install 'dlrmctl[cluster]'" in r.output and "kubernetes" in r.output
    assert len([ln for ln in r.output.splitlines() if ln.startswith("error:")]) == 1


def test_a_cancel_slurm_refuses_names_no_request_options(fake_slurm):
    """`jobs cancel` and a controller Slurm cannot reach: the remedy named --mem / --cpus-per-proc."""
    _fake(fake_slurm, "sacct", "exit 1")
    _fake(fake_slurm, "scontrol", 'echo "JobId=9 JobName=worker-0 JobState=RUNNING Reason=None"')
    _fake(fake_slurm, "scancel", "echo 'scancel: error: Kill job error on job id 9: Access/permission denied' >&2; "
                                 "exit 1")
    r = runner.invoke(app, ["jobs", "cancel", "9"])
    assert r.exit_code == 2 and "Access/permission denied" in r.output, r.output
    assert "--mem" not in r.output and "squeue" in r.output
    _fake(fake_slurm, "scontrol", "echo 'scontrol: error: Could not establish a configuration source' >&2; exit 1")
    r = runner.invoke(app, ["jobs", "status", "9"])
    assert r.exit_code == 2 and "--mem" not in r.output and "login node" in r.output, r.output


@pytest.mark.skipif(any(os.path.exists(os.path.join(d, "bjobs")) for d in os.environ["PATH"].split(os.pathsep)),
                    reason="this machine has LSF's client")
def test_a_scheduler_whose_client_is_not_installed_is_one_line_naming_it(fake_slurm):
    r = runner.invoke(app, ["launch", "configs/demo.yaml", "--scheduler", "lsf", "--gpus-per-proc", "0"])
    assert r.exit_code == 2 and "`bhosts` is not installed here" in r.output and "Traceback" not in r.output
    for verb in ("status", "cancel"):
        r = runner.invoke(app, ["jobs", verb, "lsf://dlrmctl/3"])
        assert r.exit_code == 2 and "`bjobs` is not installed here" in r.output, r.output
