"""``dlrmctl``: the command line — the Typer app and its verbs' registrations, nothing else.

Every verb lives in :mod:`dlrmctl.commands` and imports what it needs (torch,
pyarrow, torchx) inside the command, so ``dlrmctl --help`` and configuration
errors answer without importing torch.
"""

from __future__ import annotations

import importlib

import typer
import typer.core


class _OneLineErrors(typer.core.TyperGroup):
    """The root command: a usage error (a bad option value, an unknown option or command, a missing
    argument; ``typer.BadParameter`` from a command) is printed as ONE line,
    ``error: <command>: <message> (see <command> --help)``, exit code 2, like every other user error."""

    def invoke(self, ctx):
        from typer import _click

        try:
            return super().invoke(ctx)
        except _click.exceptions.UsageError as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # `dlrmctl preprocess`: the help was the answer
                raise
            where = e.ctx.command_path if e.ctx is not None else ctx.command_path
            msg = " ".join(line.strip() for line in e.format_message().splitlines() if line.strip())
            typer.echo(f"error: {where}: {msg} (see `{where} --help`)", err=True)
            raise typer.Exit(e.exit_code) from None


app = typer.Typer(
    cls=_OneLineErrors,
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
    """Console-script entry point (``dlrmctl``).

    Started by another dlrmctl process (a ``sweep`` point: ``$DLRMCTL_LAUNCHER`` names it), this
    one ends (SIGTERM) when that one does."""
    import signal

    from dlrmctl.procs import die_with_launcher

    die_with_launcher(signal.SIGTERM)
    app()


if __name__ == "__main__":
    main()
