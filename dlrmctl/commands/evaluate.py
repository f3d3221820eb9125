"""``dlrmctl evaluate RUN_DIR|MODEL_DIR``: metrics of a trained run or an exported model on a split.

The data must be the data the model was trained on: its fingerprint (schema, vocabularies,
split; :mod:`dlrmctl.data.fingerprint`) is compared with the one the run or the export recorded.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Annotated, Optional

import typer

from dlrmctl.commands.options import CheckpointChoice, check_numbers, number_option
from dlrmctl.commands._common import (checkpoint_choice, echo, fail, print_metrics, require_run_dir,
                                     setup_logging, show_path)
from dlrmctl.console import stage, stages
from dlrmctl.yaml_file import read_yaml


def evaluate(
    run_dir: str = typer.Argument(..., help="runs/<name> (a training run) or an exported model directory"),
    split: str = typer.Option("val", "--split", help="val | test | train"),
    data: Optional[str] = typer.Option(None, "--data", help="preprocessed data directory (default: the run's; "
                                                             "required for an exported model)"),
    checkpoint: CheckpointChoice = None,
    any_split: bool = typer.Option(False, "--any-split", help="accept data whose split differs from the training "
                                                              "data's (same schema and vocabularies)"),
    batch_size: Annotated[Optional[int], number_option(
        "--batch-size", help="samples per evaluation batch (default: the run's data.eval_batch_size; 8192 for an "
        "exported model)", what="samples per batch", int_limit="eval_batch_size")] = None,
    output_json: bool = typer.Option(False, "--json", help="print the metrics as JSON"),
    artifact: Optional[str] = typer.Option(None, "--artifact", help="exported model: aoti | pt2 | torchscript "
                                                                     "(default: the fastest it holds for --device "
                                                                     "on a whole split: pt2, else aoti, else "
                                                                     "torchscript)"),
    device: Optional[str] = typer.Option(None, "--device", help="exported model: cpu | cuda[:i] | auto (default cpu)"),
) -> None:
    """Metrics (AUC, logloss, NE, calibration, accuracy) of a trained or exported model."""
    check_numbers(evaluate, locals())
    setup_logging()
    exported = os.path.exists(os.path.join(run_dir, "manifest.json"))
    if exported and data is None:
        fail(f"{run_dir} is an exported model: give --data DIR (the preprocessed data to evaluate on), e.g. "
             f"dlrmctl evaluate {run_dir} --data data/<name> --split val")
    if not exported:
        require_run_dir(run_dir)  # before torch: a mistyped run name answers in seconds
    if not exported and (artifact is not None or device is not None):
        fail(f"{run_dir} is a training run: --artifact and --device apply to an exported model (a run evaluates "
             "on its train.device)")
    if exported and checkpoint is not None:
        fail(f"{run_dir} is an exported model (one set of weights): --checkpoint applies to a run directory")
    progress = not output_json
    # a line per step with its start time (stdout, not with --json): the first one before torch is imported
    with stages("evaluate") if progress else contextlib.nullcontext():
        stage(_what(run_dir, exported, split, data, checkpoint))
        # user errors (dlrmctl.errors.UserError) are reported by dlrmctl.cli, once for every verb
        if exported:
            from dlrmctl.inference.export import evaluate_exported
            from dlrmctl.inference.formats import resolve_device

            m = evaluate_exported(run_dir, data, split, 8192 if batch_size is None else batch_size,
                                  device=resolve_device(device or "cpu"), any_split=any_split, progress=progress,
                                  artifact=artifact, announce=lambda what: echo(f"evaluate: running {what}", err=True))
            which = "exported model"
        else:
            from dlrmctl.train.checkpoint import read_checkpoint
            from dlrmctl.train.reload import evaluate_run, run_config

            run_config(run_dir)  # a run directory at all?
            # read_checkpoint: a checkpoint the run prunes (keep_last) meanwhile is re-resolved / named as pruned
            m, which = read_checkpoint(run_dir, checkpoint, lambda path, label: (
                evaluate_run(run_dir, split, data, batch_size, checkpoint=path, any_split=any_split,
                             progress=progress), label))
            m = dict(m, checkpoint=which)
    if output_json:
        echo(json.dumps(m))
    else:
        print_metrics(f"{run_dir} [{split}], checkpoint {which}" if not exported else f"{run_dir} [{split}]", m)


def _what(run_dir: str, exported: bool, split: str, data: Optional[str], checkpoint: Optional[str]) -> str:
    """The first line of ``evaluate``: what it evaluates, on which split of which data (no torch: the
    run's data path is read from its config.yaml as YAML)."""
    if exported:
        return f"evaluating the exported model {show_path(run_dir)} on split '{split}' of {show_path(data)}"
    if data is None:
        try:
            data = read_yaml(os.path.join(run_dir, "config.yaml"), ValueError, "config")["data"]["path"]
        except (ValueError, KeyError, TypeError):  # the verb itself reports a damaged config
            data = "the run's data"
    which = checkpoint_choice(run_dir, checkpoint)  # from the run's BEST / LATEST markers
    return f"evaluating {show_path(run_dir)}, checkpoint {which}, on split '{split}' of {show_path(data)}"


def register(app: typer.Typer) -> None:
    """Add ``evaluate`` to the main ``dlrmctl`` app."""
    app.command("evaluate", short_help="AUC, logloss, NE, calibration of a trained/exported model")(evaluate)
