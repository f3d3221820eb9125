"""A real Slurm: `dlrmctl launch --scheduler slurm` and `dlrmctl jobs` against a private
single-node cluster on localhost (tests/helpers/slurm_cluster.py).  Skipped, with the reason,
where slurmctld / slurmd / munged are not installed (one-time: apt-get install -y slurm-wlm munge)."""

import os

import pytest

from tests.helpers import slurm_cluster

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

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (out.exists() and "hello" in out.read_text()):
        time.sleep(0.5)
    assert out.read_text().strip() == f"hello from {job}", cluster.logs()
    assert os.environ.get("SLURM_CONF") != cluster.conf  # the tests' own environment is untouched
