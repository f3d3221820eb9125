"""The schema of a click log: which columns are the label, dense and categorical features, how
each is transformed, and how the file is read.  Loaded from YAML and validated like a config:
an unknown key, a wrong type or a bad value is a :class:`SchemaError` naming the file and the
key path (``categorical[3] (site_id).hash``), before any input is read.

Keys (``docs/data.md`` documents each with an example)::

    name: avazu                       # optional, recorded in meta.json
    format: csv                       # csv | tsv | parquet | jsonl (default: from the file extension)
    header: true                      # csv / tsv: the first line names the columns (default true)
    columns: [a, b, ...]              # csv / tsv without a header: the column names, in file order
    delimiter: ","                    # csv: one character (tsv: tab)
    label: click                      # a 0/1 column, or {column: rating, positive: ">= 4"}
    time: hour                        # optional: an integer or timestamp column (--split-by time)
    defaults: {dense: {...}, categorical: {...}}   # merged into every entry below
    dense:                            # float features
      - {name: I1, transform: log1p, fill: 0}      # log1p (after clamping negatives) | standardize | none
    categorical:                      # id features: exactly one of vocab / hash / ids
      - {name: site_id, vocab: {min_count: 3}}     # values seen >= min_count times in train
      - {name: user, vocab: {min_count: 1, order: value, oov: error}}   # ids by sorted value, no extra rows
      - {name: movieId, vocab: {from: join, order: value}}   # every key of the side table it joins
      - {name: device_ip, hash: 1000000}           # raw_id mod buckets (dlrmctl.data.ids)
      - {name: user, ids: raw}                     # the 64-bit raw id itself (managed collisions)
      - {name: tags, vocab: {}, multi: {delimiter: "|", max_len: 16}, weights: tag_weights}
      - {name: C1, parse: hex}                     # 8 hex digits read as an integer (Criteo)
      - {name: genres, multi: {delimiter: "|"}, null_values: ["(no genres listed)"]}   # values read as missing
    ignore: [id]                      # columns read and dropped
    split: {by: time, group: userId, tiebreak: movieId}   # optional (dlrmctl.data.logs.split)
    join:                             # optional: columns of side tables, looked up by a key column
      - {path: movies.csv, key: movieId, columns: [genres], missing: error}   # (dlrmctl.data.logs.join)

A bare string in ``dense`` / ``categorical`` is ``{name: <it>}`` with the defaults.  Every column
of the file must be named by the schema (as label, time, a feature, a weight column or in
``ignore``), and every column the schema names must be in the file.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any

from dlrmctl.data.logs.schema_keys import (KeyChecker, SchemaError, derived_sources, kind_of, many_keys,
                                           one_writer_per_file, split_kwargs)

__all__ = ["CategoricalSpec", "DenseSpec", "JoinSpec", "LabelSpec", "LogSchema", "SchemaError", "SplitSpec", "load_schema",
           "parse_schema"]

FORMATS = ("csv", "tsv", "parquet", "jsonl")
DENSE_TRANSFORMS = ("log1p", "standardize", "none")
DEFAULT_MIN_COUNT = 3
_EXTENSIONS = {".csv": "csv", ".tsv": "tsv", ".txt": "tsv", ".parquet": "parquet", ".pq": "parquet",
               ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl"}
_COMPRESSED = (".gz", ".bz2", ".zst", ".lz4")
_RULE_RE = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")


@dataclasses.dataclass(frozen=True)
class LabelSpec:
    """The label: ``column`` read as 0/1, or turned into 0/1 by ``op value`` (``rating >= 4``)."""

    column: str
    op: str | None = None
    value: float | None = None

    def describe(self) -> str:
        return f"{self.column} in {{0, 1}}" if self.op is None else f"1 if {self.column} {self.op} {self.value:g} else 0"


@dataclasses.dataclass(frozen=True)
class DenseSpec:
    """A dense feature: a column, or one derived (:mod:`dlrmctl.data.logs.derived`); ``fill``
    replaces a missing value (a number, or ``"mean"``: the train mean), then ``transform``."""

    name: str
    transform: str = "none"
    fill: float | str = 0.0
    #: the number of train rows whose one-valued ``vocab`` / ``ids: raw`` column has this row's value
    count_of: str | None = None
    #: ``(text column, regex)``: the number matched by the regex's first group
    extract: tuple[str, str] | None = None
    #: a dense feature holding a year: the UTC year of the row's ``time`` minus that (filled) year
    years_since: str | None = None

    @property
    def derived(self) -> bool:
        """Whether the value is not a column of the file read as a number."""
        return bool(self.count_of or self.extract or self.years_since)


@dataclasses.dataclass(frozen=True)
class CategoricalSpec:
    """A categorical column and its id mode (``vocab`` min count, ``hash`` buckets or raw ids)."""

    name: str
    mode: str = "vocab"  # vocab | hash | raw
    min_count: int = DEFAULT_MIN_COUNT
    buckets: int = 0
    parse: str = "text"  # text | hex
    multi: bool = False
    delimiter: str | None = None  # multi-valued as delimited text (None: an Arrow list column)
    max_len: int | None = None
    weights: str | None = None  # column of per-value weights
    #: what ``hash`` mode reduces modulo the buckets: ``raw_id`` (FNV-1a of the text), or ``hex`` (the
    #: 8 hex digits' integer, with ``parse: hex``); recorded so that data hashed otherwise is refused
    hash_of: str = "raw_id"
    #: values that mean "missing" (e.g. MovieLens' ``(no genres listed)``): the missing id, or no element of a bag
    null_values: tuple[str, ...] = ()
    #: ``vocab`` id order: ``count`` (most frequent in train first, ties by key) or ``value`` (the
    #: values sorted: numerically when every value is an integer, else by their text)
    order: str = "count"
    #: ``vocab`` keys: ``train`` (values seen >= min_count times in train) or ``join`` (every key of
    #: the side table this column is the ``join`` key of: a catalogue, rated or not)
    vocab_from: str = "train"
    #: ``vocab`` rows beyond the vocabulary: ``row`` (an out-of-vocabulary and a missing row) or
    #: ``error`` (none: a value outside the vocabulary, or a missing one, is a bad row)
    oov: str = "row"

    def __post_init__(self) -> None:
        if self.mode == "hash" and self.parse == "hex" and self.hash_of != "hex":
            object.__setattr__(self, "hash_of", "hex")


@dataclasses.dataclass(frozen=True)
class SplitSpec:
    """How rows are split (``split:``): ``by`` row hash or time; with ``group``, each group's own
    latest rows (ordered by time, then ``tiebreak``) are its val / test rows."""

    by: str = "row"  # row | time
    group: str | None = None
    tiebreak: str | None = None


@dataclasses.dataclass(frozen=True)
class JoinSpec:
    """A side table joined to every row by its ``key`` column (``join:``).

    ``key`` is a column of both the log and the side table; ``path`` is the side file as the schema names it (relative: to the first input's directory);
    ``table`` the prepared copy the preprocess looks rows up in (set by it, relative to the data
    directory: ``vocab/join_<i>.arrow``)."""

    path: str
    key: str
    columns: tuple[str, ...]
    format: str | None = None
    delimiter: str | None = None
    missing: str = "error"  # error | empty
    table: str | None = None
    #: many rows per key, aggregated into one bag per key (:mod:`dlrmctl.data.logs.bags`): ``time``,
    #: ``group``, ``normalize``, ``min_count``, ``max_len``
    many: dict | None = None


@dataclasses.dataclass(frozen=True)
class LogSchema:
    """A validated schema (see the module docstring)."""

    name: str | None
    format: str | None
    header: bool
    columns: tuple[str, ...] | None
    delimiter: str | None
    label: LabelSpec | None
    time: str | None
    dense: tuple[DenseSpec, ...]
    categorical: tuple[CategoricalSpec, ...]
    ignore: tuple[str, ...]
    source: str = "<schema>"
    split: SplitSpec | None = None
    join: tuple[JoinSpec, ...] = ()

    def used_columns(self) -> list[str]:
        """Every column of the input file the rows are made of (label, time, dense, categorical,
        weights, the split's group and tiebreak, the join keys), but the joined ones."""
        out = [self.label.column] if self.label else []
        out += [self.time] if self.time else []
        out += [d.extract[0] if d.extract else d.name for d in self.dense if not (d.count_of or d.years_since)]
        out += [c.name for c in self.categorical]
        out += [c.weights for c in self.categorical if c.weights]
        out += [c for c in (self.split.group, self.split.tiebreak) if c] if self.split else []
        out += [j.key for j in self.join]
        joined = set(self.joined_columns())
        return list(dict.fromkeys(c for c in out if c not in joined))

    def joined_columns(self) -> list[str]:
        """The columns the side tables add to each row (``join[*].columns``)."""
        return [c for j in self.join for c in j.columns]

    def join_bringing(self, column: str) -> str | None:
        """``join[i] (<path>, by its key '<key>')`` of the side table that brings ``column``, or None."""
        for i, j in enumerate(self.join):
            if column in j.columns:
                return f"join[{i}] ({j.path}, by its key '{j.key}')"
        return None

    def named_columns(self) -> list[str]:
        """:meth:`used_columns` and the ignored ones: every column the file may have."""
        return self.used_columns() + list(self.ignore)

    def format_of(self, path: str | os.PathLike) -> str:
        """The input format of ``path``: the schema's ``format``, else from its extension.

        Raises:
            SchemaError: no ``format`` and an extension that says none.
        """
        if self.format:
            return self.format
        name = os.path.basename(os.fspath(path)).lower()
        for c in _COMPRESSED:
            if name.endswith(c):
                name = name[: -len(c)]
        ext = os.path.splitext(name)[1]
        if ext not in _EXTENSIONS:
            raise SchemaError(f"{path}: cannot tell the format from the extension {ext or '(none)'!r}; set "
                              f"`format:` ({' | '.join(FORMATS)}) in the schema {self.source}")
        return _EXTENSIONS[ext]

    def to_dict(self) -> dict:
        """The normalised schema (every default filled in): what meta.json and exports record.  An
        unused ``split`` / ``join`` / ``null_values`` is left out (the dict of a schema without them
        is the one earlier versions recorded, so their datasets stay complete and resumable)."""
        d = dataclasses.asdict(self)
        d.pop("source")
        for k in ("split", "join"):
            if not d[k]:
                d.pop(k)
        for j in d.get("join", []):
            if j["many"] is None:
                j.pop("many")
        for x in d["dense"]:
            for k in ("count_of", "extract", "years_since"):
                if x[k] is None:
                    x.pop(k)
        for c in d["categorical"]:
            for k, default in (("null_values", ()), ("order", "count"), ("vocab_from", "train"), ("oov", "row")):
                if c[k] == default or (k == "null_values" and not c[k]):
                    c.pop(k)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LogSchema":
        """Inverse of :meth:`to_dict` (a schema recorded in meta.json or a model's manifest)."""
        d = dict(d)
        lab = d.get("label")
        for x in d.get("categorical") or []:
            if x.get("mode") == "hash" and x.get("parse") == "hex" and x.get("hash_of") != "hex":
                raise SchemaError(f"{x.get('name')}: hashed with parse: hex by an earlier dlrmctl (the raw id of the text "
                                  "mod the buckets; now the hex integer, as preprocess criteo): preprocess the data "
                                  "again (and export the model again)")
        return cls(name=d.get("name"), format=d.get("format"), header=bool(d.get("header", True)),
                   columns=tuple(d["columns"]) if d.get("columns") else None, delimiter=d.get("delimiter"),
                   label=LabelSpec(**lab) if lab else None, time=d.get("time"),
                   dense=tuple(DenseSpec(**{**x, **({"extract": tuple(x["extract"])} if x.get("extract") else {})})
                               for x in d.get("dense") or []),
                   categorical=tuple(CategoricalSpec(**{**x, "null_values": tuple(x.get("null_values") or ())})
                                     for x in d.get("categorical") or []),
                   ignore=tuple(d.get("ignore") or []), source="recorded with the data",
                   split=SplitSpec(**d["split"]) if d.get("split") else None,
                   join=tuple(JoinSpec(**{**j, "columns": tuple(j["columns"])}) for j in d.get("join") or []))


_TOP = ("name", "format", "header", "columns", "delimiter", "label", "time", "defaults", "dense", "categorical",
        "ignore", "split", "join")
_DENSE_KEYS = ("name", "transform", "fill", "count_of", "extract", "years_since")
_CAT_KEYS = ("name", "vocab", "hash", "ids", "parse", "multi", "weights", "null_values")


def _label(v: KeyChecker, x: Any) -> LabelSpec | None:
    if x is None:
        return None
    if isinstance(x, str):
        return LabelSpec(v.string(x, "label"))
    d = v.mapping(x, "label", ("column", "positive"))
    col = v.string(d.get("column"), "label.column")
    if "positive" not in d:
        return LabelSpec(col)
    rule = d["positive"]
    m = _RULE_RE.match(rule) if isinstance(rule, str) else None
    if m is None:
        raise v.fail("label.positive", f"expected a rule '<op> <number>' with op one of >=, >, <=, <, ==, != "
                                       f"(e.g. \">= 4\"), got {kind_of(rule)}")
    threshold = float(m.group(2))
    if not math.isfinite(threshold):  # '>= 1e999' would make every label 0 (or 1) without a word
        raise v.fail("label.positive", f"expected a finite threshold, got {rule!r}")
    return LabelSpec(col, m.group(1), threshold)


def _dense(v: KeyChecker, i: int, x: Any, defaults: dict) -> DenseSpec:
    p = f"dense[{i}]"
    if isinstance(x, str):
        x = {"name": x}
    d = {**defaults, **v.mapping(x, p, _DENSE_KEYS)}
    name = v.string(d.get("name"), f"{p}.name")
    p = f"{p} ({name})"
    tr = v.choice(d.get("transform", "none"), f"{p}.transform", DENSE_TRANSFORMS)
    fill = "mean" if d.get("fill") == "mean" else v.number(d.get("fill", 0.0), f"{p}.fill")
    kinds = [k for k in ("count_of", "extract", "years_since") if d.get(k) is not None]
    if len(kinds) > 1:
        raise v.fail(p, f"give one of count_of, extract, years_since; got {', '.join(kinds)}")
    kw: dict[str, Any] = {}
    if kinds and kinds[0] != "extract":
        kw[kinds[0]] = v.string(d[kinds[0]], f"{p}.{kinds[0]}")
        for k, bad in (("transform", tr == "standardize"), ("fill", "fill" in d)):
            if bad:  # (the value is made after the pass that computes train statistics)
                raise v.fail(f"{p}.{k}", f"a `{kinds[0]}` feature takes transform log1p or none and no fill")
    elif kinds:
        e = v.mapping(d["extract"], f"{p}.extract", ("column", "pattern"))
        pat = v.string(e.get("pattern"), f"{p}.extract.pattern")
        try:
            groups = re.compile(pat).groups
        except re.error as err:
            raise v.fail(f"{p}.extract.pattern", f"not a regular expression: {err}") from None
        if groups < 1:
            raise v.fail(f"{p}.extract.pattern", "expected a group, `(...)`, around the number to extract")
        kw["extract"] = (v.string(e.get("column"), f"{p}.extract.column"), pat)
    return DenseSpec(name, tr, fill, **kw)


def _categorical(v: KeyChecker, i: int, x: Any, defaults: dict) -> CategoricalSpec:
    p = f"categorical[{i}]"
    if isinstance(x, str):
        x = {"name": x}
    own = v.mapping(x, p, _CAT_KEYS)
    modes_own = [k for k in ("vocab", "hash", "ids") if k in own]
    d = {**{k: val for k, val in defaults.items() if not (modes_own and k in ("vocab", "hash", "ids"))}, **own}
    name = v.string(d.get("name"), f"{p}.name")
    p = f"{p} ({name})"
    modes = [k for k in ("vocab", "hash", "ids") if k in d]
    if len(modes) > 1:
        raise v.fail(p, f"give one of vocab, hash, ids; got {', '.join(modes)}")
    kw: dict[str, Any] = {"name": name}
    mode = modes[0] if modes else "vocab"
    if mode == "vocab":
        voc = d.get("vocab") or {}
        voc = v.mapping(voc, f"{p}.vocab", ("min_count", "order", "from", "oov"))
        kw.update(mode="vocab", min_count=v.integer(voc.get("min_count", DEFAULT_MIN_COUNT), f"{p}.vocab.min_count"),
                  order=v.choice(voc.get("order", "count"), f"{p}.vocab.order", ("count", "value")),
                  vocab_from=v.choice(voc.get("from", "train"), f"{p}.vocab.from", ("train", "join")),
                  oov=v.choice(voc.get("oov", "row"), f"{p}.vocab.oov", ("row", "error")))
        if kw["vocab_from"] == "join":
            if "min_count" in voc:
                raise v.fail(f"{p}.vocab.min_count", "a vocabulary `from: join` holds every key of the side table; "
                                                     "min_count does not apply")
            kw["min_count"] = 1  # (every train value is counted: the catalogue's counts)
    elif mode == "hash":
        kw.update(mode="hash", buckets=v.integer(d["hash"], f"{p}.hash"))
    else:
        v.choice(d["ids"], f"{p}.ids", ("raw",))
        kw.update(mode="raw")
    kw["parse"] = v.choice(d.get("parse", "text"), f"{p}.parse", ("text", "hex"))
    if mode == "hash" and kw["parse"] == "hex" and kw["buckets"] < 2:
        raise v.fail(f"{p}.hash", f"with parse: hex the last bucket is the missing value's: expected an integer "
                                  f">= 2, got {kw['buckets']}")
    if "multi" in d and d["multi"] is not None and d["multi"] is not False:
        m = {} if d["multi"] is True else v.mapping(d["multi"], f"{p}.multi", ("delimiter", "max_len"))
        kw["multi"] = True
        if "delimiter" in m:
            kw["delimiter"] = v.string(m["delimiter"], f"{p}.multi.delimiter")
        if "max_len" in m:
            kw["max_len"] = v.integer(m["max_len"], f"{p}.multi.max_len")
    if d.get("weights") is not None:
        kw["weights"] = v.string(d["weights"], f"{p}.weights")
    if d.get("null_values") is not None:
        kw["null_values"] = v.names(d["null_values"], f"{p}.null_values")
    return CategoricalSpec(**kw)


def _joins(v: KeyChecker, x: Any) -> tuple[JoinSpec, ...]:
    if x is None:
        return ()
    if not isinstance(x, list) or not x:
        raise v.fail("join", f"expected a non-empty list of side tables, got {kind_of(x)}")
    out = []
    for i, j in enumerate(x):
        p = f"join[{i}]"
        d = v.mapping(j, p, ("path", "key", "columns", "format", "delimiter", "missing", "many"))
        path = v.string(d.get("path"), f"{p}.path")
        p = f"{p} ({path})"
        on = v.string(d.get("key"), f"{p}.key")
        cols = v.names(d.get("columns"), f"{p}.columns")
        if not cols:
            raise v.fail(f"{p}.columns", "expected at least one column of the side table")
        if on in cols:
            raise v.fail(f"{p}.columns", f"'{on}' is the key; list the columns it brings")
        fmt = v.choice(d["format"], f"{p}.format", FORMATS) if d.get("format") is not None else None
        delim = v.string(d["delimiter"], f"{p}.delimiter") if d.get("delimiter") is not None else None
        if delim is not None and len(delim) != 1:
            raise v.fail(f"{p}.delimiter", f"expected one character, got {delim!r}")
        missing = v.choice(d.get("missing", "error"), f"{p}.missing", ("error", "empty"))
        many = many_keys(v, d["many"], f"{p}.many", cols) if d.get("many") is not None else None
        if many is not None and missing == "error" and d.get("missing") is not None:
            raise v.fail(f"{p}.missing", "a `many` side table gives a key without events an empty bag (missing: "
                         "empty); drop `missing: error` or `many`")
        out.append(JoinSpec(path, on, cols, fmt, delim, "empty" if many else missing, many=many))
    return tuple(out)


def parse_schema(raw: Any, source: str = "<schema>") -> LogSchema:
    """Validate a schema's parsed YAML (see the module docstring for the keys).

    Args:
        raw: the YAML document (a mapping).
        source: the file it came from (named in every message).

    Returns:
        :class:`LogSchema`.

    Raises:
        SchemaError: ``<source>: schema key <path>: <what was expected, what was given>``.
    """
    v = KeyChecker(source)
    d = v.mapping(raw, "", _TOP)
    name = v.string(d["name"], "name") if d.get("name") is not None else None
    fmt = v.choice(d["format"], "format", FORMATS) if d.get("format") is not None else None
    header = v.boolean(d.get("header", True), "header")
    columns = v.names(d["columns"], "columns") if d.get("columns") is not None else None
    if not header and columns is None and fmt in (None, "csv", "tsv"):
        raise v.fail("columns", "header: false needs `columns:` (the column names in file order)")
    delim = None
    if d.get("delimiter") is not None:
        delim = v.string(d["delimiter"], "delimiter")
        if len(delim) != 1:
            raise v.fail("delimiter", f"expected one character, got {delim!r}")
    defaults = v.mapping(d.get("defaults") or {}, "defaults", ("dense", "categorical"))
    dd = v.mapping(defaults.get("dense") or {}, "defaults.dense", _DENSE_KEYS[1:])
    cd = v.mapping(defaults.get("categorical") or {}, "defaults.categorical", _CAT_KEYS[1:])
    for key in ("dense", "categorical"):
        if d.get(key) is not None and not isinstance(d[key], list):
            raise v.fail(key, f"expected a list of columns, got {kind_of(d[key])}")
    dense = tuple(_dense(v, i, x, dd) for i, x in enumerate(d.get("dense") or []))
    cats = tuple(_categorical(v, i, x, cd) for i, x in enumerate(d.get("categorical") or []))
    if not dense and not cats:
        raise v.fail("categorical", "the schema has no features: list `dense:` and/or `categorical:` columns")
    s = LogSchema(name=name, format=fmt, header=header, columns=columns, delimiter=delim,
                  label=_label(v, d.get("label")), time=v.string(d["time"], "time") if d.get("time") is not None else None,
                  dense=dense, categorical=cats,
                  ignore=v.names(d["ignore"], "ignore") if d.get("ignore") is not None else (), source=source,
                  split=SplitSpec(**split_kwargs(v, d["split"])) if d.get("split") is not None else None,
                  join=_joins(v, d.get("join")))
    if s.split and s.split.by == "time" and not s.time:
        raise v.fail("split.by", "a time split needs the `time:` column")
    seen: dict[str, str] = {}
    roles = ([("label.column", s.label.column)] if s.label else []) + ([("time", s.time)] if s.time else []) + \
        [(f"dense[{i}]", x.name) for i, x in enumerate(dense)] + \
        [(f"categorical[{i}]", x.name) for i, x in enumerate(cats)] + \
        [(f"categorical[{i}].weights", x.weights) for i, x in enumerate(cats) if x.weights] + \
        [(f"ignore[{i}]", x) for i, x in enumerate(s.ignore)]
    for path, col in roles:
        if col in seen:
            raise v.fail(path, f"column '{col}' is already used by {seen[col]}; a column has one role")
        seen[col] = path
    brought: dict[str, str] = {}  # a joined column is a source (a feature of its name reads it), not a role
    for i, j in enumerate(s.join):
        for k, c in enumerate(j.columns):
            path = f"join[{i}] ({j.path}).columns[{k}]"
            if c in brought or c in s.ignore:
                raise v.fail(path, f"column '{c}' is already " + (f"brought by {brought[c]}" if c in brought else
                                                                  "in `ignore`"))
            brought[c] = path
        if j.key in s.joined_columns():
            raise v.fail(f"join[{i}] ({j.path}).key", f"'{j.key}' is a column another side table brings; join on a "
                                                     "column of the input")
    derived_sources(v, s)
    for i, j in enumerate(s.join):
        if j.many and j.many["group"] and (not s.split or j.many["group"] != s.split.group):
            raise v.fail(f"join[{i}] ({j.path}).many.group", f"expected the split's group "
                         f"({s.split.group if s.split and s.split.group else 'none: set split.group'}), got '{j.many['group']}'")
    keys = [j.key for j in s.join]
    for i, c in enumerate(cats):
        bags = [c for j in s.join if j.many for c in j.columns]
        if c.vocab_from == "join" and not ((c.name in keys and not c.multi) or (c.name in bags and c.multi)):
            raise v.fail(f"categorical[{i}] ({c.name}).vocab.from", f"'{c.name}' is not the key of a `join` side "
                         f"table (keys: {', '.join(keys) or 'none'}) nor the multi-valued column of a `many` one: "
                         "`from: join` takes the vocabulary from one")
    one_writer_per_file(v, s)
    if columns is not None:
        missing = [c for c in s.named_columns() if c not in columns]
        if missing:
            raise v.fail("columns", f"does not list {missing}, which the schema uses")
    return s


def load_schema(path: str | os.PathLike) -> LogSchema:
    """Read and validate a schema file (YAML, :mod:`dlrmctl.yaml_file`).

    Raises:
        SchemaError: unreadable file, invalid YAML, or an invalid key (named by its path).
    """
    from dlrmctl.yaml_file import read_yaml_mapping

    raw = read_yaml_mapping(path, SchemaError, "schema", expected="keys format, label, dense, categorical, ...")
    return parse_schema(raw, os.fspath(path))
