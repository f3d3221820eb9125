"""Key-path-aware checks of a schema's YAML (:mod:`dlrmctl.data.logs.schema`): every failure is one
:class:`SchemaError` line ``<source>: schema key <path>: <what was expected, what was given>``."""

from __future__ import annotations

from typing import Any

from dlrmctl.errors import UserError

__all__ = ["KeyChecker", "SchemaError", "derived_sources", "kind_of", "many_keys", "one_writer_per_file", "split_kwargs"]


class SchemaError(ValueError, UserError):
    """A schema file that cannot be used: the message names the file and the key path."""


class KeyChecker:
    """Key-path-aware checks; every failure is one :class:`SchemaError` line."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, path: str, msg: str) -> SchemaError:
        return SchemaError(f"{self.source}: schema key {path}: {msg}")

    def mapping(self, v: Any, path: str, allowed: tuple[str, ...]) -> dict:
        if not isinstance(v, dict):
            raise self.fail(path, f"expected a mapping, got {kind_of(v)}")
        for k in v:
            if k not in allowed:
                import difflib

                near = difflib.get_close_matches(str(k), allowed, n=1)
                hint = f" (did you mean '{near[0]}'?)" if near else f" (allowed: {', '.join(allowed)})"
                raise self.fail(f"{path}.{k}" if path else str(k), f"unknown key{hint}")
        return v

    def string(self, v: Any, path: str) -> str:
        if not isinstance(v, str) or not v:
            raise self.fail(path, f"expected a non-empty string, got {kind_of(v)}")
        return v

    def integer(self, v: Any, path: str, lo: int = 1, hi: int = (1 << 63) - 1) -> int:
        """An int in ``[lo, hi]``; ``hi`` defaults to int64's maximum (every count and bucket number
        of a schema is an int64 where it is used)."""
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            bound = "2^63 - 1" if hi == (1 << 63) - 1 else f"{hi:,}"
            raise self.fail(path, f"expected an integer >= {lo} and <= {bound}, got {kind_of(v)}")
        return v

    def number(self, v: Any, path: str) -> float:
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v or v in (float("inf"), float("-inf")):
            raise self.fail(path, f"expected a finite number, got {kind_of(v)}")
        return float(v)

    def boolean(self, v: Any, path: str) -> bool:
        if not isinstance(v, bool):
            raise self.fail(path, f"expected true or false, got {kind_of(v)}")
        return v

    def choice(self, v: Any, path: str, choices: tuple[str, ...]) -> str:
        if v not in choices:
            raise self.fail(path, f"expected one of {', '.join(choices)}, got {kind_of(v)}")
        return v

    def names(self, v: Any, path: str) -> tuple[str, ...]:
        if not isinstance(v, list):
            raise self.fail(path, f"expected a list of column names, got {kind_of(v)}")
        return tuple(self.string(x, f"{path}[{i}]") for i, x in enumerate(v))


def kind_of(v: Any) -> str:
    """How a YAML value is named in a message: ``nothing (null)``, ``a list``, ``str 'x'``, ``int 3``."""
    if v is None:
        return "nothing (null)"
    if isinstance(v, (dict, list)):
        return f"a {type(v).__name__}"
    return f"{type(v).__name__} {v!r}"


def many_keys(v: KeyChecker, x: Any, path: str, columns: tuple[str, ...]) -> dict:
    """The ``many`` mapping of a ``join`` entry (:mod:`dlrmctl.data.logs.bags`), defaults filled in.

    Raises:
        SchemaError: an unknown key, a wrong type, ``time`` without ``group`` (or the reverse), or
            not exactly one column to aggregate.
    """
    d = v.mapping({} if x is True else x, path, ("time", "group", "normalize", "min_count", "max_len"))
    if len(columns) != 1:
        raise v.fail(f"{path}", f"a `many` side table brings one column (its values become a bag per key), got "
                                f"{len(columns)}")
    out = {"time": v.string(d["time"], f"{path}.time") if d.get("time") is not None else None,
           "group": v.string(d["group"], f"{path}.group") if d.get("group") is not None else None,
           "normalize": v.boolean(d.get("normalize", False), f"{path}.normalize"),
           "min_count": v.integer(d.get("min_count", 1), f"{path}.min_count"),
           "max_len": v.integer(d["max_len"], f"{path}.max_len") if d.get("max_len") is not None else None}
    if (out["time"] is None) != (out["group"] is None):
        raise v.fail(f"{path}.{'group' if out['group'] is None else 'time'}", "`time` and `group` go together (an "
                     "event counts when its time is at most its group's latest train time)")
    return out


def split_kwargs(v: KeyChecker, x: Any) -> dict:
    """The ``split`` mapping as ``SplitSpec`` keyword arguments (``by``, ``group``, ``tiebreak``).

    Raises:
        SchemaError: an unknown key, a group without ``by: time``, a tiebreak without a group.
    """
    d = v.mapping(x, "split", ("by", "group", "tiebreak"))
    by = v.choice(d.get("by", "row"), "split.by", ("row", "time"))
    group = v.string(d["group"], "split.group") if d.get("group") is not None else None
    tiebreak = v.string(d["tiebreak"], "split.tiebreak") if d.get("tiebreak") is not None else None
    if group and by != "time":
        raise v.fail("split.group", "a per-group split is by time: set `split.by: time` (and `time:`)")
    if tiebreak and not group:
        raise v.fail("split.tiebreak", "orders a group's rows of equal time: needs `split.group`")
    return {"by": by, "group": group, "tiebreak": tiebreak}



def one_writer_per_file(v: KeyChecker, s: Any) -> None:
    """Refuse two keys of the schema ``s`` (a ``LogSchema``) whose tables would be the same file
    of the data directory: ``vocab/<categorical>.arrow`` (``vocab`` mode),
    ``vocab/count_<dense>.arrow`` (``count_of``), ``vocab/join_<i>.arrow`` and
    ``vocab/join_<i>_values.arrow`` (``many``), compared case-blind (a case-insensitive file
    system holds one of two names differing in case only).

    Raises:
        SchemaError: names the later key, the file and the earlier key.
    """
    files = [(f"join[{i}] ({j.path})", f"vocab/join_{i}.arrow") for i, j in enumerate(s.join)]
    files += [(f"join[{i}] ({j.path}).many", f"vocab/join_{i}_values.arrow") for i, j in enumerate(s.join) if j.many]
    files += [(f"dense[{i}] ({x.name}).count_of", f"vocab/count_{x.name}.arrow")
              for i, x in enumerate(s.dense) if x.count_of]
    files += [(f"categorical[{i}] ({c.name})", f"vocab/{c.name}.arrow")
              for i, c in enumerate(s.categorical) if c.mode == "vocab"]
    seen: dict[str, str] = {}
    for path, f in files:
        if f.casefold() in seen:
            raise v.fail(path, f"its table {f} is also the table of {seen[f.casefold()]}; rename one of them")
        seen[f.casefold()] = path


def derived_sources(v: KeyChecker, s: Any) -> None:
    """Check what the derived dense features of the schema ``s`` (a ``LogSchema``) read:
    ``count_of`` a one-valued ``vocab`` / ``ids: raw`` categorical; ``years_since`` an earlier
    dense feature read or extracted (a year) whose transform is not ``log1p`` (the year is taken
    after its ``fill``, and a ``fill: mean`` of a ``log1p`` feature is a mean of logs), and the
    ``time:`` column.

    Raises:
        SchemaError: names ``dense[i] (name).count_of`` / ``.years_since``.
    """
    by_name = {c.name: c for c in s.categorical}
    for i, x in enumerate(s.dense):
        p = f"dense[{i}] ({x.name})"
        c = by_name.get(x.count_of) if x.count_of else None
        if x.count_of and (c is None or c.mode == "hash" or c.multi):
            raise v.fail(f"{p}.count_of", f"'{x.count_of}' is not a one-valued categorical with `vocab` or `ids: raw` "
                         "(the columns whose train values are counted)")
        src = {y.name: (k, y) for k, y in enumerate(s.dense[:i]) if y.extract or not y.derived}.get(x.years_since)
        if x.years_since and (not s.time or src is None):
            raise v.fail(f"{p}.years_since", f"expected a dense feature read or extracted before this one (a year), and "
                         f"the `time:` column; got '{x.years_since}'" + ("" if s.time else " and no `time:`"))
        if x.years_since and src[1].transform == "log1p":
            raise v.fail(f"{p}.years_since", f"'{x.years_since}' (dense[{src[0]}]) has transform: log1p, so it holds "
                         "log(year + 1), not a year; give it transform: none or standardize (the year is taken before "
                         "standardize)")
