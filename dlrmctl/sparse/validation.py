"""Id-range validation of sparse inputs.

:func:`check_ids` reads the min and max id of every feature on the host.  On a
CUDA batch that is a device sync per feature, so the trainer runs it on the CPU
batch in the loader's background thread (``BatchLoader(id_bounds=...)``), and
the embedding modules run it only when built with ``check_ids=True`` (their
default, for direct use).
"""

from __future__ import annotations

import torch

from dlrmctl.sparse.jagged_tensor import KeyedJaggedTensor, SparseInputError

__all__ = ["EmbeddingIdError", "check_ids"]


class EmbeddingIdError(SparseInputError):
    """An id is outside ``[0, num_embeddings)`` of its table."""


def check_ids(
    kjt: KeyedJaggedTensor, feature_rows: dict[str, int], feature_table: dict[str, str], where: str = ""
) -> None:
    """Raise if any id of a feature is outside its table.

    Args:
        kjt: input ids (integer values; any device, but a CUDA batch costs one
            host sync per feature).
        feature_rows: feature -> rows of the table it looks up (features absent
            from this dict are not checked).
        feature_table: feature -> table name (for the message).
        where: prefix naming the batch's source (e.g. ``"train split, batch 12: "``).

    Raises:
        EmbeddingIdError: naming the table, the feature, the offending id and
            the valid range; ids are never silently clamped to row 0.
    """
    values = kjt.values()
    if values.numel() == 0:
        return
    opk = kjt.offset_per_key()
    for i, key in enumerate(kjt.keys()):
        n = feature_rows.get(key)
        s, e = opk[i], opk[i + 1]
        if n is None or s == e:
            continue
        v = values[s:e]
        lo, hi = torch.aminmax(v)
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= n:
            bad = lo if lo < 0 else hi
            raise EmbeddingIdError(
                f"{where}table '{feature_table.get(key, '?')}', feature '{key}': id {bad} is out of range; "
                f"expected 0 <= id < num_embeddings = {n}"
            )
