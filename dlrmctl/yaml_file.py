"""Reading a YAML file whose top level must be a mapping (configs, sharding plans, topology files),
with errors that name the file — and the line, for a syntax error — in the caller's error type."""

from __future__ import annotations

import os
from typing import Any


def read_yaml(path: str | os.PathLike, error: type[Exception], what: str) -> Any:
    """``yaml.safe_load`` of ``path`` (``None`` for an empty file).

    Args:
        error: the exception type to raise (ConfigError, PlanError, PlannerError, ...).
        what: what the file holds, for messages ("config", "plan", "topology file").

    Raises:
        error: unreadable file (``<path>: cannot read <what>: <reason>``) or invalid YAML
            (``<path>:<line>: invalid YAML in <what>: <problem>``).
    """
    import yaml

    path = os.fspath(path)
    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except OSError as e:
        raise error(f"{path}: cannot read {what}: {e.strerror or e}") from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else path
        raise error(f"{where}: invalid YAML in {what}: {getattr(e, 'problem', None) or e}") from e


def read_yaml_mapping(path: str | os.PathLike, error: type[Exception], what: str, expected: str = "") -> dict:
    """:func:`read_yaml`, and the top level must be a mapping.

    Args:
        what: the file's kind, short ("topology file"): every message names it.
        expected: what the mapping should hold ("keys a, b, ..."), added only to the message of a
            file that was read but holds no mapping (not to a missing or unreadable file's).

    Raises:
        error: as :func:`read_yaml` (``<path>: cannot read <what>: <OS error>``, one line), or the
            top level is not a mapping (an empty file included).
    """
    d = read_yaml(path, error, what)
    if not isinstance(d, dict):
        raise error(f"{os.fspath(path)}: expected a mapping at the top level of the {what}"
                    f"{f' ({expected})' if expected else ''}, got {'an empty file' if d is None else type(d).__name__}")
    return d
