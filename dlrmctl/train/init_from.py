"""``dlrmctl train CONFIG --init-from RUN[/checkpoint]``: a new run that starts from a finished
run's weights, optimizer state and managed-collision remappers (day-by-day training: yesterday's
model, today's data), with its own schedule, step 0 and data position 0.

``RUN`` is a run directory (its last checkpoint) or one of its checkpoint directories
(``RUN/checkpoints/step_00000040``), or ``RUN/best`` / ``RUN/last`` / ``RUN/<step>``.  The new run
records where it started in ``init_from.json`` (checkpoint path, its step, the source run's name).
"""

from __future__ import annotations

import os
from typing import Any

from dlrmctl.train.checkpoint import CKPT_DIR, CheckpointError, load_checkpoint_meta, resolve_checkpoint

__all__ = ["INIT_FROM_FILE", "resolve_init_from", "restore_init_from"]

#: the file of a run directory that says which checkpoint the run started from
INIT_FROM_FILE = "init_from.json"


def resolve_init_from(spec: str) -> str:
    """The checkpoint directory ``--init-from SPEC`` names (see the module docstring).

    Raises:
        CheckpointError: naming ``--init-from`` and what was expected, when SPEC is neither a run
            directory with a checkpoint nor a checkpoint of one.
    """
    spec = str(spec).rstrip("/") or "/"
    if os.path.isfile(os.path.join(spec, "manifest.json")):  # an export holds no optimizer state or step
        raise CheckpointError(f"--init-from {spec}: an exported model (manifest.json), not a checkpoint; give the "
                              "run it was exported from (RUN, RUN/best, RUN/last or RUN/<step>)")
    if os.path.isfile(os.path.join(spec, "meta.json")) and os.path.basename(os.path.dirname(spec)) == CKPT_DIR:
        return resolve_checkpoint(os.path.dirname(os.path.dirname(spec)), spec)[0]
    if os.path.isdir(os.path.join(spec, CKPT_DIR)):
        return resolve_checkpoint(spec, "last")[0]
    parent, which = os.path.dirname(spec), os.path.basename(spec)
    if parent and os.path.isdir(os.path.join(parent, CKPT_DIR)):
        return resolve_checkpoint(parent, which)[0]
    raise CheckpointError(f"--init-from {spec}: not a run directory (no checkpoints/ in it) nor a checkpoint "
                          "of one; expected RUN, RUN/best, RUN/last, RUN/<step> or RUN/checkpoints/step_N")


def restore_init_from(path: str, trainer: Any) -> dict[str, Any]:
    """Load checkpoint ``path`` into ``trainer``'s model and optimizers (weights, optimizer state,
    remappers; any world size / plan), keep the new run's step 0, data position 0, schedule and
    RNG, and record the origin in ``<run_dir>/init_from.json`` and a line (main rank).  Collective.

    Returns:
        The record written: ``{"checkpoint", "step", "run"}``.

    Raises:
        CheckpointError: damaged files, or tables / dense layers / remappers / optimizer type
            that differ from the new model's (naming the table or key), prefixed ``--init-from``.
    """
    import torch

    from dlrmctl.fileio import write_text_atomic
    from dlrmctl.train.checkpoint import restore_checkpoint

    env = trainer.env
    rng = torch.get_rng_state()
    try:
        restore_checkpoint(path, trainer.model, trainer.optimizers, env.rank, env.world_size, env.pg,
                           plan=trainer.plan, device=env.device)
    except CheckpointError as e:
        raise CheckpointError(f"--init-from: {e}") from None
    torch.set_rng_state(rng)  # the new run's own draws (dropout, ...), not the source run's
    step = int(load_checkpoint_meta(path).get("step", 0))
    record = {"checkpoint": os.path.abspath(path), "step": step,
              "run": os.path.basename(os.path.dirname(os.path.dirname(os.path.abspath(path))))}
    if env.is_main:
        import json

        from dlrmctl.console import echo

        write_text_atomic(os.path.join(trainer.run_dir, INIT_FROM_FILE), json.dumps(record, indent=2) + "\n")
        echo(f"initialised from {record['checkpoint']} (step {step} of run {record['run']})")
    return record
