"""Helpers shared by the command modules (no torch: imported for ``--help`` and config errors)."""

from __future__ import annotations

import difflib
import math
import os
from typing import NoReturn

from dlrmctl.errors import EXIT_USER, CommandError
from dlrmctl.console import echo, setup_logging, show_path  # noqa: F401  (re-exported for the commands)
from dlrmctl.train.checkpoint_names import BEST, CKPT_DIR, LATEST


def fail(msg: str, code: int = EXIT_USER) -> NoReturn:
    """End the command with one ``error: <msg>`` line and exit ``code``: raises a
    :class:`~dlrmctl.errors.CommandError`, which ``cli.report_failure`` prints (the one place
    that prints errors).

    Raises:
        CommandError: always.
    """
    raise CommandError(msg, code)


def check_number(option: str, value: int | float | None, minimum: int | float = 0, maximum: float | None = None,
                 positive: bool = True, what: str = "") -> None:
    """A numeric command-line option's value is finite, > 0 (``positive``) or >= ``minimum``, and
    <= ``maximum``; else one ``error: OPTION must be ..., got VALUE`` line and exit 2 (:func:`fail`).
    ``None`` (the option not given) passes.

    Args:
        option: the option as typed (``--batch-size``), for the message.
        minimum: smallest accepted value when ``positive`` is False (0: a count that may be zero).
        what: what the value is ("GB per rank"), added to the message.
    """
    if value is None:
        return
    ok = math.isfinite(value) and (value > 0 if positive else value >= minimum) and (maximum is None or value <= maximum)
    if not ok:
        rng = "> 0" if positive else f">= {minimum:g}"
        if maximum is not None:
            rng += f" and <= {maximum:,}" if isinstance(maximum, int) else f" and <= {maximum:g}"
        fail(f"{option} must be a finite number {rng}{f' ({what})' if what else ''}, got {value}")


def print_metrics(title: str, m: dict) -> None:
    """A metrics dict as an aligned block under ``title``."""
    echo(title)
    for k in ("auc", "logloss", "ne", "calibration", "accuracy", "ctr", "num_samples"):
        if k in m:
            v = m[k]
            echo(f"  {k:<12} {v:.6f}" if isinstance(v, float) and not math.isnan(v) else f"  {k:<12} {v}")


def checkpoint_choice(run_dir: str | os.PathLike, checkpoint: str | None) -> str:
    """Which checkpoint of the run directory ``run_dir`` ``--checkpoint`` (``checkpoint``; None: the
    default) selects, in words, for the first line of ``evaluate`` / ``export`` (before torch, no
    checkpoint read): ``checkpoint`` itself when given; else ``best`` when the run has a
    ``checkpoints/BEST`` marker, ``last (the run kept no best)`` when it has ``checkpoints/LATEST``
    alone, else ``best (last when the run kept no best)`` (the verb then says what it lacks).
    The names are :mod:`dlrmctl.train.checkpoint_names` (torch-free)."""
    if checkpoint:
        return checkpoint
    root = os.path.join(os.fspath(run_dir), CKPT_DIR)
    if os.path.isfile(os.path.join(root, BEST)):
        return "best"
    if os.path.isfile(os.path.join(root, LATEST)):
        return "last (the run kept no best)"
    return "best (last when the run kept no best)"


def require_run_dir(run_dir: str | os.PathLike) -> None:
    """Before torch: ``run_dir`` is a directory holding the ``config.yaml`` (or the ``checkpoints/``)
    a training run writes;
    else one ``error:`` line (:func:`fail`) that names the run directories beside it, so a
    mistyped name costs seconds, not the import of torch and a checkpoint read.

    Raises:
        CommandError: ``run_dir`` is missing, not a directory, or holds no ``config.yaml``.
    """
    path = os.fspath(run_dir)
    if os.path.isfile(os.path.join(path, "config.yaml")) or os.path.isdir(os.path.join(path, CKPT_DIR)):
        return  # (a run's checkpoints alone, e.g. copied without their config: the verb says what it lacks)
    parent = os.path.dirname(os.path.normpath(path)) or "."
    try:
        runs = sorted(d for d in os.listdir(parent) if os.path.isfile(os.path.join(parent, d, "config.yaml")))
    except OSError:
        runs = []
    near = difflib.get_close_matches(os.path.basename(os.path.normpath(path)), runs, n=1)
    hint = (f"did you mean {os.path.join(parent, near[0])}? " if near else "") + (
        f"runs in {parent}/: {', '.join(runs[:8])}{', …' if len(runs) > 8 else ''}" if runs
        else f"no training run directory in {parent}/ (dlrmctl train CONFIG makes one)")
    if not os.path.lexists(path):
        fail(f"{path}: no such run directory; {hint}")
    if not os.path.isdir(path):
        fail(f"{path}: not a directory (a training run directory is expected); {hint}")
    inner = sorted(d for d in os.listdir(path) if os.path.isfile(os.path.join(path, d, "config.yaml")))
    if inner:  # a directory of runs (runs/) given for one run
        hint = f"it holds the runs {', '.join(os.path.join(path, d) for d in inner[:8])}{', …' if len(inner) > 8 else ''}"
    fail(f"{path}: no config.yaml; not a dlrmctl run directory; {hint}")
