"""torchx launch: the AppDef of `train --nproc --dry-run`, cluster job specs, pre-launch checks and
how a launched job reports a failing rank."""

import os
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from dlrmctl.cli import app
from dlrmctl.data.checksums import record_checksums
from dlrmctl.launch import build_appdef

from tests import conftest

runner = CliRunner()
REPO = str(conftest.REPO)


def test_local_appdef_runs_torchrun_through_this_interpreter_with_the_worker_module_and_overrides():
    a = build_appdef("configs/demo.yaml", ["train.seed=3"], nproc=4, nnodes=2, resume=True)
    (role,) = a.roles
    assert role.entrypoint == sys.executable and role.args[:2] == ["-m", "torch.distributed.run"]
    cmd = " ".join(role.args)
    assert "torchrun" not in cmd and "--nnodes 2" in cmd and "--nproc_per_node 4" in cmd
    assert "--redirects 3 --tee 0:3" in cmd and "--rdzv_endpoint localhost:29500" in cmd
    assert cmd.endswith("-m dlrmctl.train.worker configs/demo.yaml --set train.seed=3 --resume")
    assert role.num_replicas == 2 and role.resource.cpu == 4


def test_slurm_appdef_runs_this_interpreter_and_containers_keep_torchrun_from_the_image():
    (role,) = build_appdef("configs/demo.yaml", [], nproc=8, nnodes=2, scheduler="slurm").roles
    assert role.entrypoint == "bash" and role.args[1].startswith(f"{sys.executable} -m torch.distributed.run ")
    assert "$${${rank0_env}:=localhost}:29500" in role.args[1]  # the first node's name, expanded by bash there
    assert "--nproc_per_node 8" in role.args[1] and "-m dlrmctl.train.worker configs/demo.yaml" in role.args[1]
    (role,) = build_appdef("configs/demo.yaml", [], nproc=8, nnodes=2, scheduler="kubernetes", image="i").roles
    assert role.entrypoint == "bash" and role.args[1].startswith("torchrun ")


