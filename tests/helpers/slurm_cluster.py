"""A private single-node Slurm cluster on localhost, for the tests that submit real jobs.

:func:`start_cluster` starts ``munged`` (its own key and socket), ``slurmctld`` and ``slurmd``
(as root: slurmd launches the tasks) from a ``slurm.conf`` written into a temp directory, with
their state, spool, pid and log files there and free ports on 127.0.0.1; the client commands
(sbatch, squeue, scontrol, scancel, sinfo) find it through ``SLURM_CONF``.  Nothing is installed:
:func:`missing` says what is absent (the caller skips with that reason).  :meth:`Cluster.stop`
ends every daemon it started (SIGTERM, then SIGKILL), so no daemon outlives the test.

One-time install (Debian, as root): ``apt-get install -y slurm-wlm munge``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo")


def _which(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.access(p, os.X_OK)),
                                      None)


def missing() -> str | None:
    """Why no private cluster can be started here (a program absent, not root), or None."""
    absent = [n for n in DAEMONS + CLIENTS if _which(n) is None]
    if absent:
        return (f"Slurm/munge not installed ({', '.join(absent)} absent); one-time install: "
                "apt-get install -y slurm-wlm munge")
    if os.geteuid() != 0:
        return "slurmd must run as root to launch tasks; run the real-Slurm tests as root"
    return None


def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@dataclass
class Cluster:
    """A running private cluster: ``env`` is the environment its client commands need (``SLURM_CONF``)."""

    root: str
    conf: str
    env: dict[str, str]
    node: str
    procs: list[subprocess.Popen] = field(default_factory=list)

    def run(self, *argv: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        """Run a client command against this cluster (text output)."""
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout,
                              check=check)

    def logs(self) -> str:
        """The tail of every daemon log (for a failing test's message)."""
        out = []
        for name in ("munged.log", "slurmctld.log", "slurmd.log"):
            p = os.path.join(self.root, name)
            if os.path.exists(p):
                with open(p, errors="replace") as f:
                    out.append(f"--- {name}\n" + "".join(f.readlines()[-30:]))
        return "\n".join(out)

    def stop(self) -> None:
        """Cancel every job still on the cluster (and wait up to 20 s for them to end), end every
        daemon this cluster started (SIGTERM, SIGKILL after 10 s), newest first, then kill any job
        process left (those whose environment names this cluster's ``SLURM_CONF``)."""
        if self.procs and all(p.poll() is None for p in self.procs):
            try:
                jobs = self.run("squeue", "-h", "-o", "%A", check=False, timeout=10).stdout.split()
                if jobs:
                    self.run("scancel", *jobs, check=False, timeout=10)
                deadline = time.monotonic() + 20
                while jobs and time.monotonic() < deadline:
                    time.sleep(0.5)
                    jobs = self.run("squeue", "-h", "-o", "%A", check=False, timeout=10).stdout.split()
            except (subprocess.SubprocessError, OSError):
                pass
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in reversed(self.procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        self.procs.clear()
        self._kill_leftovers()

    def _kill_leftovers(self) -> None:
        """SIGKILL every process whose environment has this cluster's ``SLURM_CONF`` (slurmstepd and
        the job's tasks inherit it from slurmd), except this one."""
        marker = f"SLURM_CONF={self.conf}".encode()
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if marker in f.read().split(b"\0"):
                        os.kill(int(entry), signal.SIGKILL)
            except OSError:
                continue


def write_conf(root: str, node: str, ports: list[int], real_memory_mb: int, munge_socket: str) -> str:
    """``slurm.conf`` of a one-node cluster of 2 CPUs on 127.0.0.1 with everything under ``root``; its path."""
    lines = [
        "ClusterName=dlrmctltest",
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={ports[0]}",
        f"SlurmdPort={ports[1]}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket}",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmctldLogFile={root}/slurmctld.log",
        f"SlurmdLogFile={root}/slurmd.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "LaunchType=launch/slurm",
        "ReturnToService=2",
        "SchedulerType=sched/backfill",
        "MinJobAge=600",
        "KillWait=5",
        "InactiveLimit=0",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=30",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none",
        f"NodeName={node} NodeAddr=127.0.0.1 NodeHostname={node} CPUs=2 RealMemory={real_memory_mb} State=UNKNOWN",
        f"PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP",
    ]
    path = os.path.join(root, "slurm.conf")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def start_cluster(root: str, real_memory_mb: int = 4000, timeout: float = 60) -> Cluster:
    """Start munged, slurmctld and slurmd for a private cluster under ``root`` and wait until its
    node is idle.  On any failure the daemons already started are stopped and RuntimeError names
    the daemon and its log tail.

    Args:
        root: an empty directory (state, spool, logs, the munge key and socket go there).
        real_memory_mb: the node's ``RealMemory`` (MB): below this machine's free memory.
        timeout: seconds to wait for the node to come up.
    """
    for d in ("state", "spool", "munge"):
        os.makedirs(os.path.join(root, d), mode=0o700, exist_ok=True)
    os.chmod(root, 0o755)  # slurmd's job steps (root here) read the conf
    key = os.path.join(root, "munge", "munge.key")
    with open(key, "wb") as f:
        f.write(os.urandom(1024))
    os.chmod(key, 0o400)
    sock = os.path.join(root, "munge", "munge.socket")
    node = socket.gethostname().split(".")[0]
    conf = write_conf(root, node, _free_ports(2), real_memory_mb, sock)
    env = dict(os.environ, SLURM_CONF=conf)
    cl = Cluster(root=root, conf=conf, env=env, node=node)
    try:
        munged = [_which("munged"), "-F", "-f", f"--socket={sock}", f"--key-file={key}",
                  f"--pid-file={root}/munge/munged.pid", f"--log-file={root}/munged.log",
                  f"--seed-file={root}/munge/munged.seed"]
        cl.procs.append(subprocess.Popen(munged, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.STDOUT, start_new_session=True))
        _wait(lambda: os.path.exists(sock), 15, "munged did not create its socket", cl)
        for daemon in ("slurmctld", "slurmd"):
            argv = [_which(daemon), "-D", "-f", conf] + (["-i"] if daemon == "slurmctld" else [])
            cl.procs.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                             stderr=subprocess.STDOUT, start_new_session=True))
            if daemon == "slurmctld":
                _wait(lambda: cl.run("scontrol", "ping", check=False, timeout=10).returncode == 0
                      and "UP" in cl.run("scontrol", "ping", check=False, timeout=10).stdout, timeout,
                      "slurmctld did not answer `scontrol ping`", cl)
        _wait(lambda: cl.run("sinfo", "-h", "-N", "-o", "%t", check=False, timeout=10).stdout.strip() == "idle",
              timeout, "the node did not become idle", cl)
    except BaseException:
        cl.stop()
        raise
    return cl


def _wait(pred, timeout: float, what: str, cl: Cluster) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = [p for p in cl.procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{dead[0].args[0]} exited ({dead[0].returncode}) while starting: {what}\n{cl.logs()}")
        try:
            if pred():
                return
        except (subprocess.TimeoutExpired, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what} within {timeout:.0f} s\n{cl.logs()}")
