"""``dlrmctl``: the command line — the Typer app and its verbs' registrations, nothing else.

Every verb lives in :mod:`dlrmctl.commands` and imports what it needs (torch,
pyarrow, torchx) inside the command, so ``dlrmctl --help`` and configuration
errors answer without importing torch.
"""

from __future__ import annotations

import importlib
import signal
import sys

import typer
from typer.core import TyperGroup

from dlrmctl.errors import (EXIT_FAILED, EXIT_USER, CommandError, ProcessFailure, command_of, find_in_chain,
                            interrupt_exit_code, interrupt_of, interruptible, interrupted_message,
                            user_error_message)


def report_failure(e: BaseException, command: str | None = None, out: str | None = None) -> int | None:
    """The one place a failure of a verb becomes what the user sees: an interrupt (Ctrl-C, a
    SIGTERM a command turned into one, or either wrapped by a library such as DCP) that the verb
    did not report itself is one ``error: interrupted (SIGINT): ...`` line naming ``command`` (e.g.
    ``dlrmctl export``) and its ``out`` (the ``--out`` given, if any) and saying what is left (exit
    code 130, 143 for SIGTERM); a :class:`~dlrmctl.errors.UserError` or an OSError of the user's
    environment (also wrapped) is one ``error: ...`` line (exit code 2), a
    :class:`~dlrmctl.errors.ProcessFailure` (a loader worker killed) one line with exit code 1, all
    on stderr.  Returns the exit code, or None for anything else (a bug: the caller lets it
    propagate with its traceback).  A command's own refusal (:class:`~dlrmctl.errors.CommandError`,
    ``commands._common.fail``) is its line and its exit code, also when raised while handling an
    interrupt (that is how a verb that knows more says what it stopped and what is left)."""
    if isinstance(e, CommandError):
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    ki = interrupt_of(e)
    if ki is not None:
        print(f"error: {interrupted_message(ki, command, out)}", file=sys.stderr, flush=True)
        return interrupt_exit_code(ki)
    msg = user_error_message(e)
    if msg is None:
        failed = find_in_chain(e, ProcessFailure, implicit=False)
        if failed is not None:
            print(f"error: {failed}", file=sys.stderr, flush=True)
            return EXIT_FAILED
        return None
    print(f"error: {msg}", file=sys.stderr, flush=True)
    return EXIT_USER


#: verbs that handle SIGTERM themselves (train and launch clean up their ranks, sweep its points,
#: serve drains its requests and exits 0); every other verb is ended by one like a Ctrl-C
OWN_SIGTERM = frozenset({"train", "launch", "sweep", "serve"})


class _Group(TyperGroup):
    """The root command group: every verb runs inside :meth:`invoke`, so its user errors, OS
    conditions and interrupts are reported once, here (:func:`report_failure`) — also under
    ``typer.testing.CliRunner``, which calls the group, not :func:`main`.  A usage error (a bad
    option value, an unknown option or command, a missing argument, ``typer.BadParameter`` from a
    command) is ONE line too, ``error: <command>: <message> (see <command> --help)``, exit code 2.
    A SIGTERM ends a verb as a Ctrl-C does (``error: interrupted (SIGTERM): ...``, exit code 143), except the verbs of
    :data:`OWN_SIGTERM`.  ``--help`` of every verb has Click's plain layout
    (:func:`dlrmctl.commands._help.plain_help`)."""

    def __init__(self, *args, **kwargs) -> None:
        from dlrmctl.commands._help import plain_help

        super().__init__(*args, **kwargs)
        plain_help(self)

    def invoke(self, ctx):  # noqa: D102
        from typer import _click

        command, out = None, None
        try:
            first = getattr(ctx, "_protected_args", None) or ctx.protected_args
            verb = next(iter([*first, *ctx.args]), None)
            command, out = command_of(ctx)
            if verb in OWN_SIGTERM:
                return super().invoke(ctx)
            with interruptible((signal.SIGTERM,)):  # a SIGTERM ends the verb as a Ctrl-C does: one line
                return super().invoke(ctx)
        except _click.exceptions.UsageError as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # `dlrmctl preprocess`: the help was the answer
                raise
            where = e.ctx.command_path if e.ctx is not None else ctx.command_path
            msg = " ".join(line.strip() for line in e.format_message().splitlines() if line.strip())
            typer.echo(f"error: {where}: {msg} (see `{where} --help`)", err=True)
            raise typer.Exit(e.exit_code) from None
        except (typer.Exit, typer.Abort, typer.TyperException, SystemExit):  # typer's own exits
            raise
        except BaseException as e:  # noqa: BLE001 - reported as one line, or re-raised as it is
            code = report_failure(e, command, out)
            if code is None:
                raise
            raise typer.Exit(code) from None


app = typer.Typer(
    cls=_Group,
    help="Train, shard, plan and ship DLRM recommendation models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

#: command modules with ``register(app)``, in the order ``--help`` lists them
COMMANDS = ("version", "train", "sweep", "evaluate", "plan", "export", "serve", "report", "checkpoint_cmd", "launch_cmd", "jobs_cmd")


def _register() -> None:
    from dlrmctl.commands import preprocess
    from dlrmctl.data.datasets import DATASETS

    for ds in DATASETS.values():  # each dataset's own `preprocess <name>` verb
        if ds.command_module:
            importlib.import_module(ds.command_module).register(preprocess.app)
    app.add_typer(preprocess.app, name="preprocess", help="Raw logs -> columnar shards + meta.json")
    for mod in COMMANDS:
        importlib.import_module(f"dlrmctl.commands.{mod}").register(app)


_register()


def main() -> None:
    """Console-script entry point (``dlrmctl``).

    Started by another dlrmctl process (a ``sweep`` point: ``$DLRMCTL_LAUNCHER`` names it), this
    one ends (SIGTERM) when that one does."""
    try:
        from dlrmctl.procs import die_with_launcher

        die_with_launcher(signal.SIGTERM)
        app()
    except KeyboardInterrupt as e:  # before a verb runs (Typer building the command line): the same one line
        from dlrmctl.entry import report_early_interrupt

        sys.exit(report_early_interrupt(e, sys.argv[1:]))


if __name__ == "__main__":  # python -m dlrmctl.cli (python -m dlrmctl also guards the imports: dlrmctl.entry)
    main()