def test_ranks_get_their_openmp_threads_deliberately(monkeypatch):
    """OMP_NUM_THREADS is set for every rank (so torchrun prints no banner about it): this machine's
    CPUs over the local ranks, the CPUs asked per process on a cluster, or the user's own value."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # an idle machine
    monkeypatch.setattr("dlrmctl.procs._cgroup_cpu_quota", lambda: None)
    (role,) = build_appdef("configs/demo.yaml", [], nproc=4).roles
    assert role.env["OMP_NUM_THREADS"] == "2"
    (role,) = build_appdef("configs/demo.yaml", [], nproc=16).roles
    assert role.env["OMP_NUM_THREADS"] == "1"
    (role,) = build_appdef("configs/demo.yaml", [], nproc=8, scheduler="slurm", cpu_per_proc=6).roles
    assert role.env["OMP_NUM_THREADS"] == "6"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    (role,) = build_appdef("configs/demo.yaml", [], nproc=4).roles
    assert role.env["OMP_NUM_THREADS"] == "3"


def test_cluster_launch_asks_one_gpu_per_process_unless_the_config_trains_on_cpu():
    args = ["launch", "configs/criteo_kaggle.yaml", "--scheduler", "slurm", "--dry-run", "--nproc", "8"]
    r = runner.invoke(app, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "GPUs per process: 1 (train.device is auto in configs/criteo_kaggle.yaml" in r.output
    assert "--gpus-per-task=8" in r.output
    r = runner.invoke(app, args + ["--set", "train.device=cuda"], catch_exceptions=False)
    assert "GPUs per process: 1 (train.device is cuda" in r.output and "--gpus-per-task=8" in r.output
    r = runner.invoke(app, args + ["--set", "train.device=cpu"], catch_exceptions=False)
    assert "GPUs per process: 0 (train.device is cpu" in r.output and "--gpus-per-task" not in r.output
    r = runner.invoke(app, args + ["--gpus-per-proc", "2"], catch_exceptions=False)
    assert "GPUs per process" not in r.output and "--gpus-per-task=16" in r.output


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


@pytest.fixture
def small_data(tmp_path):
    from dlrmctl.data.synthetic import generate_synthetic

    generate_synthetic(tmp_path / "data", rows=3000, seed=0, num_embeddings=[50] * 26)
    return tmp_path / "data"


def _no_launch(*a, **k):
    raise AssertionError("a failed pre-launch check must not start the job")


@pytest.mark.parametrize("case", ["run_dir_in_use", "no_data"])
def test_pre_launch_checks_fail_with_one_line_before_any_process_starts(case, small_data, tmp_path, monkeypatch):
    import dlrmctl.launch

    monkeypatch.setattr(dlrmctl.launch, "launch", _no_launch)
    run_dir = tmp_path / "runs" / "demo"
    data = small_data
    if case == "run_dir_in_use":
        (run_dir / "checkpoints").mkdir(parents=True)
    else:
        data = tmp_path / "nodata"
    t0 = time.monotonic()
    r = runner.invoke(app, ["train", "configs/demo.yaml", "--nproc", "2", "--set", f"data.path={data}",
                            "--set", f"train.run_dir={tmp_path / 'runs'}"])
    assert r.exit_code == 2, r.output
    (line,) = r.output.strip().splitlines()
    expected = f"{run_dir} already holds a run" if case == "run_dir_in_use" else "has no meta.json"
    assert line.startswith("error: ") and expected in line
    assert not (run_dir / "logs").exists() and time.monotonic() - t0 < 10
    assert (case == "run_dir_in_use") == run_dir.exists()


def _train(data, runs, *extra, timeout=180):
    """``dlrmctl train configs/demo.yaml --nproc 2`` in a subprocess whose PATH has no torchrun."""
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), "PYTHONPATH": REPO}
    cmd = [sys.executable, "-m", "dlrmctl.cli", "train", "configs/demo.yaml", "--nproc", "2",
           "--set", f"data.path={data}", "--set", f"train.run_dir={runs}", "--set", "data.batch_size=1024",
           "--set", "data.shuffle=false", "--set", "train.max_steps=2", *extra]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_rank_run_without_torchrun_on_path_echoes_rank_0_and_keeps_every_rank_log(small_data, tmp_path):
    r = _train(small_data, tmp_path / "runs")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "val: AUC" in r.stdout and "run directory" in r.stdout
    assert "[0]:" not in r.stdout + r.stderr and "OMP_NUM_THREADS" not in r.stderr  # no torchrun noise
    # the threads per rank are said once, and the applied plan is shown per rank before training
    assert r.stdout.count("OpenMP thread(s) per rank") == 1
    assert "sharding plan from the planner" in r.stdout and "  rank 1: " in r.stdout
    logs_text = "".join(p.read_text() for p in (tmp_path / "runs" / "demo" / "logs").rglob("*.log"))
    assert "Setting OMP_NUM_THREADS" not in logs_text
    logs = tmp_path / "runs" / "demo" / "logs"
    assert {p.parent.name for p in logs.rglob("stderr.log") if p.parent.parent.name == "attempt_0"} == {"0", "1"}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_failing_rank_is_reported_in_one_line_naming_it_and_its_log(small_data, tmp_path):
    """Rank 1 alone reads a corrupt id (row 700 of the first 1024-row global batch); rank 0 then
    loses its peer.  The user sees one line about rank 1; every rank's log is kept."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    (shard,) = small_data.glob("parts/*/train.arrow")
    t = ipc.open_file(pa.memory_map(str(shard))).read_all()
    ids = t.column("C1").to_numpy().copy()
    ids[700] = 10**6
    t = t.set_column(t.schema.get_field_index("C1"), t.schema.field("C1"), pa.array(ids))
    with pa.OSFile(str(shard) + ".tmp", "wb") as sink, ipc.new_file(sink, t.schema) as w:
        w.write_table(t)
    os.replace(str(shard) + ".tmp", shard)
    record_checksums(small_data)  # a planted id, not damage: meta.json records the new bytes

    r = _train(small_data, tmp_path / "runs")
    assert r.returncode == 1
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(("error: rank 1 failed: ", "error: rank 1: ")) and "1000000" in line, line
    assert "runs/demo/logs/" in line and line.endswith("/1/stderr.log)")
    # launch, plan (3 lines), model size; and the oneDNN line where train.cpu_linear auto picks it
    # (an AMD CPU, DLRMCTL_CPU_LINEAR=onednn): the count must not depend on the machine
    out = [x for x in r.stdout.strip().splitlines() if not x.startswith("the MLPs train on oneDNN's fp32 GEMM")]
    assert len(out) < 6, r.stdout
    logs = tmp_path / "runs" / "demo" / "logs"
    rank_logs = {p.parent.name: p.read_text() for p in logs.rglob("stderr.log") if p.parent.parent.name == "attempt_0"}
    assert set(rank_logs) == {"0", "1"} and "1000000" in rank_logs["1"]
    # issue 14 item 11: the run failed before any checkpoint, so nothing of it blocks or mixes into a
    # retry: the run's files are gone, its logs (named in the error line) stay
    run = tmp_path / "runs" / "demo"
    assert sorted(p.name for p in run.iterdir()) == ["logs"]
    from dlrmctl.config import load_config
    from dlrmctl.train.run_dir import check_run_dir

    cfg = load_config("configs/demo.yaml", [f"data.path={small_data}", f"train.run_dir={tmp_path / 'runs'}"])
    assert check_run_dir(cfg, resume=False, overwrite=False) == str(run)


