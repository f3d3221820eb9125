"""Launching ``dlrmctl train`` as a multi-process / multi-node job through torchx's ``dist.ddp``.

* :mod:`~dlrmctl.launch.appdef`: the AppDef (:func:`build_appdef`): dist.ddp's, run by this
  interpreter's torchrun, with each rank's environment and resources;
* :mod:`~dlrmctl.launch.run`: running it on ``local_cwd`` or a cluster scheduler (:func:`launch`),
  waiting, cancelling, rank 0's console;
* :mod:`~dlrmctl.launch.failures`: :class:`LaunchError`, a failed rank's record
  (:func:`record_rank_failure`, written by the rank worker) and :func:`first_failure`;
* :mod:`~dlrmctl.launch.slurm`: torchx's Slurm scheduler with one-line errors and a status fallback
  without accounting (imported only when the Slurm scheduler is used: it needs torchx).

The public names import from here.
"""

from dlrmctl.launch.failures import LaunchError, first_failure, record_rank_failure
from dlrmctl.launch.appdef import (
    CONTAINER_SCHEDULERS,
    LOCAL_SCHEDULER,
    ROLE,
    WORKER_MODULE,
    build_appdef,
    check_image,
    default_mem_mb_per_proc,
    format_appdef,
    omp_threads_per_rank,
    parse_mem,
)
from dlrmctl.launch.run import SESSION, get_runner, job_outcome, launch, scheduler_client, wait_job

__all__ = ["CONTAINER_SCHEDULERS", "LOCAL_SCHEDULER", "ROLE", "SESSION", "WORKER_MODULE", "LaunchError", "build_appdef",
           "check_image", "default_mem_mb_per_proc", "first_failure", "format_appdef", "get_runner", "job_outcome",
           "launch", "omp_threads_per_rank", "parse_mem", "record_rank_failure", "scheduler_client", "wait_job"]
