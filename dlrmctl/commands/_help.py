"""How ``--help`` reads in a terminal of any width (no torch: imported with the app).

Typer's boxed Rich tables cut long option names at 80 columns (``--multi-hot-distribu…``), show
``<bool>`` after every flag and write a required argument as ``{config}`` in the usage line; its
plain layout writes a value's Python type (``--set <list[str]>``, ``--nproc <int range>``,
``CONFIG <str>``) and wraps ``[default: 1; x>=1]`` across two lines.  :func:`plain_help` turns
every command of the app to Click's plain layout — an option's name is never cut (its text moves
to the next line instead), a flag shows no value type — writes arguments as Click does,
``CONFIG`` (required) or ``[CONFIG]`` (optional), gives each option a metavar that says what to
write (``PATH``, ``DIR``, ``N``, ``KEY=VALUE``, :data:`METAVARS`), and keeps a short
``[default: …]`` on one line; a Markdown `code` span (Rich would style it) is printed as 'code'.
"""

from __future__ import annotations

import re
from typing import Any, get_args

__all__ = ["METAVARS", "metavar_for", "plain_help"]

#: an option's metavar by its long name, where its type alone would not say what to write
METAVARS: dict[str, str] = {
    "--set": "KEY=VALUE", "--scheduler-arg": "KEY=VALUE", "--grid": "KEY=V1,V2,...",
    "--out": "DIR", "--data": "DIR", "--input": "PATH", "--output": "PATH", "--plan": "PATH",
    "--topology": "PATH", "--schema": "PATH", "--report": "PATH",
    "--init-from": "RUN", "--checkpoint": "WHICH", "--split": "SPLIT", "--parity-split": "SPLIT",
    "--split-by": "row|time", "--on-bad-line": "error|skip", "--multi-hot-distribution": "uniform|pareto",
    "--weights-precision": "fp32|fp16", "--artifact": "FORMAT", "--device": "DEVICE", "--scheduler": "NAME",
    "--name": "NAME", "--image": "IMAGE", "--host": "HOST", "--port": "PORT", "--mem": "SIZE",
    "--num-embeddings": "N[,N...]", "--multi-hot-sizes": "N[,N...]",
    "--weighted-features": "NAMES", "--interaction-features": "NAMES", "--timeout": "SECONDS",
}

#: a unit at the end of a number option's name -> its metavar (``--max-delay-ms MS``)
_UNITS = {"ms": "MS", "s": "SECONDS", "mb": "MB", "gb": "GB"}

#: stands for a space / hyphen inside a short ``[default: …]`` while the help is wrapped
_NBSP, _NBHYPHEN = "\u00a0", "\u2011"
#: the longest bracket kept on one line: narrower than the help column at Click's narrowest layout
_KEEP_WHOLE = 40


def metavar_for(param: Any) -> str:
    """The metavar of a value option (a Click / Typer option): its own when the code set one, else
    :data:`METAVARS` by its long name, else one from its type: ``a|b`` (choices), ``N`` (an integer),
    ``MS`` / ``SECONDS`` / ``MB`` / ``GB`` (a number named with that unit), ``X`` (another number),
    ``PATH`` (a path), else its name in capitals."""
    if getattr(param, "metavar", None):
        return param.metavar
    long = max(param.opts, key=len)
    if long in METAVARS:
        return METAVARS[long]
    kind, choices = _value_kind(param)
    if choices:
        return "|".join(choices)
    unit = _UNITS.get(long.rsplit("-", 1)[-1])
    if kind in ("int", "float") and unit:
        return unit
    if kind in ("int", "float", "path"):
        return {"int": "N", "float": "X", "path": "PATH"}[kind]
    return long.lstrip("-").replace("-", "_").upper()


def _value_kind(param: Any) -> tuple[str, list[str]]:
    """(``int`` | ``float`` | ``path`` | ``other``, the choices) of an option's value: from Typer's
    type descriptor (its annotation), or from a Click option's ``type``."""
    desc = getattr(param, "type_descriptor", None)
    if desc is None:  # a plain Click option
        name = getattr(getattr(param, "type", None), "name", "")
        choices = [str(c) for c in getattr(getattr(param, "type", None), "choices", None) or ()]
        kind = {"integer": "int", "integer range": "int", "float": "float", "float range": "float", "path": "path"}
        return kind.get(name, "other"), choices
    choices = [str(getattr(c, "value", c)) for c in desc.choices or ()]
    ann = get_args(desc.annotation)[0] if desc.is_list and get_args(desc.annotation) else desc.annotation
    if desc.is_path:
        return "path", choices
    return {int: "int", float: "float"}.get(ann, "other"), choices


def _usage_piece(arg: Any) -> str:
    piece = arg.metavar if arg.required else f"[{arg.metavar}]"
    return piece + ("..." if arg.nargs != 1 else "")


def _whole_tail(record: tuple[str, str] | None) -> tuple[str, str] | None:
    """A help record whose short closing ``[default: …; …]`` cannot be wrapped in its middle."""
    if record is None:
        return None
    name, text = record
    m = re.search(r"(\[[^\[\]\n]*\])$", text)
    if m and len(m.group(1)) <= _KEEP_WHOLE:
        text = text[:m.start(1)] + m.group(1).replace(" ", _NBSP).replace("-", _NBHYPHEN)
    return name, text


def _plain_text(text: str) -> str:
    """The help as printed: the wrap's stand-ins back to a space / hyphen, and each `code` span of
    the docstrings and option texts (Markdown for Rich, raw in the plain layout) quoted as 'code'
    (the same width, so the wrapping is unchanged)."""
    text = text.replace(_NBSP, " ").replace(_NBHYPHEN, "-")
    return re.sub(r"`([^`]+)`", r"'\1'", text)


def plain_help(command: Any) -> None:
    """Set ``command`` and every command below it (a Typer/Click command tree) to the plain help
    layout: Rich markup off; each argument's metavar its name in capitals, shown without a type,
    its usage piece ``NAME`` / ``[NAME]``; each value option's metavar :func:`metavar_for`; a
    short ``[default: …]`` never wrapped across lines; a `code` span printed as 'code'."""
    if hasattr(command, "rich_markup_mode"):
        command.rich_markup_mode = None
    for p in getattr(command, "params", ()):
        kind = getattr(p, "param_type_name", None)
        if kind == "argument":
            p.metavar = p.metavar or (p.name or "").upper()
            p.get_usage_pieces = lambda ctx, piece=_usage_piece(p): [piece]
            p.display_type_rich = lambda ctx=None: None
        elif kind == "option" and not (p.is_flag or p.count):
            p.metavar = metavar_for(p)
        if kind in ("argument", "option"):
            p.get_help_record = lambda ctx, own=p.get_help_record: _whole_tail(own(ctx))
    command.get_help = lambda ctx, own=command.get_help: _plain_text(own(ctx))
    for sub in getattr(command, "commands", {}).values():
        plain_help(sub)
