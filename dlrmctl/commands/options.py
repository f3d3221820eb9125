"""Command-line options that several verbs share, each written once (no torch: imported for ``--help``).

Each is a Typer ``Annotated`` alias holding the option's names and help; the verb gives the default
in its own signature (``resume: Resume = False``), or none for a required option (``out:
DatasetOut``).  An option whose help differs between verbs stays in its verb.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Annotated, Any, Callable, Mapping, Optional

import typer

from dlrmctl.commands._common import check_number

__all__ = ["CheckpointChoice", "DatasetOut", "NumberRange", "Quiet", "ReplaceDataset", "Resume", "TestRatio", "ValRatio",
           "Workers", "check_numbers", "int_list_option", "number_option"]

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


@dataclasses.dataclass(frozen=True)
class NumberRange:
    """The range of a numeric option (:func:`number_option`), as
    :func:`~dlrmctl.commands._common.check_number` takes it: finite, > 0 (``positive``) or >=
    ``minimum``, and <= the maximum: ``maximum``, else the value of the option ``at_most`` (its
    parameter name), else ``dlrmctl.config.INT_LIMITS[int_limit]`` (read when checked: the config
    package is not imported for ``--help``), else none.  ``what``: the value's unit, for the message."""

    option: str
    what: str
    minimum: float = 0
    maximum: float | None = None
    positive: bool = True
    at_most: str | None = None
    int_limit: str | None = None


def number_option(*names: str, help: str, what: str, min: int | None = None, **limits: Any) -> Any:
    """A Typer option of a number with its range (:class:`NumberRange`: ``minimum``, ``maximum``,
    ``positive``, ``at_most``, ``int_limit``), for ``Annotated[int, number_option(...)]``; the
    command checks it with :func:`check_numbers`.  ``min``: Click's own lower bound, shown in the help
    (``[x>=1]``) and refused as a usage error while the command line is parsed."""
    info = typer.Option(*names, help=help, **({} if min is None else {"min": min}))
    info.number_range = NumberRange(max(names, key=len), what, **limits)
    return info


def check_numbers(command: Callable, values: Mapping[str, Any]) -> None:
    """Check every :func:`number_option` of ``command`` (its parameters' values: ``values``, e.g. the
    command's ``locals()`` on entry) in the order they are declared; the first value out of its
    range is one ``error: OPTION must be ..., got VALUE`` line and exit 2.

    Raises:
        CommandError: a value out of its range (:func:`~dlrmctl.commands._common.check_number`).
    """
    for name, hint in typing.get_type_hints(command, include_extras=True).items():
        for r in (getattr(m, "number_range", None) for m in getattr(hint, "__metadata__", ())):
            if r is None:
                continue
            maximum = r.maximum
            if r.at_most is not None:
                maximum = values[r.at_most]
            elif r.int_limit is not None:
                from dlrmctl.config import INT_LIMITS

                maximum = INT_LIMITS[r.int_limit][0]
            check_number(r.option, values[name], minimum=r.minimum, maximum=maximum, positive=r.positive,
                         what=r.what)


def int_list_option(*names: str, help: str, n: int) -> Any:
    """A Typer option of one integer N or ``n`` comma-separated ones, each >= 1, for
    ``Annotated[Optional[str], int_list_option(...)]``: the command receives ``[N] * n`` or the ``n``
    integers as a list (None when not given); anything else is a usage error naming the option."""

    hint = max(names, key=len)

    def parse(value: Optional[str]) -> Optional[list[int]]:
        if value is None:
            return None
        try:
            xs = [int(x) for x in value.split(",") if x.strip() != ""]
        except ValueError:
            raise typer.BadParameter(f"expected integers separated by commas, got {value!r}", param_hint=hint) from None
        if len(xs) == 1:
            xs = xs * n
        if len(xs) != n:
            raise typer.BadParameter(f"expected 1 or {n} comma-separated integers, got {len(xs)}", param_hint=hint)
        if min(xs) < 1:
            raise typer.BadParameter(f"values must be >= 1, got {value!r}", param_hint=hint)
        return xs

    return typer.Option(*names, help=help, callback=parse)
