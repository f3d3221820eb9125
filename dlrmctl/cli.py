"""``dlrmctl``: the command line — the Typer app and its verbs' registrations, nothing else.

Every verb lives in :mod:`dlrmctl.commands` and imports what it needs (torch,
pyarrow, torchx) inside the command, so ``dlrmctl --help`` and configuration
errors answer without importing torch.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    help="Train, shard, plan and ship DLRM recommendation models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

#: command modules with ``register(app)``, in the order ``--help`` lists them
COMMANDS = ("version", "train", "sweep", "evaluate", "plan", "export", "report", "checkpoint_cmd", "launch_cmd")


def _register() -> None:
    from dlrmctl.commands import preprocess, preprocess_movielens

    preprocess_movielens.register(preprocess.app)
    app.add_typer(preprocess.app, name="preprocess", help="raw logs -> columnar shards + meta.json")
    for mod in COMMANDS:
        importlib.import_module(f"dlrmctl.commands.{mod}").register(app)


_register()


def main() -> None:
    """Console-script entry point (``dlrmctl``)."""
    app()


if __name__ == "__main__":
    main()
