"""The processes and threads dlrmctl starts on this machine (no torch here: the CLI imports it early).

* :func:`intra_op_threads`: the intra-op (OpenMP) threads of a process, or of each of ``n``
  local processes, from the CPUs this process may use (affinity, cgroup quota) and the load
  already on them; ``OMP_NUM_THREADS`` wins.
* :func:`check_local_fanout`: refuses to start more local processes than this machine can
  run (CPUs x :data:`OVERSUBSCRIBE`, and the available memory); ``DLRMCTL_MAX_LOCAL_PROCS``
  overrides the limit.
* :func:`die_with_parent` / :func:`die_with_launcher`: every child process dlrmctl starts ends
  when the process that started it ends, even by SIGKILL (Linux ``PR_SET_PDEATHSIG``; a watch
  thread on a pid for grandchildren started through torchrun).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time

from dlrmctl.errors import UserError

#: local processes allowed per usable CPU (the suite runs 2-4 gloo ranks on 2 CPUs)
OVERSUBSCRIBE = 4
#: resident memory assumed per local process that imports torch (MiB)
PROC_MEM_MB = 300
#: environment variable that overrides the local process limit (an integer >= 1)
MAX_PROCS_ENV = "DLRMCTL_MAX_LOCAL_PROCS"
#: environment variable naming the launcher a job's ranks end with: ``"<pid>:<start time>"``
LAUNCHER_ENV = "DLRMCTL_LAUNCHER"


class FanoutError(ValueError, UserError):
    """More local processes were asked for than this machine runs (a user error: one line)."""


def usable_cpus() -> tuple[int, str]:
    """CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota.

    Returns:
        ``(cpus >= 1, description)``, e.g. ``(2, "2 CPUs")`` or ``(4, "4 CPUs (cgroup quota)")``.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None and quota < cpus:
        return max(1, quota), f"{max(1, quota)} CPUs (cgroup quota)"
    return max(1, cpus), f"{max(1, cpus)} CPUs"


