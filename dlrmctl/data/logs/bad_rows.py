"""The one rule for a bad row of a log block, whatever made it bad (a value that does not parse, a
missing label, time, split group or join key): with ``on_bad_line='error'`` the first bad row is
one :class:`~dlrmctl.data.columnar.DataError` naming its ``file:line`` (or Parquet row), the column,
what was expected and the value found; with ``'skip'`` the bad rows are returned, for the caller
to drop and count.  Torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from dlrmctl.errors import quoted

if TYPE_CHECKING:
    from dlrmctl.data.logs.read import RowBatch

__all__ = ["bad_rows", "shown_value"]


def shown_value(values: pa.Array | None, i: int) -> str:
    """Row ``i`` of ``values`` as an error message shows a value found: quoted (:func:`quoted`; bytes
    decoded as UTF-8), or "an empty field" for a null, an empty value or no values."""
    v = values[i].as_py() if values is not None and i < len(values) else None
    v = v.decode("utf-8", "replace") if isinstance(v, bytes) else v
    return "an empty field" if v is None or v == "" else quoted(v)


def bad_rows(batch: RowBatch, mask: np.ndarray, column: str, what: str, values: pa.Array | None,
             on_bad_line: str, hint: str = "") -> np.ndarray:
    """Rows ``mask`` (``[n]`` bool) of ``batch`` are bad in ``column``: refuse the first, or return
    ``mask`` to skip them.

    Args:
        values: the column's values, to show the first bad one (None, or a null, empty or missing
            value: shown as "an empty field"; bytes are decoded as UTF-8).
        what: what the column should hold ("a number", "0 or 1 (the label)").
        hint: added after the value found (how to accept such rows, e.g. a schema option).

    Returns:
        ``mask`` (``on_bad_line='skip'``, or no bad row).

    Raises:
        DataError: ``on_bad_line='error'`` and a row is bad: ``file:line: column: expected WHAT,
            got VALUE`` (:meth:`RowBatch.error`).
    """
    if on_bad_line == "error" and mask.any():
        i = int(np.flatnonzero(mask)[0])
        raise batch.error(i, column, f"expected {what}, got {shown_value(values, i)}{hint}")
    return mask
