"""Id-range validation of sparse inputs, and the invalid-id policy.

:func:`check_ids` reads the min and max id of every feature on the host.  On a
CUDA batch that is a device sync per feature, so the trainer runs it on the CPU
batch in the loader's background thread (``BatchLoader(id_bounds=...)``), and
the embedding modules run it only when built with ``check_ids=True`` (their
default, for direct use).

:func:`apply_id_policy` is the one implementation of ``model.on_invalid_id``
that every path runs before any lookup or bucketization (the loader on the CPU
batch, the embedding modules with ``check_ids=True``; the exported TorchScript
model has the same rule written in TorchScript):

* ``error`` (default): an id outside ``[0, num_embeddings)`` of a table it is
  looked up in raises :class:`EmbeddingIdError` naming the table, the feature,
  the id and the valid range.  A feature looked up in several tables is checked
  against each of them (tables in config order; the first one the id is invalid
  for is named).
* ``zero``: an invalid id is dropped from its bag for that table: it adds
  nothing to a sum, its per-id weight goes with it, a mean divides by the
  number of valid ids, and a bag left with no valid id pools to zeros — exactly
  the output of the same batch without that id.  It gets no gradient and no
  optimizer update.  (FBGEMM's ``BoundsCheckMode.WARNING`` / ``IGNORE``
  instead rewrite the id to row 0, which silently trains row 0.)  A feature
  looked up in tables with different row counts is then delivered once per
  table under the output key ``feature@table``, each copy filtered by its own
  table's rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from dlrmctl.errors import UserError
from dlrmctl.sparse.jagged_tensor import KeyedJaggedTensor, SparseInputError

__all__ = ["ON_INVALID_ID", "EmbeddingIdError", "IdBound", "apply_id_policy", "check_ids", "normalize_id_bounds",
           "with_keys"]

#: values of ``model.on_invalid_id``
ON_INVALID_ID = ("error", "zero")


class EmbeddingIdError(SparseInputError, UserError):
    """An id is outside ``[0, num_embeddings)`` of its table."""


@dataclass(frozen=True)
class IdBound:
    """One (feature, table) lookup: ids of ``feature`` must be ``< rows`` of ``table``.

    Attributes:
        key: the lookup's output key (``feature``, or ``feature@table`` when the
            feature feeds several tables; TorchRec's embedding name).
        feature: the input feature (KJT key).
        table: table name (for messages).
        rows: the table's ``num_embeddings``.
    """

    key: str
    feature: str
    table: str
    rows: int


def _check_policy(on_invalid_id: str) -> None:
    if on_invalid_id not in ON_INVALID_ID:
        raise ValueError(f"on_invalid_id must be one of {list(ON_INVALID_ID)}, got {on_invalid_id!r}")


def normalize_id_bounds(bounds: Mapping[str, object] | None) -> dict[str, list[IdBound]]:
    """``{kjt key: [IdBound, ...]}`` from either that form or the older ``{feature: (table, rows)}``."""
    out: dict[str, list[IdBound]] = {}
    for k, v in (bounds or {}).items():
        if isinstance(v, IdBound):
            out[k] = [v]
        elif isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str):
            out[k] = [IdBound(k, k, v[0], int(v[1]))]
        else:
            out[k] = [b if isinstance(b, IdBound) else IdBound(*b) for b in v]  # type: ignore[union-attr]
    return out


def with_keys(kjt: KeyedJaggedTensor, keys: Sequence[str]) -> KeyedJaggedTensor:
    """The same KJT (same tensors) under new key names (one per key, in order)."""
    keys = list(keys)
    if keys == kjt.keys():
        return kjt
    vbe = kjt._vbe_kwargs()
    if "inverse_indices" in vbe:
        vbe["inverse_indices"] = (keys, vbe["inverse_indices"][1])
    return KeyedJaggedTensor(keys, kjt.values(), weights=kjt.weights_or_none(), lengths=kjt.lengths(),
                             length_per_key=kjt.length_per_key_or_none(), validate=False, **vbe)


def _message(where: str, b: IdBound, bad: int) -> str:
    return (f"{where}table '{b.table}', feature '{b.feature}': id {bad} is out of range; "
            f"expected 0 <= id < num_embeddings = {b.rows}")


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
    apply_id_policy(kjt, {f: [IdBound(f, f, feature_table.get(f, "?"), n)] for f, n in feature_rows.items()},
                    "error", where)


def apply_id_policy(
    kjt: KeyedJaggedTensor,
    bounds: Mapping[str, Sequence[IdBound]],
    on_invalid_id: str = "error",
    where: str = "",
) -> KeyedJaggedTensor:
    """Apply ``on_invalid_id`` (see the module docstring) to ``kjt``.

    Args:
        kjt: input ids (any device; reads one min/max per key on the host).
        bounds: KJT key -> the lookups it feeds (keys absent here are passed through
            unchecked).  A key with several lookups of different row counts is
            expanded under ``zero`` into one key per lookup (``IdBound.key``).
        on_invalid_id: ``error`` | ``zero``.
        where: message prefix naming the batch's source.

    Returns:
        ``kjt`` itself when every id is valid and no key needs expanding; else a
        new KJT without the invalid ids (lengths, weights and ``length_per_key``
        shortened accordingly).

    Raises:
        EmbeddingIdError: (``error``) the first invalid (feature, table) in key, then table order.
        ValueError: an unknown policy.
    """
    _check_policy(on_invalid_id)
    keys = kjt.keys()
    values = kjt.values()
    if not any(k in bounds for k in keys):
        return kjt
    opk = kjt.offset_per_key()
    # per key: (lo, hi) of its ids, None when it has none
    ranges: list[tuple[int, int] | None] = []
    for i, k in enumerate(keys):
        s, e = opk[i], opk[i + 1]
        if k not in bounds or s == e:
            ranges.append(None)
            continue
        lo, hi = torch.aminmax(values[s:e])
        ranges.append((int(lo), int(hi)))

    def invalid(r: tuple[int, int] | None, rows: int) -> bool:
        return r is not None and (r[0] < 0 or r[1] >= rows)

    if on_invalid_id == "error":
        for i, k in enumerate(keys):
            for b in bounds.get(k, ()):
                if invalid(ranges[i], b.rows):
                    lo, hi = ranges[i]  # type: ignore[misc]
                    raise EmbeddingIdError(_message(where, b, lo if lo < 0 else hi))
        return kjt

    # zero: output keys (expanded where one key feeds tables of different sizes), each with its limit
    src: list[int] = []
    out_keys: list[str] = []
    limits: list[int | None] = []
    for i, k in enumerate(keys):
        bs = list(bounds.get(k, ()))
        rows = {b.rows for b in bs}
        if len(rows) > 1:
            for b in bs:
                src.append(i)
                out_keys.append(b.key)
                limits.append(b.rows)
        else:
            src.append(i)
            out_keys.append(k)
            limits.append(rows.pop() if rows else None)
    dirty = [n is not None and invalid(ranges[i], n) for i, n in zip(src, limits)]
    out = kjt if src == list(range(len(keys))) else with_keys(kjt.permute(src), out_keys)
    if not any(dirty):
        return out
    v, lengths, w = out.values(), out.lengths(), out.weights_or_none()
    lpk = out.length_per_key()
    big = torch.iinfo(torch.int64).max
    limit = torch.repeat_interleave(
        torch.tensor([n if n is not None else big for n in limits], dtype=torch.int64, device=v.device),
        torch.tensor(lpk, dtype=torch.int64, device=v.device), output_size=v.numel(),
    )
    valid = (v >= 0) & (v < limit)
    bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=v.device), lengths.to(torch.int64),
                                  output_size=v.numel())
    dropped = torch.zeros(lengths.numel(), dtype=lengths.dtype, device=lengths.device)
    dropped.index_add_(0, bag[~valid], torch.ones_like(bag[~valid], dtype=lengths.dtype))
    new_lpk = [int(x) for x in torch.stack([valid[s:e].sum() for s, e in zip(_cum(lpk), _cum(lpk)[1:])]).tolist()] \
        if lpk else []
    vbe = out._vbe_kwargs()
    return KeyedJaggedTensor(out.keys(), v[valid], weights=None if w is None else w[valid],
                             lengths=lengths - dropped, length_per_key=new_lpk, validate=False, **vbe)


def _cum(xs: Sequence[int]) -> list[int]:
    out = [0]
    for x in xs:
        out.append(out[-1] + int(x))
    return out