def _cgroup_cpu_quota() -> int | None:
    """CPUs allowed by the cgroup's CFS quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), rounded up; None: no quota."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else math.ceil(int(quota) / int(period))
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as f:
            quota = int(f.read())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
            period = int(f.read())
        return None if quota <= 0 or period <= 0 else math.ceil(quota / period)
    except (OSError, ValueError):
        return None


def cpu_vendor(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The CPU's vendor string (``vendor_id`` of ``/proc/cpuinfo``: ``GenuineIntel``,
    ``AuthenticAMD``, ...), or None where it cannot be read (not Linux, not x86)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip() or None
                if not line.strip():  # the first processor's block ended without one
                    return None
    except OSError:
        return None
    return None


def intra_op_threads(procs: int = 1) -> tuple[int, str]:
    """Intra-op (OpenMP) threads for each of ``procs`` processes about to start on this machine, and why.

    ``OMP_NUM_THREADS`` (a positive integer) wins.  Otherwise the usable CPUs (:func:`usable_cpus`)
    minus the load already running on them (``os.getloadavg()``'s 1-minute average, rounded),
    divided among ``procs``; at least 1.  On a busy 2-CPU machine that is 1 thread: more threads
    than idle CPUs make OpenMP spin against the other work (10-20x slower steps).

    Returns:
        ``(threads >= 1, reason)``, e.g. ``(1, "2 CPUs, load 1.8: 1 idle")``.
    """
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env), "OMP_NUM_THREADS is set"
    cpus, what = usable_cpus()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # pragma: no cover - no load average on this platform
        load = 0.0
    idle = max(1, min(cpus, int(cpus - load + 0.5)))
    why = f"{what}, load {load:.1f}: {idle} idle"
    if procs > 1:
        why += f" / {procs} processes"
    return max(1, idle // max(procs, 1)), why


def local_process_limit() -> tuple[int, str]:
    """How many processes a local fan-out may start on this machine, and why.

    ``DLRMCTL_MAX_LOCAL_PROCS`` when set; else ``min(OVERSUBSCRIBE x usable CPUs, available memory /
    PROC_MEM_MB)``, at least 2.

    Raises:
        FanoutError: ``DLRMCTL_MAX_LOCAL_PROCS`` is not a positive integer.
    """
    env = os.environ.get(MAX_PROCS_ENV, "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise FanoutError(f"{MAX_PROCS_ENV}={env!r}: expected a positive integer (the most local processes)")
        return int(env), f"{MAX_PROCS_ENV}={env}"
    cpus, what = usable_cpus()
    limit, why = OVERSUBSCRIBE * cpus, f"{OVERSUBSCRIBE} per CPU, {what}"
    avail = _available_memory_mb()
    if avail is not None and avail // PROC_MEM_MB < limit:
        limit, why = int(avail // PROC_MEM_MB), f"{avail / 1024:.1f} GiB available memory, ~{PROC_MEM_MB} MiB each"
    return max(2, limit), why


def _available_memory_mb() -> float | None:
    """``MemAvailable`` of /proc/meminfo in MiB; None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_local_fanout(n: int, option: str, remedy: str = "") -> None:
    """Refuse to start ``n`` local processes (``option``, e.g. ``"--nproc 1000"``) above :func:`local_process_limit`.

    Raises:
        FanoutError: ``n`` is above the limit; the message names it, why, and the remedies.
    """
    limit, why = local_process_limit()
    if n > limit:
        raise FanoutError(f"{option}: would start {n} processes on this machine, more than it runs ({limit}: {why}); "
                          f"use {limit} or fewer{', ' + remedy if remedy else ''}, or set {MAX_PROCS_ENV} "
                          "to raise the limit")


# --------------------------------------------------------------- children end with their parent
def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> bool:
    """Have the kernel send ``sig`` to this process when its parent ends (Linux ``PR_SET_PDEATHSIG``).

    Call it first thing in a child process (a pool initializer, a rank's entry point).  When the
    parent already ended (``os.getppid()`` is no longer ``parent``), ``sig`` is sent at once.

    Args:
        sig: the signal (SIGKILL: the child holds nothing worth cleaning up; SIGTERM: it does).
        parent: the parent's pid as the parent knew it (default: ``os.getppid()`` now).

    Returns:
        True when armed (Linux), False elsewhere (a no-op).
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    expected = os.getppid() if parent is None else parent
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(sig), 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
            return False
    except (OSError, AttributeError):  # pragma: no cover - no prctl
        return False
    if os.getppid() != expected:  # the parent ended before the prctl
        os.kill(os.getpid(), sig)
    return True


def process_token(pid: int | None = None) -> str:
    """``"<pid>:<start time>"`` of a process (this one by default): names it even after its pid is reused."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{_start_time(pid) or ''}"


def proc_stat(pid: int) -> list[str] | None:
    """Fields of ``/proc/<pid>/stat`` after the command (index 0: state, 1: ppid, 19: start time);
    None when the process is gone or the file is unreadable (not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return fields if len(fields) > 19 else None


def _start_time(pid: int) -> str | None:
    """The start time field of ``/proc/<pid>/stat``; None when the process is gone (or a zombie) or unknown."""
    st = proc_stat(pid)
    return None if st is None or st[0] == "Z" else st[19]


def alive(token: str) -> bool:
    """Whether the process named by :func:`process_token` ``token`` is still running."""
    pid_s, _, start = token.partition(":")
    pid = int(pid_s)
    if os.path.isdir("/proc"):
        return _start_time(pid) is not None and (not start or _start_time(pid) == start)
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def die_with_launcher(sig: int = signal.SIGKILL, interval_s: float = 0.5) -> bool:
    """End this process with ``sig`` when the launcher named by ``$DLRMCTL_LAUNCHER`` ends.

    For ranks started through torchrun: their parent is torchrun (see :func:`die_with_parent`),
    which itself may outlive a SIGKILLed ``dlrmctl train``; a daemon thread checks the launcher
    every ``interval_s`` seconds.

    Returns:
        True when watching (the variable is set), False otherwise.
    """
    token = os.environ.get(LAUNCHER_ENV, "")
    if not token or not token.partition(":")[0].isdigit():
        return False

    def watch() -> None:
        while alive(token):
            time.sleep(interval_s)
        os.kill(os.getpid(), sig)

    threading.Thread(target=watch, name="dlrmctl-launcher-watch", daemon=True).start()
    return True


