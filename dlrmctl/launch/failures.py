"""How a launch fails: :class:`LaunchError`; a failed rank's record and the launcher's reading of them: :func:`record_rank_failure` (called
by the rank worker, ``dlrmctl.train.worker``, in its ``except`` block) writes torchelastic's error
file with dlrmctl's fields; :func:`first_failure` (called by the launcher after the job) reads
them back, with torchrun's report of the ranks that died without one, and names the rank that
failed first.  No torchx import: the rank worker loads this module alone.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import time
from typing import Any

from dlrmctl.errors import UserError

class LaunchError(UserError):
    """A scheduler refused the job, cannot be reached, or the job failed / was cancelled: one line
    naming the scheduler's own message and what to change."""


#: key of dlrmctl's fields inside a torchelastic error file's ``extraInfo``
_RECORD_KEY = "dlrmctl"


def record_rank_failure(error: BaseException, user_error: bool) -> None:
    """Record this rank's failure in the error file torchrun gave it, for :func:`first_failure`.

    Writes torchelastic's error-file format (``{"message": {"message", "extraInfo":
    {"py_callstack", "timestamp"}}}``, so torchrun's own report still works) with dlrmctl's
    fields added under ``extraInfo.dlrmctl``: global rank, time, whether it is a user error
    (one-line message), whether it is a communication error caused by another rank going away,
    and this rank's stderr log.  Does nothing outside torchrun (no ``TORCHELASTIC_ERROR_FILE``).

    Args:
        error: the exception that ends this rank (call from inside its ``except`` block).
        user_error: the error is the user's input; its message is shown without the type.
    """
    import traceback

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    message = str(error) if user_error else f"{type(error).__name__}: {error}"
    info = {
        "rank": int(os.environ.get("RANK", "0")),
        "time": time.time(),
        "user_error": user_error,
        "peer": _is_peer_failure(error),
        "log": os.path.join(os.path.dirname(path), "stderr.log"),
    }
    data = {"message": {"message": message, "extraInfo": {
        "py_callstack": traceback.format_exc(), "timestamp": str(int(info["time"])), _RECORD_KEY: info}}}
    with open(path, "w") as f:
        json.dump(data, f)


def _is_peer_failure(error: BaseException) -> bool:
    """A collective / store operation failed, typically because another rank died first."""
    import torch.distributed as dist

    text = str(error)
    return isinstance(error, dist.DistError) or any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe"))


def first_failure(app_log_dir: str, role: str) -> tuple[str, str | None] | None:
    """The root failure of a finished local job, from the logs under ``app_log_dir``: the rank that
    failed FIRST, not the first rank that noticed.

    In order: the earliest rank record (:func:`record_rank_failure`) that is not a communication
    error (a rank that lost a peer did not cause the failure); else a rank that ended without a
    record, killed by a signal or exiting non-zero (from torchrun's per-rank failure report, its
    own signal before a SIGTERM, which is how torchrun stops the others; then torchrun's time, then
    the rank); else the earliest communication error.

    Args:
        app_log_dir: torchx's log directory of the app (``LOG_DIR/<session>/<app id>``).
        role: the AppDef's role name.

    Returns:
        ``(description, log)``: e.g. ``("rank 1 failed: ValueError: ...", ".../1/stderr.log")``
        (user errors: ``"rank 1: <message>"``; no record: ``"rank 1 failed: killed by SIGKILL"``);
        ``log`` is that rank's stderr log or None.  None when nothing in the logs names a failed rank.
    """
    records = []
    for path in glob.glob(os.path.join(app_log_dir, "**", "error.json"), recursive=True):
        try:
            with open(path) as f:
                data = json.load(f)
            info = data["message"]["extraInfo"][_RECORD_KEY]
            message = data["message"]["message"]
            records.append((bool(info["peer"]), float(info["time"]), int(info["rank"]), info, message))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    real = [r for r in records if not r[0]]
    if real:
        return _describe_record(min(real, key=lambda r: r[:3]))
    recorded = {r[2] for r in records}
    unrecorded = [f for f in _torchrun_failures(app_log_dir, role) if f["rank"] not in recorded]
    if unrecorded:
        f = min(unrecorded, key=lambda f: (f["signal"] == "SIGTERM", f["time"], f["rank"]))
        how = f"killed by {f['signal']}" if f["signal"] else f"exit code {f['exitcode']} without an error report"
        logs = glob.glob(os.path.join(app_log_dir, "**", "attempt_*", str(f["local_rank"]), "stderr.log"),
                         recursive=True)
        return f"rank {f['rank']} failed: {how}", (logs[0] if len(logs) == 1 else None)
    if records:
        return _describe_record(min(records, key=lambda r: r[:3]))
    return None


def _describe_record(record: tuple) -> tuple[str, str | None]:
    """``(description, log)`` of one rank record of :func:`first_failure`."""
    _, _, rank, info, message = record
    first_line = (message.strip().splitlines() or [""])[0]
    what = f"rank {rank}: {first_line}" if info["user_error"] else f"rank {rank} failed: {first_line}"
    return what, info.get("log")


def _torchrun_failures(app_log_dir: str, role: str) -> list[dict[str, Any]]:
    """Every failed rank of torchrun's ``ChildFailedError`` report (its ``Failures:`` and ``Root Cause``
    blocks) in the torchrun logs ``<app_log_dir>/<role>/<replica>/stderr.log``.

    Returns:
        ``[{"rank", "local_rank", "exitcode", "signal" (e.g. "SIGKILL" or None), "time" (torchrun's
        text, sortable)}]``, one per rank.
    """
    out: dict[int, dict[str, Any]] = {}
    for path in glob.glob(os.path.join(app_log_dir, role, "*", "stderr.log")):
        try:
            with open(path, errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        for block in re.split(r"^\s*\[\d+\]:\s*$", text, flags=re.M)[1:]:
            m = re.search(r"^\s*rank\s*:\s*(\d+)(?:\s*\(local_rank:\s*(\d+)\))?", block, re.M)
            code = re.search(r"^\s*exitcode\s*:\s*(-?\d+)", block, re.M)
            if not m or not code:
                continue
            exitcode = int(code.group(1))
            sig = re.search(r"\((SIG[A-Z0-9]+)\)", block)
            name = sig.group(1) if sig else None
            if name is None and exitcode < 0:
                try:
                    name = signal.Signals(-exitcode).name
                except ValueError:
                    name = f"signal {-exitcode}"
            when = re.search(r"^\s*time\s*:\s*(\S+)", block, re.M)
            rank = int(m.group(1))
            out.setdefault(rank, {"rank": rank, "local_rank": int(m.group(2) or rank), "exitcode": exitcode,
                                  "signal": name, "time": when.group(1) if when else ""})
    return list(out.values())
