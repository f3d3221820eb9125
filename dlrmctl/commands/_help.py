"""How ``--help`` reads in a terminal of any width (no torch: imported with the app).

Typer's boxed Rich tables cut long option names at 80 columns (``--multi-hot-distribu…``), show
``<bool>`` after every flag and write a required argument as ``{config}`` in the usage line.
:func:`plain_help` turns every command of the app to Click's plain layout — an option's name is
never cut (its text moves to the next line instead), a flag shows no value type — and writes
arguments as Click does, ``CONFIG`` (required) or ``[CONFIG]`` (optional), in the usage line and
the argument list alike.
"""

from __future__ import annotations

from typing import Any

__all__ = ["plain_help"]


def _usage_piece(arg: Any) -> str:
    piece = arg.metavar if arg.required else f"[{arg.metavar}]"
    return piece + ("..." if arg.nargs != 1 else "")


def plain_help(command: Any) -> None:
    """Set ``command`` and every command below it (a Typer/Click command tree) to the plain help
    layout: Rich markup off, each argument's metavar its name in capitals, each argument's usage
    piece ``NAME`` / ``[NAME]``."""
    if hasattr(command, "rich_markup_mode"):
        command.rich_markup_mode = None
    for p in getattr(command, "params", ()):
        if getattr(p, "param_type_name", None) == "argument":
            p.metavar = p.metavar or (p.name or "").upper()
            p.get_usage_pieces = lambda ctx, piece=_usage_piece(p): [piece]
    for sub in getattr(command, "commands", {}).values():
        plain_help(sub)
