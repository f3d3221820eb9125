"""The ``dlrmctl`` console script and ``python -m dlrmctl``: the command line is imported inside
a guard, so a Ctrl-C from the first instant on (while ``dlrmctl.cli`` imports Typer and registers
every verb, a tenth of a second or more) ends in the one ``error: interrupted ...`` line and exit
code 130, as it does once a verb runs, never in a traceback of the imports.
"""

from __future__ import annotations

import sys

__all__ = ["SUB_GROUPS", "main", "report_early_interrupt"]

#: the verbs that hold sub-verbs, whose command line names ``dlrmctl <group> <sub-verb>``: needed
#: before :mod:`dlrmctl.cli` is imported; the groups ``dlrmctl.cli.app`` registers must be these
#: (tests/test_errors.py)
SUB_GROUPS = frozenset({"preprocess", "checkpoint", "jobs"})


def report_early_interrupt(e: BaseException, argv: list[str]) -> int:
    """Print the interrupt line for an interrupt ``e`` that came before a verb ran (the verb and
    ``--out`` read from ``argv``, the arguments after the program name) to stderr; return the exit
    code (130 for SIGINT)."""
    from dlrmctl.errors import interrupt_exit_code, interrupted_message, out_option

    words = argv[:2] if argv[:1] and argv[0] in SUB_GROUPS else argv[:1]
    command = "dlrmctl " + " ".join(words) if words and not any(w.startswith("-") for w in words) else None
    print(f"error: {interrupted_message(e, command, out_option(argv))}", file=sys.stderr, flush=True)
    return interrupt_exit_code(e)


def main() -> None:
    """Run ``dlrmctl`` (:func:`dlrmctl.cli.main`) with its imports under the interrupt guard.

    Raises:
        SystemExit: the command's exit code; 130 for a Ctrl-C during the imports.
    """
    try:
        from dlrmctl.cli import main as cli_main
    except KeyboardInterrupt as e:
        sys.exit(report_early_interrupt(e, sys.argv[1:]))
    cli_main()
