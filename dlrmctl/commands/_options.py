"""Command-line options that several verbs share, each written once (no torch: imported for ``--help``).

Each is a Typer ``Annotated`` alias holding the option's names and help; the verb gives the default
in its own signature (``resume: Resume = False``), or none for a required option (``out:
DatasetOut``).  An option whose help differs between verbs stays in its verb.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

__all__ = ["CheckpointChoice", "DatasetOut", "Quiet", "ReplaceDataset", "Resume", "TestRatio", "ValRatio", "Workers"]

#: ``--checkpoint`` of a verb that reads one checkpoint of a run (``evaluate``, ``export``)
CheckpointChoice = Annotated[Optional[str], typer.Option(
    "--checkpoint", help="best | last | <step> | <name> (default: best when the run kept one, else last)")]

#: ``--resume`` of a verb that starts a run's training (``train``, ``launch``)
Resume = Annotated[bool, typer.Option("--resume", help="continue the run from its newest checkpoint")]

#: ``--out`` of a ``preprocess`` verb whose build resumes (``criteo``, ``logs``)
DatasetOut = Annotated[Path, typer.Option("--out", "-o", help="output directory (re-running it resumes)")]

#: ``--workers`` of a ``preprocess`` verb that runs one task per input file (``criteo``, ``logs``)
Workers = Annotated[int, typer.Option("--workers", min=1, help="worker processes (parallel across input files)")]

#: ``--quiet`` of a ``preprocess`` verb with a progress line (``criteo``, ``logs``)
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="no progress line")]

#: ``--force`` of a ``preprocess`` verb whose recipe records its inputs (``criteo``, ``logs``, ``movielens``)
ReplaceDataset = Annotated[bool, typer.Option(
    "--force", help="replace an existing dataset made from other inputs/options (built beside it, swapped in when "
    "complete)")]

#: ``--val-ratio`` / ``--test-ratio`` of a ``preprocess`` verb that splits rows by ratio (``logs``, ``synthetic``)
ValRatio = Annotated[float, typer.Option("--val-ratio", help="fraction of rows for validation")]
TestRatio = Annotated[float, typer.Option("--test-ratio", help="fraction of rows for test")]
