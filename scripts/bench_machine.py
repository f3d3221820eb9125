"""The machine a benchmark ran on, for its table's heading: the CPU model and ``uptime``'s load line.
Standard library only (the TorchRec and KServe peers' venvs import nothing of dlrmctl)."""

import os
import subprocess


def uptime() -> str:
    """``uptime``'s line (the load averages over 1, 5 and 15 minutes); the load averages alone when
    ``uptime`` cannot run."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_model() -> str:
    """The CPU model (``/proc/cpuinfo``'s first ``model name``) and the CPUs this process may run on."""
    try:
        with open("/proc/cpuinfo") as f:
            model = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        model = "unknown CPU"
    return f"{model}, {len(os.sched_getaffinity(0))} CPUs"
