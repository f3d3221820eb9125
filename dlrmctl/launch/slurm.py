"""torchx's Slurm scheduler as dlrmctl runs it: refusals and unreachable controllers as one line,
and job status without accounting storage.

:class:`SlurmScheduler` subclasses ``torchx.schedulers.slurm_scheduler.SlurmScheduler``:

* ``schedule`` (sbatch) and ``cancel`` (scancel) capture the command's stderr and raise
  :class:`~dlrmctl.launch.failures.LaunchError` with Slurm's own message and what to change (torchx raises
  ``CalledProcessError`` and lets the message go to the terminal);
* ``describe`` asks ``sacct`` (torchx) and, when the cluster keeps no accounting data
  (``AccountingStorageType=accounting_storage/none``: "Slurm accounting storage is disabled") or
  sacct does not know the job yet, ``scontrol show job`` (jobs that are pending, running or ended
  less than ``MinJobAge`` ago); a job neither knows is None (unknown).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from typing import Any

from torchx.schedulers import slurm_scheduler as _tx
from torchx.schedulers.api import DescribeAppResponse
from torchx.specs import AppState, ReplicaStatus, Role, RoleStatus

from dlrmctl.launch.failures import LaunchError

#: sbatch / scancel / scontrol messages -> what the user changes
_REMEDIES = (
    ("memory specification can not be satisfied",
     "ask for less memory per process with --mem (see the nodes' RealMemory: `sinfo -o '%P %m'`), or fewer --nproc"),
    ("requested node configuration is not available",
     "ask for less per node (--mem per process, --cpus-per-proc, --gpus-per-proc, --nproc; the nodes have "
     "`sinfo -N -o '%N %c %m %G'`) or pick a partition that has it (--scheduler-arg partition=NAME)"),
    ("invalid partition", "name an existing partition: --scheduler-arg partition=NAME (see `sinfo`)"),
    ("invalid generic resource", "this partition has no GPUs: pass --gpus-per-proc 0 or a GPU partition "
     "(--scheduler-arg partition=NAME)"),
    ("invalid account", "pass an account you may use: --scheduler-arg account=NAME (see `sacctmgr show assoc`)"),
    ("time limit", "ask for less time: --scheduler-arg time=HH:MM:SS within the partition's MaxTime"),
    *((words, "the Slurm controller is unreachable: check that slurmctld runs (`scontrol ping`) and that "
               "SLURM_CONF / /etc/slurm/slurm.conf names it")
      for words in ("unable to contact slurm controller", "connection refused", "socket timed out",
                    "zero bytes were transmitted", "communication connection failure")),
    ("could not establish a configuration source",
     "this machine has the Slurm client but no cluster configuration: run dlrmctl on a login node of the "
     "cluster (or set SLURM_CONF to its slurm.conf)"),
    ("authentication", "munge authentication failed: check that munged runs and shares the cluster's key"),
)


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def remedy_for(message: str, submitting: bool = True) -> str:
    """What to change for a Slurm client's error ``message``; a generic hint when it is not known:
    the request's options when ``submitting`` (sbatch), else the job id and the cluster (status,
    cancel: the request's options cannot help there)."""
    low = message.lower()
    for words, remedy in _REMEDIES:
        if words in low:
            return remedy
    if not submitting:
        return "check the job id (`squeue -u $USER`) and that the cluster answers (`scontrol ping`)"
    return ("change the request (--mem, --cpus-per-proc, --gpus-per-proc, --nproc, --scheduler-arg "
            "partition=/account=/time=)")


