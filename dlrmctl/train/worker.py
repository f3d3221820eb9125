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
from dlrmctl._fbgemm import FbgemmTorchMismatchError, ensure_checked
from dlrmctl.config import ConfigError, load_config
from dlrmctl.data.fingerprint import DataMismatchError
from dlrmctl.distributed.types import PlanError
from dlrmctl.run_lock import RunInUseError
from dlrmctl.sparse.validation import EmbeddingIdError
from dlrmctl.train.checkpoint import CheckpointError
from dlrmctl.distributed.env import RunEnv
from dlrmctl.train.run_dir import TrainError, clear_unsaved_attempt, prepare_run_dir
from dlrmctl.train.trainer import Trainer, resolve_device

#: errors that are the user's input, reported as one line without a traceback
USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, PlanError, CheckpointError, TrainError, FileNotFoundError,
                                               EmbeddingIdError, FbgemmTorchMismatchError, DataMismatchError,
                                               RunInUseError)
try:  # optional modules add their own user-facing errors
    from dlrmctl.data.columnar import DataError

    USER_ERRORS += (DataError,)
except ImportError:  # pragma: no cover
    pass
try:
    from dlrmctl.planner.types import PlannerError

    USER_ERRORS += (PlannerError,)
except ImportError:  # pragma: no cover
    pass
try:
    from dlrmctl.inference.export import ExportError
    from dlrmctl.inference.quantize import QuantizationError

    USER_ERRORS += (ExportError, QuantizationError)
except ImportError:  # pragma: no cover
    pass


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
                 checkpoint: str | None = None) -> dict:
    """Load the config, set up this rank, train; returns the trainer's summary.

    ``checkpoint`` (with ``resume``): ``best``, ``last`` (default) or a step to resume from."""
    cfg = load_config(config, overrides)
    ensure_checked()  # the torch / fbgemm_gpu pair loads (a mismatch is one error line)
    env = _make_env(cfg)
    locked = False
    try:
        if env.is_main:  # held for the whole run (unless this process or the --nproc launcher holds it)
            locked = run_lock.acquire(os.path.join(cfg.train.run_dir, cfg.name))
            run_dir = prepare_run_dir(cfg, resume=resume, overwrite=overwrite)
        env.barrier()
        run_dir = os.path.join(cfg.train.run_dir, cfg.name)
        torch.manual_seed(cfg.train.seed)
        try:
            return Trainer(cfg, env, run_dir, resume=resume, checkpoint=checkpoint).train()
        except BaseException:
            if env.is_main:  # nothing saved: leave nothing that would mix into a retry
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
    (:func:`dlrmctl.launch.record_rank_failure`).

    Returns:
        exit code: 0 on success, 2 on user errors (:data:`USER_ERRORS`), 1 on any other error.
    """
    p = argparse.ArgumentParser(prog="python -m dlrmctl.train.worker")
    p.add_argument("config")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--resume", action="store_true")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--checkpoint", default=None)
    a = p.parse_args(argv)
    from dlrmctl.console import setup_logging

    setup_logging()
    try:
        run_training(a.config, a.overrides, resume=a.resume, overwrite=a.overwrite, checkpoint=a.checkpoint)
    except Exception as e:  # reported here (and recorded for the launcher), not as an uncaught traceback
        from dlrmctl.launch import record_rank_failure

        user_error = isinstance(e, USER_ERRORS)
        if user_error:
            print(f"error: {e}", file=sys.stderr)
        else:
            traceback.print_exc()
        record_rank_failure(e, user_error)
        return 2 if user_error else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
