"""Helpers shared by the command modules (no torch: imported for ``--help`` and config errors)."""

from __future__ import annotations

import math

import typer

from dlrmctl.console import echo, setup_logging, show_path  # noqa: F401  (re-exported for the commands)


def fail(msg: str, code: int = 2) -> None:
    """One ``error: ...`` line on stderr and exit ``code`` (no traceback)."""
    echo(f"error: {msg}", err=True)
    raise typer.Exit(code)


def print_metrics(title: str, m: dict) -> None:
    """A metrics dict as an aligned block under ``title``."""
    echo(title)
    for k in ("auc", "logloss", "ne", "calibration", "accuracy", "ctr", "num_samples"):
        if k in m:
            v = m[k]
            echo(f"  {k:<12} {v:.6f}" if isinstance(v, float) and not math.isnan(v) else f"  {k:<12} {v}")
