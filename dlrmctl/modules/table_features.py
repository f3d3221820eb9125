"""What every embedding-bag collection (unsharded, sharded, placeholder) knows about its tables:
:class:`TableFeatures` (the configs, the KJT keys they read, the output key of each lookup, the
id bounds ``on_invalid_id`` applies), with TorchRec's output-name rule
(:func:`embedding_names_by_table`) and the per-feature bounds the loaders use
(:func:`table_id_bounds`)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from torch import nn

from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
from dlrmctl.modules.lookup import check_trainable
from dlrmctl.sparse import KeyedJaggedTensor, SparseInputError
from dlrmctl.sparse.validation import ON_INVALID_ID, IdBound, apply_id_policy, with_keys

__all__ = ["TableFeatures", "embedding_names_by_table", "table_id_bounds"]


def embedding_names_by_table(tables: Sequence[EmbeddingBagConfig]) -> list[list[str]]:
    """Output keys of each table's lookups, TorchRec's rule (``get_embedding_names_by_table``):
    a feature looked up in one table keeps its name; a feature listed under several
    tables is ``"<feature>@<table>"`` in each of them."""
    count: dict[str, int] = {}
    for t in tables:
        for f in t.feature_names:
            count[f] = count.get(f, 0) + 1
    return [[f if count[f] == 1 else f"{f}@{t.name}" for f in t.feature_names] for t in tables]


def table_id_bounds(tables: Sequence[EmbeddingBagConfig]) -> dict[str, list[IdBound]]:
    """Input feature -> the lookups it feeds (output key, table, rows), in table order: what the
    loaders apply ``on_invalid_id`` with (``BatchLoader(id_bounds=...)``)."""
    out: dict[str, list[IdBound]] = {}
    for t, names in zip(tables, embedding_names_by_table(tables)):
        for f, e in zip(t.feature_names, names):
            out.setdefault(f, []).append(IdBound(e, f, t.name, t.num_embeddings))
    return out


class TableFeatures(nn.Module):
    """What every embedding-bag collection (unsharded, sharded, placeholder) knows
    about its tables: the table configs, the KJT keys they read, the output key of
    each (feature, table) lookup in table order, each lookup's width and id range.

    A feature may be listed under several tables: it is read once from the input
    and looked up in each of them; the output keys follow TorchRec's rule
    (:func:`embedding_names_by_table`: ``feature@table`` for a shared feature).
    Internally every lookup is keyed by its output key, so lookups and sharding
    never see a duplicate key.

    Args:
        tables: table configs (unique names).
        is_weighted: inputs carry per-id weights.
        check_ids: :meth:`prepare_features` applies ``on_invalid_id``.
        on_invalid_id: ``error`` | ``zero`` (:mod:`dlrmctl.sparse.validation`).

    Raises:
        ValueError: duplicate or empty table names; a feature listed twice in one
            table; a config dlrmctl cannot train (pooling ``NONE``, a data type
            other than FP32, pruning); an unknown ``on_invalid_id``.
    """

    def __init__(self, tables: Sequence[EmbeddingBagConfig], is_weighted: bool = False, check_ids: bool = True,
                 on_invalid_id: str = "error") -> None:
        super().__init__()
        self._tables = list(tables)
        names = [t.name for t in self._tables]
        if len(set(names)) != len(names):
            raise ValueError(f"{type(self).__name__}: duplicate table names {names}")
        for t in self._tables:
            check_trainable(t, type(self).__name__)
            dup = sorted({f for f in t.feature_names if t.feature_names.count(f) > 1})
            if dup:
                raise ValueError(f"{type(self).__name__}: table '{t.name}' lists feature(s) {dup} more than once")
            reserved = [f for f in t.feature_names if "@" in f]
            if reserved:
                raise ValueError(f"{type(self).__name__}: table '{t.name}': feature name(s) {reserved} contain '@', "
                                 "which is reserved for the feature@table outputs of shared features")
        if on_invalid_id not in ON_INVALID_ID:
            raise ValueError(f"on_invalid_id must be one of {list(ON_INVALID_ID)}, got {on_invalid_id!r}")
        self._is_weighted = is_weighted
        self._check_ids = check_ids
        self.on_invalid_id = on_invalid_id
        by_table = embedding_names_by_table(self._tables)
        #: output keys, one per (table, feature) lookup in table order
        self._embedding_names: list[str] = [e for names in by_table for e in names]
        #: the input feature each output key reads
        self._embedding_source: list[str] = [f for t in self._tables for f in t.feature_names]
        self._feature_names: list[str] = list(dict.fromkeys(self._embedding_source))
        #: the configs the lookups and shardings are built from: feature_names = output keys
        self._lookup_tables = self._tables if by_table == [t.feature_names for t in self._tables] else [
            dataclasses.replace(t, feature_names=list(n)) for t, n in zip(self._tables, by_table)
        ]
        self._bounds = {
            e: [IdBound(e, f, t.name, t.num_embeddings)]
            for t, names in zip(self._tables, by_table) for f, e in zip(t.feature_names, names)
        }
        self._length_per_key = [t.embedding_dim for t in self._tables for _ in t.feature_names]

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._tables

    def is_weighted(self) -> bool:
        return self._is_weighted

    def feature_names(self) -> list[str]:
        """KJT keys read (each once, in table order of first use)."""
        return self._feature_names

    def embedding_names(self) -> list[str]:
        """Keys of the output KeyedTensor, one per (table, feature) lookup in table order:
        the feature name, or ``feature@table`` for a feature shared by several tables."""
        return self._embedding_names

    def prepare_features(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``features`` as one key per lookup (the output keys, in table order), with
        ``on_invalid_id`` applied when ``check_ids``.

        Lookup ``feature@table`` of a shared feature reads the input key
        ``feature@table`` when there is one (a loader applying ``zero`` gives each
        table its own filtered copy), else ``feature``.

        Raises:
            KeyError: a feature is missing.  EmbeddingIdError: an id outside its table
            (``on_invalid_id: error``).  SparseInputError: values are not 1-D integer ids;
            per-id weights given to an unweighted collection (TorchRec silently ignores
            them) or missing for a weighted one.
        """
        v = features.values()
        if v.dim() != 1 or v.is_floating_point() or v.is_complex():
            raise SparseInputError(
                f"{type(self).__name__}: KJT values must be 1-D integer ids, got shape {tuple(v.shape)} {v.dtype}"
            )
        has_w = features.weights_or_none() is not None
        if has_w != self._is_weighted:
            who = (f"{type(self).__name__} (tables {[t.name for t in self._tables]}, "
                   f"features {self._feature_names})")
            if has_w:
                raise SparseInputError(
                    f"{who} is unweighted (is_weighted=False) but the KJT carries per-id weights; they would "
                    "be ignored (TorchRec ignores them silently). Build it with is_weighted=True (YAML: "
                    "model.tables[].weighted: true) or pass a KJT without weights"
                )
            raise SparseInputError(
                f"{who} is weighted (is_weighted=True) but the KJT has no per-id weights; pass "
                "KeyedJaggedTensor(..., weights=...) (1.0 for ids that carry no weight)"
            )
        keys = features.keys()
        if keys != self._embedding_names:
            idx = features.index_per_key()
            src = [e if e in idx else f for e, f in zip(self._embedding_names, self._embedding_source)]
            features = with_keys(features.select_keys(src), self._embedding_names)
        if self._check_ids:
            features = apply_id_policy(features, self._bounds, self.on_invalid_id)
        return features
