"""Helpers shared by the command modules (no torch: imported for ``--help`` and config errors)."""

from __future__ import annotations

import math
import os

import typer

from dlrmctl.console import echo, setup_logging  # noqa: F401  (re-exported for the commands)


def fail(msg: str, code: int = 2) -> None:
    """One ``error: ...`` line on stderr and exit ``code`` (no traceback)."""
    echo(f"error: {msg}", err=True)
    raise typer.Exit(code)


def show_path(path: str | os.PathLike) -> str:
    """How dlrmctl prints a path: relative to the working directory when it is below it, else absolute."""
    p = os.path.abspath(os.fspath(path))
    rel = os.path.relpath(p)
    return p if rel == ".." or rel.startswith(".." + os.sep) else rel


def print_metrics(title: str, m: dict) -> None:
    """A metrics dict as an aligned block under ``title``."""
    echo(title)
    for k in ("auc", "logloss", "ne", "calibration", "accuracy", "ctr", "num_samples"):
        if k in m:
            v = m[k]
            echo(f"  {k:<12} {v:.6f}" if isinstance(v, float) and not math.isnan(v) else f"  {k:<12} {v}")


def user_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that are the user's input (reported as one line); imports torch."""
    from dlrmctl.train.worker import USER_ERRORS

    return USER_ERRORS
