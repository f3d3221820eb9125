"""Entry point of one training process (``python -m dlrmctl.train.worker``).

``dlrmctl train`` calls :func:`run_training` in-process for one rank; for
``--nproc N`` torchx / torchrun start N copies of this module, each reading its
rank from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch

from dlrmctl import run_lock
from dlrmctl._fbgemm import ensure_checked
from dlrmctl.config import load_config
from dlrmctl.distributed.env import RunEnv
from dlrmctl.errors import UserError, interrupt_of, user_error_message
from dlrmctl.train.run_dir import REPLACED_DIR, clear_unsaved_attempt, finish_replacement, prepare_run_dir
from dlrmctl.train.trainer import Trainer, resolve_device


def _make_env(cfg) -> RunEnv:
    """This rank's RunEnv: a plain single process, or a process group (torchrun's ranks,
    or one rank with ``sharding.force``) on the config's device (nccl on CUDA, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and not cfg.sharding.force:
        return RunEnv(device=resolve_device(cfg))
    from dlrmctl.distributed.env import init_distributed

    dev = resolve_device(cfg)
    senv = init_distributed(local_world_size=cfg.sharding.local_world_size, single_rank_group=True,
                            device=dev if world == 1 else (None if dev.type == "cuda" else dev))
    return RunEnv(senv.rank, senv.world_size, senv.local_world_size, senv.device, senv)


def run_training(config: str, overrides: list[str], resume: bool = False, overwrite: bool = False,
                 checkpoint: str | None = None, threads: int | None = None, threads_why: str | None = None,
                 init_from: str | None = None) -> dict:
    """Load the config, set up this rank, train; returns the trainer's summary.

    ``checkpoint`` (with ``resume``): ``best``, ``last`` (default) or a step to resume from.
    ``init_from``: a checkpoint directory a new run starts from (:mod:`dlrmctl.train.init_from`).
    ``threads``: intra-op threads of this process (``torch.set_num_threads``); None: torch's
    (``OMP_NUM_THREADS``, which the launcher sets for each rank).  ``threads_why``: how the count
    was chosen (:func:`dlrmctl.procs.intra_op_threads`); with it, rank 0 prints
    ``N intra-op thread(s) (why; OMP_NUM_THREADS overrides)`` once the model is built."""
    if threads is not None:
        torch.set_num_threads(threads)
    cfg = load_config(config, overrides)
    ensure_checked()  # the torch / fbgemm_gpu pair loads (a mismatch is one error line)
    env = _make_env(cfg)
    locked = False
    run_dir = os.path.join(cfg.train.run_dir, cfg.name)
    # a rank of `dlrmctl train --nproc`: its launcher set the run directory up and clears it after a failure
    launcher_prepared = os.environ.get(run_lock.ENV_PREPARED) == os.path.abspath(run_dir)
    try:
        if env.is_main:  # held for the whole run (unless this process or the --nproc launcher holds it)
            locked = run_lock.acquire(run_dir)
            if not launcher_prepared:
                prepare_run_dir(cfg, resume=resume, overwrite=overwrite)
        env.barrier()
        torch.manual_seed(cfg.train.seed)
        try:
            trainer = Trainer(cfg, env, run_dir, resume=resume, checkpoint=checkpoint, init_from=init_from)
            if threads_why is not None and env.is_main:
                from dlrmctl.console import echo

                echo(f"{torch.get_num_threads()} intra-op thread(s) ({threads_why}; OMP_NUM_THREADS overrides)")
            summary = trainer.train()
            if env.is_main:  # ended successfully: an --overwrite's old run goes
                finish_replacement(run_dir, done=True)
            return summary
        except BaseException as e:
            # nothing saved: leave nothing that would mix into a retry.  An interrupted attempt keeps its
            # config and logs (the directory does not vanish; the next `train` clears them through
            # prepare_run_dir -> clear_unsaved_attempt), except that an interrupted --overwrite gives
            # the old run back at once
            if env.is_main and not launcher_prepared and (
                    interrupt_of(e) is None or os.path.isdir(os.path.join(run_dir, REPLACED_DIR))):
                clear_unsaved_attempt(run_dir)
            raise
    finally:
        if locked:
            run_lock.release(os.path.join(cfg.train.run_dir, cfg.name))
        if env.sharded:
            from dlrmctl.distributed.env import destroy_distributed

            destroy_distributed()


def main(argv: list[str] | None = None) -> int:
    """``python -m dlrmctl.train.worker CONFIG [--set k=v ...] [--resume [--checkpoint W]] [--overwrite]``.

    A failure is printed to stderr (user errors as one ``error: ...`` line, others as a
    traceback) and, under torchrun, recorded in the rank's error file for the launcher
    (:func:`dlrmctl.launch.failures.record_rank_failure`).

    Returns:
        exit code: 0 on success, 2 on user errors (:class:`dlrmctl.errors.UserError`, or an OSError
        of the user's environment such as a full disk), 1 on any other error.
    """
    p = argparse.ArgumentParser(prog="python -m dlrmctl.train.worker")
    p.add_argument("config")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--resume", action="store_true")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--init-from", dest="init_from", default=None)
    a = p.parse_args(argv)
    from dlrmctl.console import setup_logging
    from dlrmctl.procs import die_with_launcher, die_with_parent

    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:  # a rank started by torchrun
        die_with_parent()  # torchrun ends: so does this rank
        die_with_launcher()  # `dlrmctl train --nproc` SIGKILLed (torchrun runs in its own session): too

    setup_logging()
    try:
        run_training(a.config, a.overrides, resume=a.resume, overwrite=a.overwrite, checkpoint=a.checkpoint,
                     init_from=a.init_from)
    except Exception as e:  # reported here (and recorded for the launcher), not as an uncaught traceback
        from dlrmctl.launch.failures import record_rank_failure

        msg = user_error_message(e)
        user_error = msg is not None
        if user_error:
            print(f"error: {msg}", file=sys.stderr)
        else:
            traceback.print_exc()
        # (a mapped OSError, e.g. a full disk, is recorded with its one line, as a UserError)
        record_rank_failure(UserError(msg) if user_error and not isinstance(e, UserError) else e, user_error)
        return 2 if user_error else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
