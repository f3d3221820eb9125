"""``dlrmctl evaluate RUN_DIR|MODEL_DIR``: metrics of a trained run or an exported model on a split."""

from __future__ import annotations

import json
import os
from typing import Optional

import typer

from dlrmctl.commands._common import echo, fail, print_metrics, setup_logging, user_errors


def evaluate(
    run_dir: str = typer.Argument(..., help="runs/<name> (a training run) or an exported model directory"),
    split: str = typer.Option("val", "--split", help="val | test | train"),
    data: Optional[str] = typer.Option(None, "--data", help="preprocessed data directory (default: the run's)"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size"),
    output_json: bool = typer.Option(False, "--json", help="print the metrics as JSON"),
) -> None:
    """Metrics (AUC, logloss, NE, calibration, accuracy) of a trained or exported model."""
    setup_logging()
    if os.path.exists(os.path.join(run_dir, "manifest.json")) and data is None:
        fail("an exported model needs --data DIR (the preprocessed data to evaluate on)")
    errors = user_errors()
    try:
        if os.path.exists(os.path.join(run_dir, "manifest.json")):
            from dlrmctl.inference.export import evaluate_exported

            m = evaluate_exported(run_dir, data, split, batch_size or 8192)
        else:
            from dlrmctl.train.loop import evaluate_run

            m = evaluate_run(run_dir, split, data, batch_size)
    except errors as e:
        fail(str(e))
    if output_json:
        echo(json.dumps(m))
    else:
        print_metrics(f"{run_dir} [{split}]", m)


def register(app: typer.Typer) -> None:
    """Add ``evaluate`` to the main ``dlrmctl`` app."""
    app.command("evaluate")(evaluate)
