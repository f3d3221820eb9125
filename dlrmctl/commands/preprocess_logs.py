"""``dlrmctl preprocess logs --schema S.yaml --input PATH... --out DIR``: any click log described by
a schema -> columnar shards + meta.json.

Thin: parses options and calls :func:`dlrmctl.data.logs.preprocess_logs`.
"""

from __future__ import annotations

from pathlib import Path
from typing import List

import typer

from dlrmctl.commands.options import DatasetOut, Quiet, ReplaceDataset, TestRatio, ValRatio, Workers


def register(preprocess_app: typer.Typer) -> None:
    """Add the ``logs`` command to the ``preprocess`` sub-app."""

    @preprocess_app.command("logs", short_help="Any click log (CSV/TSV/Parquet/JSON lines) via a schema")
    def logs(
        schema: Path = typer.Option(..., "--schema", "-s", help="the log's schema (YAML: columns, label, dense "
                                    "and categorical features; docs/data.md)"),
        input: List[str] = typer.Option(..., "--input", "-i", help="CSV / TSV / Parquet / JSON-lines file(s), "
                                        "plain or compressed; a file, a directory or a glob (repeatable)"),
        out: DatasetOut = ...,
        val_ratio: ValRatio = 0.0,
        test_ratio: TestRatio = 0.0,
        seed: int = typer.Option(0, help="seed of the row-hash split"),
        split_by: str = typer.Option(None, help="'row' (hash of file and line) or 'time' (the latest slices of "
                                     "the schema's time column are test, the ones before them val; per group with "
                                     "the schema's split.group); default: the schema's split.by, else row"),
        on_bad_line: str = typer.Option("error", help="'error' (stop, naming file:line and column) or 'skip' "
                                        "(count)"),
        workers: Workers = 1,
        quiet: Quiet = False,
        force: ReplaceDataset = False,
    ) -> None:
        """Any click log (CSV / TSV / Parquet / JSON lines) described by a schema -> columnar shards +
        meta.json."""
        from dlrmctl.commands._common import fail
        from dlrmctl.commands.preprocess import build_unless_complete, print_summary, stat_inputs
        from dlrmctl.data.logs import LogOptions, load_schema, preprocess_logs
        from dlrmctl.data.logs.split import split_mode
        from dlrmctl.errors import check_output_dir
        from dlrmctl.procs import FanoutError, check_local_fanout

        sch = load_schema(schema)  # a bad schema: one line, before anything else
        opts = LogOptions(val_ratio=val_ratio, test_ratio=test_ratio, seed=seed, split_by=split_by,
                          on_bad_line=on_bad_line, workers=workers)
        try:
            opts.validate(sch)
            opts.split_by = split_mode(opts.split_by, sch)  # the recipe records the split made
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
        check_output_dir(out, "--out")
        try:
            check_local_fanout(workers, f"--workers {workers}")
        except FanoutError as e:
            fail(str(e))
        inputs = stat_inputs(input)
        for i in inputs:
            sch.format_of(i["path"])
        if sch.join:  # the side tables are inputs too
            from dlrmctl.data.logs.join import side_path

            inputs = inputs + stat_inputs([str(side_path(j, [Path(i["path"]) for i in inputs])) for j in sch.join])
        recipe = {"dataset": "logs", "schema": sch.to_dict(), "inputs": inputs,
                  "options": {k: v for k, v in vars(opts).items() if k != "workers"}}
        rep = build_unless_complete(out, recipe, force, lambda d: preprocess_logs(
            sch, input if len(input) > 1 else input[0], d, opts, progress=not quiet), interruptible=True)
        if rep is not None:
            print_summary(rep, out)