def test_first_failure_names_the_earliest_rank_that_did_not_just_lose_a_peer(tmp_path, monkeypatch):
    from dlrmctl.launch import first_failure, record_rank_failure

    def fail(rank, error, user_error=False):
        d = tmp_path / "torchelastic" / "worker" / "run_x" / "attempt_0" / str(rank)
        d.mkdir(parents=True)
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(d / "error.json"))
        monkeypatch.setenv("RANK", str(rank))
        try:
            raise error
        except Exception as e:
            record_rank_failure(e, user_error)

    fail(0, RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:3504"))
    fail(2, ValueError("bad shard\nsecond line"))
    fail(1, ValueError("later"))
    what, log = first_failure(str(tmp_path), "worker")
    assert what == "rank 2 failed: ValueError: bad shard" and log.endswith("attempt_0/2/stderr.log")
    fail(3, FileNotFoundError("no such file: x"), user_error=True)
    (tmp_path / "torchelastic" / "worker" / "run_x" / "attempt_0" / "2" / "error.json").unlink()
    (tmp_path / "torchelastic" / "worker" / "run_x" / "attempt_0" / "1" / "error.json").unlink()
    assert first_failure(str(tmp_path), "worker")[0] == "rank 3: no such file: x"


def test_first_failure_falls_back_to_torchruns_root_cause_for_a_killed_rank(tmp_path):
    from dlrmctl.launch import first_failure

    (tmp_path / "worker" / "0").mkdir(parents=True)
    (tmp_path / "worker" / "0" / "stderr.log").write_text(
        "Failures:\n[1]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : -15 (pid: 7)  (SIGTERM)\n"
        "Root Cause (first observed failure):\n[0]:\n  time      : 2026-01-01_00:00:00\n"
        "  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 8)  (SIGKILL)\n  error_file: <N/A>\n")
    assert first_failure(str(tmp_path), "worker") == ("rank 1 failed: killed by SIGKILL", None)
    assert first_failure(str(tmp_path / "nothing"), "worker") is None


def _gone(marker, timeout_s: float = 60.0) -> list[int]:
    """:func:`_pids_running` after waiting up to ``timeout_s`` for it to be empty (a SIGKILLed rank
    leaves /proc once the kernel has run its exit: not at once on a loaded machine)."""
    deadline = time.monotonic() + timeout_s
    while _pids_running(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _pids_running(marker)


def _pids_running(marker):
    """Pids of live (non-zombie) processes whose command line contains ``marker``."""
    out = []
    for e in os.listdir("/proc"):
        if not e.isdigit() or int(e) == os.getpid():
            continue
        try:
            cmd = open(f"/proc/{e}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            stat = open(f"/proc/{e}/stat").read()
        except OSError:
            continue
        if marker in cmd and stat[stat.rindex(")") + 2] != "Z":
            out.append(int(e))
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_cancels_the_job_every_rank_ends_and_a_second_train_is_refused_meanwhile(sig, small_data, tmp_path):
    """Issue 14b: the first SIGTERM / SIGINT to `train --nproc 2` cancels the job: one error line,
    exit 128 + signal, no rank or torchrun left running, the failed attempt cleaned up.  While it
    runs, a second `train` of the same run directory is refused (the launcher holds the lock)."""
    import signal

    name = f"sig{os.getpid()}x{sig.lower()}"
    runs = tmp_path / "runs"
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), "PYTHONPATH": REPO}
    base = ["configs/demo.yaml", "--set", f"data.path={small_data}", "--set", f"train.run_dir={runs}",
            "--set", f"name={name}", "--set", "data.batch_size=2", "--set", "train.epochs=50",
            "--set", "train.log_every=1"]
    p = subprocess.Popen([sys.executable, "-m", "dlrmctl.cli", "train", *base, "--nproc", "2"], cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        metrics = runs / name / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.exists() and '"train"' in metrics.read_text()):
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.2)
        assert len(_pids_running(name)) >= 3  # launcher, torchrun, 2 ranks
        # a second run of the same directory, even with --overwrite, is refused and touches nothing
        before = sorted(p_.name for p_ in (runs / name).iterdir())
        r = runner.invoke(app, ["train", *base, "--overwrite"])
        assert r.exit_code == 2, r.output
        assert r.output.strip() == (f"error: {runs / name} is in use by a running dlrmctl (pid {p.pid}); "
                                    "wait for it or --set name=<other>")
        assert metrics.exists() and sorted(p_.name for p_ in (runs / name).iterdir()) == before

        t0 = time.monotonic()
        p.send_signal(getattr(signal, sig))
        # the cancel takes at most about 20 s (torchx's SIGTERM, its SIGKILL 10 s later, then any process
        # left); the bound leaves room for a loaded machine and still fails a launcher that hangs
        out, err = p.communicate(timeout=120)
        assert time.monotonic() - t0 < 90
        assert p.returncode == 128 + getattr(signal, sig), out + err
        assert err.strip().splitlines()[-1] == f"error: interrupted ({sig}): the job was cancelled; logs in {runs / name / 'logs'}", err
        assert "Traceback" not in err and "SignalException" not in err
        assert _gone(name) == []
        left = sorted(p_.name for p_ in (runs / name).iterdir())
        assert ".lock" not in left
        if "checkpoints" not in left:  # failed before its first checkpoint: cleaned up like any failed run
            assert left == ["logs"]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        for pid in _pids_running(name):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("scheduler", ["kubernetes", "aws_batch", "local_docker"])
