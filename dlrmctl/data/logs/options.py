"""The options of ``preprocess logs`` (:class:`LogOptions`): those of ``preprocess criteo``, plus
``split_by``."""

from __future__ import annotations

import dataclasses

from dlrmctl.data.columnar import check_split_ratios
from dlrmctl.data.logs.schema import LogSchema
from dlrmctl.data.logs.split import split_mode

__all__ = ["LogOptions"]


@dataclasses.dataclass
class LogOptions:
    """Options of :func:`preprocess_logs` (those of ``preprocess criteo``, plus ``split_by``)."""

    val_ratio: float = 0.0
    test_ratio: float = 0.0
    seed: int = 0
    split_by: str | None = None  # "row" (hash of file and line) | "time" (latest time slices); None: the schema's
    on_bad_line: str = "error"
    workers: int = 1
    block_size: int = 4 << 20

    def validate(self, schema: LogSchema) -> None:
        """Raise ValueError naming the option when an option is inconsistent (with the schema)."""
        check_split_ratios(self.val_ratio, self.test_ratio)
        if split_mode(self.split_by, schema) == "time" and not schema.time:
            raise ValueError(f"--split-by time needs a `time:` column in the schema {schema.source}")
        if self.on_bad_line not in ("error", "skip"):
            raise ValueError(f"--on-bad-line must be 'error' or 'skip', got {self.on_bad_line!r}")
        if schema.label is None and (self.val_ratio or self.test_ratio):
            raise ValueError(f"the schema {schema.source} has no label: every row goes to the 'test' split; "
                             "--val-ratio/--test-ratio do not apply")
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
