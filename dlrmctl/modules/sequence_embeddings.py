"""EmbeddingCollection: unpooled (sequence) lookups, ``KeyedJaggedTensor -> dict[str, JaggedTensor]``.

Every id gets its own embedding row (TorchRec's ``EmbeddingCollection``): for a
feature with ``N_f`` ids in ``B`` bags, the output JaggedTensor has values
``[N_f, D]`` float32 (rows in input order) and the input's ``lengths [B]``.

Two compute kernels (TorchRec's names), with identical forward and updates:

* ``fused``: FBGEMM ``SplitTableBatchedEmbeddingBagsCodegen`` with
  ``pooling_mode=PoolingMode.NONE`` (the sequence TBE; it runs on the CPU build
  ``fbgemm-gpu-cpu`` 1.8), one TBE per distinct width (FBGEMM's sequence mode
  needs every table of one TBE to have the same dim), the embedding optimizer
  fused into its backward exactly as in the EmbeddingBagCollection.  A shard
  whose width is not a multiple of 4 (TBE's requirement) is served by the dense
  kernel, as in the EmbeddingBagCollection.
* ``dense``: one ``torch.nn.Embedding(sparse=True)`` per table; sparse
  gradients go to the torch embedding optimizers of
  :func:`dlrmctl.optim.dense.embedding_optimizer_for_dense` (same update rules).

Initial weights are the deterministic, sharding-independent values of
:func:`dlrmctl.modules.table_init.init_table_rows` (then the config's
``init_fn``), so a sharded table (:mod:`dlrmctl.distributed.sharded_ec`) starts
from exactly the unsharded values.

:class:`SequenceEmbeddingLookup` is the building block of both the unsharded
EmbeddingCollection and each rank's part of a sharded one.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
from torch import nn

from dlrmctl import _fbgemm
from dlrmctl.modules.embedding_configs import DataType, EmbeddingBagConfig, EmbeddingConfig
from dlrmctl.modules.lookup import (
    EmbeddingOptimizerSpec,
    LookupOwner,
    LookupTables,
    TableWeight,
    build_tbe,
    fused_supports_optimizer,
    fused_supports_weight_decay,
    only_embedding_bags,
)
from dlrmctl.modules.table_init import init_shard_weight
from dlrmctl.sparse import JaggedTensor, KeyedJaggedTensor, SparseInputError
from dlrmctl.sparse.validation import check_ids

log = logging.getLogger(__name__)

__all__ = ["EmbeddingCollection", "SequenceEmbeddingLookup", "SequenceTableFeatures", "sequence_jagged_tensor"]


def check_sequence_tables(tables: Sequence[EmbeddingConfig], who: str) -> None:
    """Refuse table lists an EmbeddingCollection cannot serve (rather than ignore what they ask).

    Raises:
        ValueError: a pooled config (EmbeddingBagConfig), an empty or duplicate
            name, tables of different ``embedding_dim`` (TorchRec's rule for an
            EmbeddingCollection), a feature looked up in two tables, a data type
            other than FP32, pruning.
    """
    names: set[str] = set()
    feats: dict[str, str] = {}
    dim = None
    for t in tables:
        if isinstance(t, EmbeddingBagConfig):
            raise ValueError(
                f"{who}: table '{t.name}' is an EmbeddingBagConfig (pooled); an EmbeddingCollection takes "
                "EmbeddingConfig tables (pooled tables go to an EmbeddingBagCollection)"
            )
        if not t.name:
            raise ValueError(f"{who}: every table needs a name (EmbeddingConfig(name=...)); got {t}")
        if t.name in names:
            raise ValueError(f"{who}: duplicate table name {t.name}")
        names.add(t.name)
        if dim is None:
            dim = t.embedding_dim
        elif t.embedding_dim != dim:
            raise ValueError(
                f"{who}: all tables in an EmbeddingCollection are required to have the same embedding dimension "
                f"(as in TorchRec); table '{t.name}' has embedding_dim {t.embedding_dim} != {dim}"
            )
        if t.data_type != DataType.FP32:
            raise ValueError(
                f"{who}: table '{t.name}': data_type {t.data_type} is not trainable; dlrmctl trains FP32 tables"
            )
        if t.num_embeddings_post_pruning is not None:
            raise ValueError(f"{who}: table '{t.name}': row pruning (num_embeddings_post_pruning) is not supported")
        for f in t.feature_names:
            if f in feats:
                raise ValueError(
                    f"{who}: feature '{f}' is looked up in tables '{feats[f]}' and '{t.name}'; "
                    "a feature may feed one table of an EmbeddingCollection"
                )
            feats[f] = t.name


def sequence_jagged_tensor(
    values: torch.Tensor, lengths: torch.Tensor, ids: torch.Tensor | None = None
) -> JaggedTensor:
    """The JaggedTensor of one feature's unpooled embeddings.

    Args:
        values: ``[N, D]`` float32 rows, one per id.
        lengths: ``[B]`` the input bag lengths of the feature.
        ids: ``[N]`` integer ids, put in ``weights()`` (TorchRec's ``need_indices``
            output).  dlrmctl's JaggedTensor constructor requires floating-point
            weights, so they are attached after construction.
    """
    jt = JaggedTensor(values, lengths=lengths, validate=False)
    if ids is not None:
        jt._weights = ids
    return jt


class SequenceEmbeddingLookup(LookupTables, nn.Module):
    """Unpooled local lookups over a list of (possibly sharded) tables.

    Args:
        shards: per shard ``(config, rows, cols, row_offset, col_offset)``: the
            local block of table ``config`` to hold (at most one per table);
            features looked up are ``config.feature_names``; ids given to
            :meth:`forward` are already local (``0 <= id < rows``).
        compute_kernel: ``fused`` or ``dense`` (widths not divisible by 4 -> dense;
            no ``fbgemm_gpu`` -> dense).
        device: where the shards live.
        optimizer: fused optimizer hyper-parameters (``fused`` shards).
        seed: deterministic init seed.

    Forward:
        ``features``: KJT whose keys are exactly the shards' features in shard
        order (one key per (shard, feature)), local integer ids, any batch size.
        Returns one ``[N_k, cols]`` float32 tensor per key ``k`` (``N_k`` = its
        number of ids, rows in input order).

    Raises:
        ValueError: two shards of one table, an unknown kernel or optimizer.
        KeyError: (forward) keys other than the shards' features.
    """

    def __init__(
        self,
        shards: Sequence[tuple[EmbeddingConfig, int, int, int, int]],
        compute_kernel: str,
        device: torch.device,
        optimizer: EmbeddingOptimizerSpec,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self._shards = list(shards)
        self._device = device
        self._spec = optimizer
        self._names = [cfg.name for cfg, *_ in self._shards]
        if len(set(self._names)) != len(self._names):
            raise ValueError(f"a lookup holds at most one shard per table, got {self._names}")
        if compute_kernel not in ("fused", "dense"):
            raise ValueError(f"compute_kernel must be 'fused' or 'dense', got {compute_kernel!r}")
        if compute_kernel == "fused" and not _fbgemm.fused_kernel_available():
            compute_kernel = "dense"
        if compute_kernel == "fused" and optimizer.weight_decay and not fused_supports_weight_decay(optimizer.type, device):
            log.warning("embedding weight_decay with %s: FBGEMM's fused kernel would ignore it; using the dense kernel",
                        optimizer.type)
            compute_kernel = "dense"
        if compute_kernel == "fused" and not fused_supports_optimizer(optimizer.type, device):
            compute_kernel = "dense"  # FBGEMM's CPU TBE has no Adam / LAMB (same rule in dlrmctl.optim)
        self._keys = [f for cfg, *_ in self._shards for f in cfg.feature_names]
        shard_keys: list[list[int]] = []
        k = 0
        for cfg, *_ in self._shards:
            shard_keys.append(list(range(k, k + len(cfg.feature_names))))
            k += len(cfg.feature_names)
        by_width: dict[int, list[int]] = {}
        dense_idx: list[int] = []
        for i, (cfg, rows, cols, _, _) in enumerate(self._shards):
            if compute_kernel == "fused" and cols % 4 == 0 and rows > 0:
                by_width.setdefault(cols, []).append(i)
            else:
                if compute_kernel == "fused" and rows > 0:
                    log.info("table '%s': width %d is not a multiple of 4; using the dense kernel", cfg.name, cols)
                dense_idx.append(i)
        self.tbes = nn.ModuleList()
        self._tbe_members: list[list[int]] = []
        self._tbe_keys: list[list[int]] = []
        for idxs in by_width.values():
            self.tbes.append(self._make_tbe(idxs))
            self._tbe_members.append(idxs)
            self._tbe_keys.append([k for i in idxs for k in shard_keys[i]])
        self.dense_tables = nn.ModuleDict()
        for i in dense_idx:
            cfg, rows, cols, _, _ = self._shards[i]
            self.dense_tables[cfg.name] = nn.Embedding(
                rows, cols, sparse=True, _weight=torch.empty(rows, cols, device=device)
            )
        self._dense_members = dense_idx
        self._dense_keys = [(self._names[i], k) for i in dense_idx for k in shard_keys[i]]
        self.reset_parameters(seed)

    def _make_tbe(self, idxs: list[int]) -> nn.Module:
        return build_tbe([self._shards[i] for i in idxs], self._spec, self._device, pooled=False)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Deterministic, sharding-independent init of every local shard (see :func:`init_shard_weight`)."""
        for name, w in self.table_weights().items():
            cfg, _, _, r0, c0 = self._shards[self._names.index(name)]
            init_shard_weight(w, cfg, r0, c0, seed)

    def forward(self, features: KeyedJaggedTensor) -> list[torch.Tensor]:
        keys = features.keys()
        if keys != self._keys:
            raise KeyError(f"lookup expects features {self._keys}, got {keys}")
        out: list[torch.Tensor | None] = [None] * len(keys)
        lpk = features.length_per_key()
        nkeys = len(keys)
        for tbe, kidx in zip(self.tbes, self._tbe_keys):
            sub = features if len(kidx) == nkeys else features.permute(kidx)
            rows = tbe(sub.values(), sub.offsets())
            if len(kidx) == 1:
                out[kidx[0]] = rows
            else:
                for k, r in zip(kidx, torch.split(rows, [lpk[k] for k in kidx])):
                    out[k] = r
        if self._dense_keys:
            values = features.values()
            opk = features.offset_per_key()
            for name, k in self._dense_keys:
                out[k] = self.dense_tables[name](values[opk[k] : opk[k + 1]])
        return out  # type: ignore[return-value]