def test_a_container_scheduler_without_image_is_one_error_line(scheduler):
    """Issue 23: torchx's default image has no dlrmctl, so a container scheduler needs --image: without it
    `launch` refuses (even --dry-run) in one line naming the scheduler and the remedy; slurm needs none."""
    r = runner.invoke(app, ["launch", "configs/criteo_kaggle.yaml", "--scheduler", scheduler, "--dry-run", "--nproc", "8"])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot launch on {scheduler}: --scheduler {scheduler} "), r.output
    assert "--image IMAGE" in lines[0] and "no dlrmctl" in lines[0], lines[0]
    with pytest.raises(ValueError, match="--image IMAGE"):
        build_appdef("configs/demo.yaml", [], nproc=2, scheduler=scheduler)
    assert build_appdef("configs/demo.yaml", [], nproc=2, scheduler=scheduler, image="reg/dlrmctl:1").roles[0].image \
        == "reg/dlrmctl:1"
    assert build_appdef("configs/demo.yaml", [], nproc=2, scheduler="slurm").roles


def _rank_pid(marker: str, rank: int) -> int | None:
    """Pid of the live training rank ``rank`` (its ``RANK`` in /proc/<pid>/environ) of the job ``marker``."""
    for pid in _pids_running(marker):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if b"dlrmctl.train.worker" in cmd and f"RANK={rank}".encode() in env:
            return pid
    return None


