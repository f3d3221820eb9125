"""Any tabular click log (CSV, TSV, Parquet, JSON lines), described by a schema -> columnar shards +
``meta.json`` (the format of :mod:`dlrmctl.data.columnar`, read by the same loader as Criteo).

Modules: :mod:`.schema` (the YAML schema and its validation), :mod:`.read` (streaming readers that
know every row's file and line), :mod:`.transform` (label, dense and categorical transforms of a
block), :mod:`.split` (time splits: one global cut, or per group), :mod:`.join` (side tables joined
by a key column), :mod:`.preprocess` (the passes and ``meta.json``), :mod:`.raw_transform` (raw rows
of the schema's format for ``predict`` and ``serve``).
"""

from dlrmctl.data.logs.schema import LogSchema, SchemaError, load_schema, parse_schema


def __getattr__(name: str):
    """``LogOptions`` and ``preprocess_logs`` imported on first use (the package's schema is read
    without pyarrow, e.g. by ``predict``'s input check before anything slow is imported)."""
    if name in ("LogOptions", "preprocess_logs"):
        from dlrmctl.data.logs import preprocess

        return getattr(preprocess, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["LogOptions", "LogSchema", "SchemaError", "load_schema", "parse_schema", "preprocess_logs"]