def run_client(argv: list[str], what: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    """Run a Slurm client command (text output captured); a missing program, a timeout or (with
    ``check``) a non-zero exit is a :class:`~dlrmctl.launch.failures.LaunchError` naming ``what``, Slurm's
    message and the remedy."""

    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise LaunchError(f"{what}: `{argv[0]}` is not on PATH; run dlrmctl on a Slurm login node (where sbatch, "
                          "squeue and scontrol are installed)") from None
    except subprocess.TimeoutExpired:
        raise LaunchError(f"{what}: `{' '.join(argv[:2])}` did not answer within {timeout:.0f} s; "
                          + remedy_for("unable to contact slurm controller")) from None
    if check and p.returncode != 0:
        msg = _last_line(p.stderr) or _last_line(p.stdout) or f"exit code {p.returncode}"
        msg = re.sub(r"^(?:\w+: )*error: ", "", msg)  # "sbatch: error: Batch job ..." -> "Batch job ..."
        tool = os.path.basename(argv[0])
        raise LaunchError(f"{what}: {tool}: {msg}; {remedy_for(msg, submitting=tool == 'sbatch')}")
    return p


class SlurmScheduler(_tx.SlurmScheduler):
    """torchx's Slurm scheduler with one-line errors and a ``scontrol`` fallback for status."""

    def _partition_memmb(self, partition: str | None) -> int | None:
        """The memory per node (MB) of ``partition`` (None: the default partition) from ``sinfo``,
        as torchx's, but with sinfo's stderr kept: on a machine with the Slurm client and no
        cluster, ``launch --dry-run`` printed sinfo's "Could not establish a configuration source".
        None when sinfo is missing, fails or does not list the partition."""
        try:
            p = subprocess.run(["sinfo", "--format", "%P,%m", "--noconvert"], capture_output=True, text=True,
                               timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if p.returncode != 0:
            return None
        for line in p.stdout.strip().splitlines()[1:]:
            part, _, mem = line.partition(",")
            default = "*" in part
            if (part.strip("*") == partition or (partition is None and default)) and mem.strip("M+").isdigit():
                return int(mem.strip("M+"))
        return None

    def schedule(self, dryrun_info: Any) -> str:  # noqa: D102 - torchx's, with sbatch's stderr captured
        import tempfile

        req = dryrun_info.request
        with tempfile.TemporaryDirectory() as tmpdir:
            path = os.path.join(req.job_dir or tmpdir, "torchx-sbatch.sh")
            if req.job_dir is not None:
                req.cmd += [f"--chdir={req.job_dir}"]
            req.cmd += [path]
            with open(path, "w") as f:
                f.write(req.materialize())
            p = run_client(req.cmd, "sbatch refused the job")
            job_id = p.stdout.strip().split(";")[0]
            if req.job_dir is not None:
                _tx._save_job_dir(job_id, req.job_dir)
            return job_id

    def log_iter(self, app_id: str, role_name: str, k: int = 0, regex: str | None = None, since: Any = None,
                 until: Any = None, should_tail: bool = False, streams: Any = None) -> Any:
        """torchx's, except that without ``should_tail`` the log is read as it is now and the
        iterator ends (torchx's tails a running job's log even then); a log file that is not here
        raises RuntimeError ``... without writing: <file>`` as torchx's does."""
        if should_tail:
            return super().log_iter(app_id, role_name, k, regex, since, until, should_tail, streams)
        from torchx.schedulers.api import Stream

        name = f"slurm-{app_id}-{role_name}-{k}.{'out' if streams == Stream.STDOUT else 'err'}"
        path = _tx._get_job_dirs().get(app_id)
        path = os.path.join(path, name) if path else name
        if not os.path.isfile(path):
            raise RuntimeError(f"app: {app_id} finished without writing: {path}")
        with open(path, errors="replace") as f:
            lines = f.read().splitlines(keepends=True)
        return [ln for ln in lines if regex is None or re.search(regex, ln)]

    def _cancel_existing(self, app_id: str) -> None:
        run_client(["scancel", app_id], f"cannot cancel Slurm job {app_id}")

    #: seconds a describe answer is reused (torchx's log tailing asks every 0.1 s); a final state is kept
    CACHE_S = 1.5

    def describe(self, app_id: str) -> DescribeAppResponse | None:
        """The job's state from ``sacct``, else from ``scontrol show job`` (no accounting data); None when
        unknown.  Answers are reused for :attr:`CACHE_S` seconds, a terminal state for good.

        Raises:
            LaunchError: the controller cannot be reached (or the Slurm clients are absent).
        """
        from torchx.specs import is_terminal

        cache = self.__dict__.setdefault("_describe_cache", {})
        hit = cache.get(app_id)
        if hit is not None and (time.monotonic() - hit[0] < self.CACHE_S or (hit[1] and is_terminal(hit[1].state))):
            return hit[1]
        desc = self._describe(app_id)
        cache[app_id] = (time.monotonic(), desc)
        return desc

    def _describe(self, app_id: str) -> DescribeAppResponse | None:
        desc = None
        try:  # torchx's sacct call lets sacct's stderr through: ask quietly first
            acct = subprocess.run(["sacct", "--parsable2", "-j", app_id], capture_output=True, text=True, timeout=60)
            if acct.returncode == 0 and len(acct.stdout.strip().splitlines()) > 1:
                desc = super().describe(app_id)
        except (subprocess.SubprocessError, OSError, AssertionError):
            desc = None
        if desc is not None and desc.state != AppState.UNKNOWN:
            return desc
        return self._describe_scontrol(app_id)

    def _describe_scontrol(self, app_id: str) -> DescribeAppResponse | None:
        p = run_client(["scontrol", "show", "job", "-o", app_id], f"cannot ask Slurm about job {app_id}", check=False)
        if p.returncode != 0:
            msg = _last_line(p.stderr)
            if "invalid job id" in msg.lower():
                return None  # never submitted, or ended longer than MinJobAge ago (no accounting to ask)
        
            raise LaunchError(f"cannot ask Slurm about job {app_id}: scontrol: {msg or p.returncode}; "
                              f"{remedy_for(msg, submitting=False)}")
        return parse_scontrol(app_id, p.stdout)


def parse_scontrol(app_id: str, text: str) -> DescribeAppResponse | None:
    """A ``DescribeAppResponse`` from ``scontrol show job -o ID`` output (one line per het component:
    ``JobId=.. JobName=worker-0 .. JobState=RUNNING Reason=None ..``); the job's state is the first
    component's that is not COMPLETED (all COMPLETED: SUCCEEDED).  None when it names no job."""
    roles: dict[str, Role] = {}
    statuses: dict[str, RoleStatus] = {}
    states: list[str] = []
    reasons: list[str] = []
    for line in text.splitlines():
        fields = dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", line))
        if "JobState" not in fields:
            continue
        raw = fields["JobState"]
        states.append(raw)
        if fields.get("Reason") not in (None, "None", "(null)"):
            reasons.append(fields["Reason"])
        state = _tx.SLURM_STATES.get(raw, AppState.RUNNING if raw in ("COMPLETING", "CONFIGURING") else
                                     AppState.UNKNOWN)
        role, _, replica = fields.get("JobName", "").rpartition("-")
        if role and replica.isdigit():
            roles.setdefault(role, Role(name=role, num_replicas=0, image=""))
            roles[role].num_replicas += 1
            statuses.setdefault(role, RoleStatus(role, [])).replicas.append(
                ReplicaStatus(id=int(replica), role=role, state=state, hostname=fields.get("BatchHost", "")))
    if not states:
        return None
    main = next((s for s in states if s != "COMPLETED"), "COMPLETED")
    state = _tx.SLURM_STATES.get(main, AppState.RUNNING if main in ("COMPLETING", "CONFIGURING") else
                                 AppState.UNKNOWN)
    msg = main + (f" ({', '.join(dict.fromkeys(reasons))})" if reasons else "")
    return DescribeAppResponse(app_id=app_id, roles=list(roles.values()), roles_statuses=list(statuses.values()),
                               state=state, msg=msg)


def create_scheduler(session_name: str, **kwargs: Any) -> SlurmScheduler:
    """torchx scheduler factory of :class:`SlurmScheduler`."""
    return SlurmScheduler(session_name=session_name)
