"""Reading an experiment config: the YAML file, ``--set`` overrides, the conversion of the raw
mapping onto the :mod:`dlrmctl.config.schema` dataclasses (strict: an unknown key, a missing
required key or a value of the wrong type is a :class:`~dlrmctl.config.schema.ConfigError`
naming the key path), then :func:`dlrmctl.config.validation.validate`.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import enum
import os
import re
import types
import typing
from typing import Any, Literal

import yaml

from dlrmctl.config.schema import ConfigError, ExperimentConfig
from dlrmctl.config.validation import validate
from dlrmctl.yaml_file import short_repr


def type_name(tp: Any) -> str:
    """A type hint as the errors and the configuration reference spell it: ``int | null``,
    ``'sum' | 'mean'``, ``list[int]``, ``mapping of mapping``."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{type_name(typing.get_args(tp)[0])}]"
    if origin is dict:
        return f"mapping of {type_name(typing.get_args(tp)[1])}"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Convert a YAML value to ``tp``, raising ConfigError naming ``path``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, path)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1 and isinstance(value, dict):  # a mapping or null: the mapping's own error
            raise errors[0]
        raise ConfigError(f"{path}: expected {type_name(tp)}, got {short_repr(value)}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{path}: expected one of {list(allowed)}, got {short_repr(value)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected {type_name(tp)}, got {short_repr(value)}")
        (et,) = typing.get_args(tp)
        return [_convert(v, et, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected {type_name(tp)}, got {short_repr(value)}")
        _, vt = typing.get_args(tp)
        return {str(k): _convert(v, vt, f"{path}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return _build_dataclass(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected bool (true/false), got {short_repr(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected int, got {short_repr(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            # YAML 1.1 reads "1e-8" as a string; accept numeric strings for floats.
            if isinstance(value, str):
                try:
                    return float(value)
                except ValueError:
                    pass
            raise ConfigError(f"{path}: expected float, got {short_repr(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected str, got {short_repr(value)}")
        return value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(f"{path}: expected one of {[e.value for e in tp]}, got {short_repr(value)}") from None
    raise ConfigError(f"{path}: unsupported type {tp}")  # pragma: no cover


def _build_dataclass(cls: Any, value: Any, path: str) -> Any:
    where = path or "<root>"
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping, got {short_repr(value)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in value if k not in fields]
    if unknown:
        k = unknown[0]
        near = difflib.get_close_matches(str(k), list(fields), n=1)
        raise ConfigError(
            f"{path + '.' if path else ''}{k}: unknown key{f' (did you mean {near[0]!r}?)' if near else ''}; "
            f"expected one of {sorted(fields)}"
        )
    kwargs = {}
    for name, f in fields.items():
        p = f"{path}.{name}" if path else name
        if name in value:
            kwargs[name] = _convert(value[name], hints[name], p)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:  # type: ignore[misc]
            raise ConfigError(f"{p}: required key is missing")
    return cls(**kwargs)


def to_dict(cfg: Any) -> Any:
    """Dataclass tree -> plain dicts/lists (for YAML dumps of the resolved config)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, list):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, enum.Enum):
        return cfg.value
    return cfg


_PATH_TOKEN = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def _split_path(key: str) -> list[str | int]:
    parts: list[str | int] = []
    pos = 0
    for m in _PATH_TOKEN.finditer(key):
        parts.append(m.group(1) if m.group(1) is not None else int(m.group(2)))
        pos = m.end()
    if not parts or pos != len(key.rstrip(".")):
        raise ConfigError(f"--set {key}: cannot parse key path")
    return parts


def apply_override(raw: dict, assignment: str) -> str:
    """Apply one ``a.b[2].c=value`` override to the raw YAML dict in place; returns the key
    path as written (``a.b[2].c``).

    The value is parsed as YAML (``32`` -> int, ``[1, 2]`` -> list,
    ``true`` -> bool).  Type checking happens when the dataclasses are built.

    Raises:
        ConfigError: no ``=``, bad path, or a list index out of range.
    """
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, e.g. model.embedding_dim=32")
    from dlrmctl.yaml_file import load_yaml_text

    key, _, text = assignment.partition("=")
    key = key.strip()
    try:
        value = load_yaml_text(text) if text.strip() else None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)  # one line: the problem and its column, not YAML's 4-line excerpt
        at = f" (column {mark.column + 1})" if mark is not None else ""
        raise ConfigError(f"--set {key}: cannot parse value {text!r}: {getattr(e, 'problem', None) or e}{at}") from e
    parts = _split_path(key)
    node: Any = raw
    for i, p in enumerate(parts[:-1]):
        nxt = parts[i + 1]
        if isinstance(p, int):
            if not isinstance(node, list) or p >= len(node):
                raise ConfigError(f"--set {key}: index [{p}] out of range")
            node = node[p]
        else:
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: '{p}' is not inside a mapping")
            if p not in node or node[p] is None:
                node[p] = [] if isinstance(nxt, int) else {}
            node = node[p]
    last = parts[-1]
    if isinstance(last, int):
        if not isinstance(node, list) or last >= len(node):
            raise ConfigError(f"--set {key}: index [{last}] out of range")
        node[last] = value
    else:
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: '{last}' is not inside a mapping")
        node[last] = value
    return key


def config_from_dict(raw: dict, overrides: list[str] | None = None, source: str = "<dict>") -> ExperimentConfig:
    """Build and validate an :class:`ExperimentConfig` from a raw mapping.

    Raises:
        ConfigError: with ``source: key.path: problem`` (``source with --set KEY=VALUE: ...`` when
            the bad value came from an override).
    """
    raw = copy.deepcopy(raw) if raw is not None else {}
    keys = []  # (key path, the --set as given)
    for ov in overrides or []:
        try:
            keys.append((apply_override(raw, ov), ov))
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
    try:
        cfg = _build_dataclass(ExperimentConfig, raw, "")
        validate(cfg)
    except ConfigError as e:
        msg = str(e)
        # name the --set that gave the bad value (the file may not even have the key)
        given = [ov for key, ov in keys if msg.startswith(tuple(key + c for c in ":.["))]
        where = f"{source} with --set {given[-1]}" if given else source
        raise ConfigError(f"{where}: {msg}") from None
    return cfg


def load_config(path: str | os.PathLike, overrides: list[str] | None = None) -> ExperimentConfig:
    """Read a YAML experiment file, apply ``--set`` overrides, validate.

    Relative ``data.path`` / ``train.run_dir`` / ``sharding.plan_file`` are
    kept as written (relative to the working directory, like the CLI's paths).

    Raises:
        ConfigError: unreadable file, invalid YAML (with line), unknown key,
            wrong type, or inconsistent values.
    """
    from dlrmctl.yaml_file import read_yaml

    path = os.fspath(path)
    raw = read_yaml(path, ConfigError, "config")
    if raw is None:  # an empty file (or comments only) is a mistake, not "all defaults"
        raise ConfigError(f"{path}: empty config file (write `{{}}` for all defaults; see configs/demo.yaml)")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level of the config, got {type(raw).__name__}")
    return config_from_dict(raw, overrides, source=path)