def test_first_failure_prefers_a_rank_killed_without_a_record_to_a_peer_that_lost_it(tmp_path, monkeypatch):
    from dlrmctl.launch import first_failure, record_rank_failure

    d = tmp_path / "torchelastic" / "worker" / "run_x" / "attempt_0" / "0"
    d.mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(d / "error.json"))
    monkeypatch.setenv("RANK", "0")
    try:
        raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:1234: Connection reset by peer")
    except RuntimeError as e:
        record_rank_failure(e, False)
    (tmp_path / "worker" / "0").mkdir(parents=True)
    (tmp_path / "worker" / "0" / "stderr.log").write_text(  # torchrun saw rank 0's record first
        "Failures:\n[1]:\n  time      : 2026-01-01_00:00:02\n  host      : h\n  rank      : 1 (local_rank: 1)\n"
        "  exitcode  : -9 (pid: 8)\n  error_file: <N/A>\n  traceback : Signal 9 (SIGKILL) received by PID 8\n"
        "Root Cause (first observed failure):\n[0]:\n  time      : 2026-01-01_00:00:01\n  host      : h\n"
        "  rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 7)\n  error_file: /x/error.json\n")
    (tmp_path / "torchelastic" / "worker" / "run_x" / "attempt_0" / "1").mkdir()
    (tmp_path / "torchelastic" / "worker" / "run_x" / "attempt_0" / "1" / "stderr.log").write_text("")
    what, log = first_failure(str(tmp_path), "worker")
    assert what == "rank 1 failed: killed by SIGKILL" and log.endswith("attempt_0/1/stderr.log")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_rank_killed_while_checkpointing_is_the_one_reported(small_data, tmp_path):
    """Issue 23 item 16: rank 1 SIGKILLed while the ranks train and write a checkpoint every step;
    rank 0 then fails on the lost connection.  The one error line names rank 1 and the signal."""
    import signal

    name = f"kill{os.getpid()}"
    runs = tmp_path / "runs"
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), "PYTHONPATH": REPO}
    cmd = [sys.executable, "-m", "dlrmctl.cli", "train", "configs/demo.yaml", "--nproc", "2",
           "--set", f"data.path={small_data}", "--set", f"train.run_dir={runs}", "--set", f"name={name}",
           "--set", "data.batch_size=2", "--set", "train.epochs=50", "--set", "train.checkpoint_every=1",
           "--set", "train.log_every=1"]
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        ckpts = runs / name / "checkpoints"
        deadline = time.monotonic() + 120
        while not (ckpts.is_dir() and len(list(ckpts.iterdir())) >= 2):
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.1)
        pid = _rank_pid(name, 1)
        assert pid is not None, _pids_running(name)
        os.kill(pid, signal.SIGKILL)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 1, out + err
        line = err.strip().splitlines()[-1]
        assert line.startswith("error: rank 1 failed: killed by SIGKILL"), err
        assert _gone(name) == []
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
