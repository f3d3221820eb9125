"""A real Slurm: `dlrmctl launch --scheduler slurm` and `dlrmctl jobs` against a private
single-node cluster on localhost (tests/helpers/slurm_cluster.py).  Skipped, with the reason,
where slurmctld / slurmd / munged are not installed (one-time: apt-get install -y slurm-wlm munge)."""

import os

import pytest

from tests.helpers import slurm_cluster
from tests import conftest

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = slurm_cluster.missing()
    if why:
        pytest.skip(why)
    cl = slurm_cluster.start_cluster(str(tmp_path_factory.mktemp("slurm")), real_memory_mb=4000)
    try:
        yield cl
    finally:
        cl.stop()
        assert all(p.poll() is not None for p in cl.procs)


def test_the_private_cluster_runs_a_batch_job(cluster, tmp_path):
    r = cluster.run("sbatch", "--parsable", f"--chdir={tmp_path}", "--wrap", "echo hello from $SLURM_JOB_ID")
    job = r.stdout.strip()
    out = tmp_path / f"slurm-{job}.out"
    import time

    deadline = time.monotonic() + 120  # the controller schedules it on its next pass: slow on a loaded machine
    while time.monotonic() < deadline and not (out.exists() and "hello" in out.read_text()):
        time.sleep(0.5)
    assert out.read_text().strip() == f"hello from {job}", cluster.logs()
    assert os.environ.get("SLURM_CONF") != cluster.conf  # the tests' own environment is untouched


REPO = str(conftest.REPO)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The submit directory (Slurm writes the logs there) with a small synthetic demo dataset."""
    from dlrmctl.data.synthetic import generate_synthetic

    d = tmp_path_factory.mktemp("submit")
    generate_synthetic(d / "data", rows=3000, seed=0, num_embeddings=[50] * 26)
    return d


def _dlrmctl(cluster, work, *args, timeout=150):  # a CLI start (torchx) takes tens of seconds under load
    import subprocess
    import sys

    env = dict(cluster.env, PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-m", "dlrmctl.cli", *args], cwd=work, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _launch_args(work, run_dir, *extra):
    return ["launch", os.path.join(REPO, "configs", "demo.yaml"), "--scheduler", "slurm", "--nproc", "2",
            "--set", f"data.path={work / 'data'}", "--set", f"train.run_dir={work / run_dir}",
            "--set", "train.device=cpu", *extra]


def test_launch_trains_the_demo_on_two_ranks_through_sbatch_and_srun(cluster, work):
    """On a cluster without accounting storage (sacct fails): --wait streams rank 0 and ends 0."""
    import json

    r = _dlrmctl(cluster, work, *_launch_args(work, "runs", "--wait"))
    assert r.returncode == 0, r.stdout + r.stderr + cluster.logs()
    handle = r.stdout.splitlines()[0]
    assert handle.startswith("slurm://dlrmctl/") and "Traceback" not in r.stderr
    assert "GPUs per process: 0" in r.stderr
    assert "on 2 rank(s)" in r.stdout and "val: AUC" in r.stdout and "[0]:" not in r.stdout
    run = work / "runs" / "demo"
    assert (run / "checkpoints").is_dir() and (run / "summary.json").is_file()
    metrics = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    assert any("auc" in json.dumps(m).lower() for m in metrics)

    s = _dlrmctl(cluster, work, "jobs", "status", handle)
    assert s.returncode == 0 and s.stdout.startswith(f"{handle}: SUCCEEDED"), s.stdout + s.stderr
    lg = _dlrmctl(cluster, work, "jobs", "logs", handle)
    assert lg.returncode == 0 and "val: AUC" in lg.stdout and "[0]:" not in lg.stdout, lg.stderr
    elsewhere = _dlrmctl(cluster, work / "data", "jobs", "logs", handle)
    assert elsewhere.returncode == 2 and elsewhere.stderr.startswith("error: no log of job")


def test_an_oversized_mem_is_refused_by_sbatch_in_one_line(cluster, work):
    r = _dlrmctl(cluster, work, *_launch_args(work, "runs_mem", "--mem", "8000"))
    assert r.returncode == 2, r.stdout + r.stderr
    err = [ln for ln in r.stderr.splitlines() if not ln.startswith("GPUs per process")]
    assert len(err) == 1 and err[0].startswith("error: sbatch refused the job: sbatch: ") and "--mem" in err[0], err
    assert not (work / "runs_mem").exists()


def test_a_failing_job_under_wait_is_one_line_naming_the_rank_and_its_error(cluster, work):
    r = _dlrmctl(cluster, work, *_launch_args(work, "runs_fail", "--wait", "--set", f"data.path={work / 'nodata'}"))
    assert r.returncode == 1, r.stdout + r.stderr
    err = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("GPUs per process")]
    assert len(err) == 1 and err[0].startswith("error: training job slurm://dlrmctl/"), err
    assert "ended FAILED (NonZeroExitCode): rank " in err[0] and "has no meta.json" in err[0], err


def test_a_job_cancelled_mid_run_ends_cancelled_and_its_waiting_launch_exits_cleanly(cluster, work):
    import subprocess
    import sys
    import time

    env = dict(cluster.env, PYTHONPATH=REPO)
    waiting = subprocess.Popen([sys.executable, "-m", "dlrmctl.cli",
                                *_launch_args(work, "runs_long", "--set", "train.epochs=100000", "--wait")],
                               cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        handle = waiting.stdout.readline().strip()
        assert handle.startswith("slurm://dlrmctl/"), waiting.stderr.read() if waiting.poll() is not None else handle
        deadline = time.monotonic() + 240  # scheduled, torch imported, the data read: minutes on a loaded machine
        while time.monotonic() < deadline:  # mid-run: training has started
            s = _dlrmctl(cluster, work, "jobs", "status", handle)
            if "RUNNING" in s.stdout and "epoch 1/" in _dlrmctl(cluster, work, "jobs", "logs", handle).stdout:
                break
            time.sleep(1)
        else:
            pytest.fail(f"the job did not start training: {s.stdout}{s.stderr}\n{cluster.logs()}")
        c = _dlrmctl(cluster, work, "jobs", "cancel", handle)
        assert c.returncode == 0 and c.stdout.strip() == f"{handle}: cancelled (CANCELLED)", c.stdout + c.stderr
        s = _dlrmctl(cluster, work, "jobs", "status", handle)
        assert s.stdout.startswith(f"{handle}: CANCELLED"), s.stdout + s.stderr
        out, err = waiting.communicate(timeout=150)
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.wait()
    assert waiting.returncode == 1, out + err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert lines == [ln for ln in err.splitlines() if not ln.startswith("GPUs per process")]
    assert len(lines) == 1 and f"training job {handle} was cancelled" in lines[0] and "Traceback" not in err
    assert "squeue" not in err and "sacct" not in err
