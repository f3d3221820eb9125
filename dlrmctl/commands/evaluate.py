"""``dlrmctl evaluate RUN_DIR|MODEL_DIR``: metrics of a trained run or an exported model on a split.

The data must be the data the model was trained on: its fingerprint (schema, vocabularies,
split; :mod:`dlrmctl.data.fingerprint`) is compared with the one the run or the export recorded.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import typer

from dlrmctl.commands._common import echo, fail, print_metrics, setup_logging, user_errors


def evaluate(
    run_dir: str = typer.Argument(..., help="runs/<name> (a training run) or an exported model directory"),
    split: str = typer.Option("val", "--split", help="val | test | train"),
    data: Optional[str] = typer.Option(None, "--data", help="preprocessed data directory (default: the run's; "
                                                             "required for an exported model)"),
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint", help="best | last | <step> | <name> (default: best when "
                                                                         "the run kept one, else last)"),
    any_split: bool = typer.Option(False, "--any-split", help="accept data whose split differs from the training "
                                                              "data's (same schema and vocabularies)"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size"),
    output_json: bool = typer.Option(False, "--json", help="print the metrics as JSON"),
) -> None:
    """Metrics (AUC, logloss, NE, calibration, accuracy) of a trained or exported model."""
    setup_logging()
    exported = os.path.exists(os.path.join(run_dir, "manifest.json"))
    if exported and data is None:
        fail(f"{run_dir} is an exported model: give --data DIR (the preprocessed data to evaluate on), e.g. "
             f"dlrmctl evaluate {run_dir} --data data/<name> --split val")
    if exported and checkpoint is not None:
        fail(f"{run_dir} is an exported model (one set of weights): --checkpoint applies to a run directory")
    errors = user_errors()
    progress = not output_json
    try:
        if exported:
            from dlrmctl.inference.export import evaluate_exported

            m = evaluate_exported(run_dir, data, split, batch_size or 8192, any_split=any_split, progress=progress)
            which = "exported model"
        else:
            from dlrmctl.train.checkpoint import resolve_checkpoint
            from dlrmctl.train.reload import evaluate_run, run_config

            run_config(run_dir)  # a run directory at all?
            path, which = resolve_checkpoint(run_dir, checkpoint)
            m = evaluate_run(run_dir, split, data, batch_size, checkpoint=path, any_split=any_split,
                             progress=progress)
            m = dict(m, checkpoint=which)
    except errors as e:
        fail(str(e))
    if output_json:
        echo(json.dumps(m))
    else:
        print_metrics(f"{run_dir} [{split}], checkpoint {which}" if not exported else f"{run_dir} [{split}]", m)


def register(app: typer.Typer) -> None:
    """Add ``evaluate`` to the main ``dlrmctl`` app."""
    app.command("evaluate")(evaluate)