class SequenceTableFeatures(nn.Module):
    """What every EmbeddingCollection (unsharded or sharded) knows about its tables:
    the configs, the KJT keys they serve in table order, each feature's id range.

    Args:
        tables: EmbeddingConfig tables (see :func:`check_sequence_tables`).
        need_indices: outputs carry the ids in ``weights()``.
        check_ids: :meth:`prepare_features` validates id ranges.

    Raises:
        ValueError: see :func:`check_sequence_tables`.
    """

    def __init__(self, tables: Sequence[EmbeddingConfig], need_indices: bool = False, check_ids: bool = True) -> None:
        super().__init__()
        self._embedding_configs = list(tables)
        check_sequence_tables(self._embedding_configs, type(self).__name__)
        self._need_indices = bool(need_indices)
        self._check_ids = check_ids
        self._embedding_dim = self._embedding_configs[0].embedding_dim if self._embedding_configs else -1
        self._feature_names: list[str] = [f for t in self._embedding_configs for f in t.feature_names]
        self._feature_rows = {f: t.num_embeddings for t in self._embedding_configs for f in t.feature_names}
        self._feature_table = {f: t.name for t in self._embedding_configs for f in t.feature_names}

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return self._embedding_configs

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_dim(self) -> int:
        """The tables' common embedding dim (-1 without tables)."""
        return self._embedding_dim

    def embedding_names_by_table(self) -> list[list[str]]:
        """Output keys per table: the feature names (a feature feeds one table)."""
        return [list(t.feature_names) for t in self._embedding_configs]

    def feature_names(self) -> list[str]:
        """KJT keys served, in table order (the order of the output dict)."""
        return self._feature_names

    def prepare_features(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``features`` with exactly this collection's keys in table order, ids range-checked.

        Raises:
            KeyError: a feature is missing.  EmbeddingIdError: an id outside its table.
            SparseInputError: values are not 1-D integer ids.
        """
        v = features.values()
        if v.dim() != 1 or v.is_floating_point() or v.is_complex():
            raise SparseInputError(
                f"{type(self).__name__}: KJT values must be 1-D integer ids, got shape {tuple(v.shape)} {v.dtype}"
            )
        if features.keys() != self._feature_names:
            features = features.select_keys(self._feature_names)
        if self._check_ids:
            check_ids(features, self._feature_rows, self._feature_table)
        return features

    def _outputs(self, features: KeyedJaggedTensor, rows: Sequence[torch.Tensor]) -> dict[str, JaggedTensor]:
        """Feature -> JaggedTensor from the prepared input and one ``[N_f, D]`` tensor per feature."""
        # per-key lengths segments: also right for a variable-batch KJT (keys of different batch sizes)
        lengths = torch.split(features.lengths(), features.stride_per_key())
        values = features.values() if self._need_indices else None
        opk = features.offset_per_key() if self._need_indices else None
        out: dict[str, JaggedTensor] = {}
        for k, f in enumerate(self._feature_names):
            ids = values[opk[k] : opk[k + 1]] if values is not None else None  # type: ignore[index]
            out[f] = sequence_jagged_tensor(rows[k], lengths[k], ids)
        return out


class EmbeddingCollection(LookupOwner, SequenceTableFeatures):
    """Unpooled lookups of several tables: ``KeyedJaggedTensor -> dict[str, JaggedTensor]``.

    Signature and argument order as ``torchrec.EmbeddingCollection(tables,
    device=None, need_indices=False)``; dlrmctl's options are keyword-only.

    Args:
        tables: :class:`~dlrmctl.modules.embedding_configs.EmbeddingConfig` tables,
            all of the same ``embedding_dim`` (as in TorchRec); each table's
            ``feature_names`` are the KJT keys it serves (one table per feature).
        device: where tables live (``cpu`` / ``cuda``; default cpu).
        need_indices: put each feature's ids (``[N_f]``, the input's integer
            dtype) in its output JaggedTensor's ``weights()``, as TorchRec does.
        compute_kernel: (keyword-only) ``dense`` (default: ``nn.Embedding(sparse=True)``,
            backward fills ``.grad`` for your optimizer, as TorchRec's unsharded module)
            or ``fused`` (FBGEMM sequence TBE, optimizer applied inside backward).
        optimizer: (keyword-only) hyper-parameters of the fused optimizer.
        seed: (keyword-only) weight initialisation seed (see ``init_table_rows``).
        check_ids: (keyword-only) validate id ranges on every forward.

    Attributes:
        embeddings: ``nn.ModuleDict`` table name -> module whose ``.weight`` is
            the table's live ``[num_embeddings, embedding_dim]`` float32 weight,
            for both kernels (TorchRec's attribute name for an EmbeddingCollection).

    ``state_dict()`` holds exactly ``embeddings.<table>.weight`` per table;
    ``load_state_dict()`` copies such weights in (shape-checked).

    Forward:
        ``features``: KJT with (at least) every feature of every table, 1-D
        integer ids, batch size ``B``.  Returns ``{feature: JaggedTensor}`` in
        table order; each JaggedTensor has values ``[N_f, D]`` float32 (the row
        of every id, in input order), the input's ``lengths [B]`` and, with
        ``need_indices``, the ids as ``weights()``.

    Raises:
        ValueError: (init) see :func:`check_sequence_tables`; an unknown compute kernel.
        EmbeddingIdError: (forward) an id outside its table.
        KeyError: (forward) a feature missing from the input.
        SparseInputError: (forward) values that are not 1-D integer ids.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingConfig],
        device: torch.device | str | None = None,
        need_indices: bool = False,
        *,
        compute_kernel: str = "dense",
        optimizer: EmbeddingOptimizerSpec | None = None,
        seed: int = 0,
        check_ids: bool = True,
    ) -> None:
        super().__init__(tables, need_indices, check_ids)
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        self._optimizer = optimizer or EmbeddingOptimizerSpec()
        self._seed = seed
        if compute_kernel not in ("fused", "dense"):
            raise ValueError(f"compute_kernel must be 'fused' or 'dense', got {compute_kernel!r}")
        if compute_kernel == "fused" and not _fbgemm.fused_kernel_available():
            log.warning("fbgemm_gpu is not installed: using the dense (torch.nn.Embedding) kernel")
            compute_kernel = "dense"
        self.compute_kernel = compute_kernel
        self.lookup = SequenceEmbeddingLookup(
            [(t, t.num_embeddings, t.embedding_dim, 0, 0) for t in self._embedding_configs],
            compute_kernel=compute_kernel,
            device=self._device,
            optimizer=self._optimizer,
            seed=seed,
        )
        self.embeddings = nn.ModuleDict({t.name: TableWeight(self.lookup, t) for t in self._embedding_configs})
        self.register_state_dict_post_hook(only_embedding_bags)  # drops the kernel-specific lookup.* entries

    @property
    def device(self) -> torch.device:
        """Where the tables live."""
        return self._device

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """Unpooled lookups (see the class docstring).  A variable-batch KJT (TorchRec's VBE) is
        looked up once per id as given: each key's JaggedTensor keeps that key's own bags."""
        features = self.prepare_features(features)
        # the lookup needs one stride (empty bags appended to shorter keys add no ids)
        return self._outputs(features, self.lookup(features.to_uniform_stride()))

    # ------------------------------------------------------- weights / state
    def reset_parameters(self) -> None:
        """Re-initialise every table (deterministic init, then the configs' ``init_fn``)."""
        self.lookup.reset_parameters(self._seed)

    def embedding_weights(self) -> dict[str, torch.Tensor]:
        """Table name -> ``[rows, dim]`` weight (a view into the TBE for fused tables)."""
        return self.lookup.table_weights()

    def embedding_dense_parameters(self) -> list[nn.Parameter]:
        """Weights of dense-kernel tables: they need a torch optimizer
        (``dlrmctl.optim.dense.embedding_optimizer_for_dense``)."""
        return self.lookup.dense_parameters()

