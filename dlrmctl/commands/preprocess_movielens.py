"""``dlrmctl preprocess movielens --input DIR --out OUT``: MovieLens -> columnar shards + meta.json.

Thin: parses options and calls :func:`dlrmctl.data.movielens.preprocess_movielens`.
"""

from __future__ import annotations

import typer

from dlrmctl.commands._common import fail
from dlrmctl.commands.options import ReplaceDataset

#: ``--val-ratio`` / ``--test-ratio``: split -> the option's default
RATIOS = {"val": 0.1, "test": 0.1}


def register(preprocess_app: typer.Typer) -> None:
    """Add the ``movielens`` command to the ``preprocess`` sub-app.

    Args:
        preprocess_app: the ``dlrmctl preprocess`` Typer group.
    """

    @preprocess_app.command("movielens", short_help="MovieLens ratings -> click labels, per-user time split")
    def movielens(
        input: str = typer.Option(..., "--input", help="unpacked MovieLens release: ml-100k, ml-1m, ml-10m, "
                                                       "ml-latest-small, ml-20m or ml-25m (detected by its files)"),
        out: str = typer.Option(..., "--out", help="output directory (columnar shards + meta.json)"),
        positive_threshold: float = typer.Option(4.0, "--positive-threshold",
                                                 help="ratings >= this many stars are positives (label 1)"),
        val_ratio: float = typer.Option(RATIOS["val"], "--val-ratio", help="fraction of each user's most recent ratings "
                                                                 "(before the test ones) for validation"),
        test_ratio: float = typer.Option(RATIOS["test"], "--test-ratio", help="fraction of each user's most recent ratings "
                                                                   "for test"),
        min_tag_count: int = typer.Option(2, "--min-tag-count", help="tags seen fewer times are dropped"),
        max_tags_per_item: int = typer.Option(16, "--max-tags-per-item", help="cap of a movie's tag bag"),
        zip_prefix_len: int = typer.Option(3, "--zip-prefix-len", help="zip code characters kept (user feature)"),
        force: ReplaceDataset = False,
    ) -> None:
        """MovieLens ratings -> click-style label (rating >= threshold), per-user time-ordered split."""
        from dlrmctl.data.movielens import MovieLensOptions, preprocess_movielens

        opts = MovieLensOptions(positive_threshold=positive_threshold, val_ratio=val_ratio, test_ratio=test_ratio,
                                min_tag_count=min_tag_count, max_tags_per_item=max_tags_per_item,
                                zip_prefix_len=zip_prefix_len)
        from dlrmctl.console import echo
        from dlrmctl.errors import check_output_dir

        import dataclasses
        import os
        from pathlib import Path

        from dlrmctl.commands.preprocess import build_unless_complete

        check_output_dir(out, "--out")  # a file, under a file, read-only: one line before any work
        if not os.path.isdir(input):  # the input's own error comes before any question about --out
            fail(f"{input}: not a directory (expected an unpacked MovieLens release)")
        recipe = {"dataset": "movielens", "input": os.path.abspath(input), "options": dataclasses.asdict(opts)}
        try:
            rep = build_unless_complete(Path(out), recipe, force, lambda d: preprocess_movielens(
                input, d, opts, progress=lambda msg: echo(msg, err=True)), ratios=RATIOS)
        except (ValueError, OSError) as e:  # (a DataError, a ValueError too, is the same line)
            fail(str(e))
        if rep is None:
            return
        typer.echo(f"{rep.release} -> {out} in {rep.seconds:.1f}s")
        for split in ("train", "val", "test"):
            c = rep.ctr.get(split)
            typer.echo(f"  {split:<5} {rep.rows[split]:>10,} rows  positive rate "
                       f"{'n/a' if c is None else f'{c:.4f}'}")
