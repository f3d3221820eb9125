"""EmbeddingBagCollection on FBGEMM table-batched embeddings (TBE) or torch.

Two compute kernels (TorchRec's names):

* ``fused``: one FBGEMM ``SplitTableBatchedEmbeddingBagsCodegen`` per pooling
  mode holds all tables; the embedding optimizer runs inside the TBE backward
  (no gradient tensor for the tables is ever materialised).  TBE needs
  ``embedding_dim % 4 == 0``; a table whose dim is not a multiple of 4 is served
  by the ``dense`` kernel instead (logged once), with identical math.
* ``dense``: one ``torch.nn.EmbeddingBag(mode="sum", sparse=True)`` per table;
  gradients are sparse and go to a regular optimizer
  (:func:`dlrmctl.optim.dense.embedding_optimizer_for_dense`), which implements
  the same update rules as FBGEMM's fused optimizers.  This is also what runs
  when ``fbgemm_gpu`` is not installed.

Pooling: ``sum`` is ``sum_i w_i e_{id_i}``; ``mean`` is that sum divided by the
bag length (number of ids, not the sum of weights) — FBGEMM's ``PoolingMode.MEAN``
semantics.  An empty bag pools to zeros for both.

Weight initialisation: :mod:`dlrmctl.modules.table_init` (deterministic per ``(seed, table,
block)``, so any shard initialises alone to the unsharded values).  The lookup base shared with the
sequence collection and the sharded ones is :mod:`dlrmctl.modules.lookup`; the tables' features
and output keys are :mod:`dlrmctl.modules.table_features` (their names importable from here).

TorchRec compatibility: ``EmbeddingBagCollection(tables, is_weighted=False,
device=None)`` is TorchRec's signature (dlrmctl's options are keyword-only
after it); built directly it defaults to the ``dense`` kernel, whose backward
fills ``.grad`` for the user's optimizer as TorchRec's unsharded module does
(``compute_kernel="fused"`` moves the optimizer into backward); ``ebc.embedding_bags[name].weight`` is each table's ``[rows, dim]``
weight for both kernels, and ``state_dict()`` holds exactly
``embedding_bags.<table>.weight`` per table.
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

import torch
from torch import nn

from dlrmctl import _fbgemm
from dlrmctl.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from dlrmctl.modules.lookup import DenseTable, LookupOwner, LookupTables, TableWeight, build_tbe, torch_dtype
from dlrmctl.modules.lookup import EmbeddingOptimizerSpec, FusedOptimizer  # noqa: F401  (importable from here too)
from dlrmctl.modules.lookup import fused_supports_optimizer, fused_supports_weight_decay, only_embedding_bags
from dlrmctl.modules.sequence_embeddings import EmbeddingCollection  # noqa: F401  (TorchRec's module holds it too)
from dlrmctl.modules.table_features import (  # noqa: F401  (importable from here too)
    TableFeatures,
    embedding_names_by_table,
    table_id_bounds,
)
from dlrmctl.modules.table_init import INIT_BLOCK_ROWS, init_shard_weight, init_table_rows  # noqa: F401
from dlrmctl.optim.registry import embedding_optimizer
from dlrmctl.sparse import KeyedJaggedTensor, KeyedTensor, SparseInputError
from dlrmctl.sparse.jagged_tensor import expand_by_inverse_indices, split_variable_batch
from dlrmctl.sparse.validation import EmbeddingIdError  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

class EmbeddingBagCollection(LookupOwner, TableFeatures):
    """Pooled lookups of several tables: ``KeyedJaggedTensor -> KeyedTensor``.

    Signature and argument order as ``torchrec.EmbeddingBagCollection(tables,
    is_weighted=False, device=None)``; dlrmctl's options are keyword-only.

    Args:
        tables: table configs; each table's ``feature_names`` are the KJT keys it serves.
        is_weighted: inputs carry per-id weights (``kjt.weights()``), applied to every
            feature of every table (one flag for the collection, as TorchRec's); a feature whose
            ids carry no weight takes weight 1.0.  Unlike TorchRec, a KJT with weights given to
            an unweighted collection (TorchRec ignores them silently) or without weights given
            to a weighted one raises ``SparseInputError``.
        device: where tables live (``cpu`` / ``cuda``; default cpu).  ``meta``: tables without
            storage (shapes only, nothing allocated or initialised, TorchRec's meta-device
            construction); :meth:`materialize` gives them empty storage to load a checkpoint into.
        compute_kernel: (keyword-only) ``dense`` (default: ``nn.EmbeddingBag``; backward
            puts sparse gradients on ``embedding_bags.<t>.weight`` and your optimizer
            updates them — TorchRec's unsharded semantics; use a sparse-capable optimizer
            such as :func:`dlrmctl.optim.dense.embedding_optimizer_for_dense`) or ``fused``
            (FBGEMM TBE with the optimizer applied INSIDE backward, no ``.grad`` — what
            TorchRec's sharded modules and dlrmctl's trainer use).
        optimizer: (keyword-only) hyper-parameters of the fused optimizer
            (``fused`` kernel); ignored by dense tables (their optimizer is built
            by the trainer).
        seed: (keyword-only) weight initialisation seed (see :func:`init_table_rows`).
        check_ids: (keyword-only) apply ``on_invalid_id`` on every forward (cheap:
            one min/max per feature, read on the host).  ``False``: the caller
            has applied it (the trainer's loaders do, on the CPU batch); ids
            outside their table are then not detected.
        on_invalid_id: (keyword-only) ``error`` (default: raise
            :class:`EmbeddingIdError`) or ``zero`` (an invalid id is dropped from
            its bag: it adds a zero row, a mean counts only the valid ids); see
            :mod:`dlrmctl.sparse.validation`.

    Attributes:
        embedding_bags: ``nn.ModuleDict`` table name -> module whose ``.weight``
            is the table's live ``[num_embeddings, embedding_dim]`` float32
            weight, for both kernels (as TorchRec's ``embedding_bags``).

    ``state_dict()`` holds exactly ``embedding_bags.<table>.weight`` per table
    (the fused optimizer's state is in ``fused_optimizer().state_dict()``);
    ``load_state_dict()`` copies such weights in (shape-checked).

    Forward:
        ``features``: KJT with (at least) every feature of every table, 1-D
        integer ids, batch size ``B``.  Returns a KeyedTensor with one key per
        (table, feature) lookup in table order -- the feature name, or
        ``feature@table`` for a feature listed under several tables (TorchRec's
        naming) -- values ``[B, sum over lookups of their table's dim]`` float32.

    Raises:
        ValueError: (init) duplicate or empty table names, an unsupported config
            (pooling NONE, non-FP32 data type, pruning), an unknown compute kernel.
        EmbeddingIdError: (forward) an id outside its table (``check_ids`` and ``on_invalid_id: error``).
        KeyError: (forward) a feature missing from the input.
        SparseInputError: (forward) values that are not 1-D integer ids; weights given to an
            unweighted collection, or missing for a weighted one.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        *,
        compute_kernel: str = "dense",
        optimizer: EmbeddingOptimizerSpec | None = None,
        seed: int = 0,
        check_ids: bool = True,
        on_invalid_id: str = "error",
    ) -> None:
        if not isinstance(is_weighted, bool):
            raise TypeError(
                f"EmbeddingBagCollection: is_weighted must be a bool, got {is_weighted!r}; the argument order is "
                "TorchRec's (tables, is_weighted=False, device=None): pass device= by keyword"
            )
        super().__init__(tables, is_weighted, check_ids, on_invalid_id)
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        self._optimizer = optimizer or EmbeddingOptimizerSpec()
        self._seed = seed
        if compute_kernel == "fused" and not _fbgemm.fused_kernel_available():
            log.warning("fbgemm_gpu is not installed: using the dense (torch.nn.EmbeddingBag) kernel")
            compute_kernel = "dense"
        if compute_kernel not in ("fused", "dense"):
            raise ValueError(f"compute_kernel must be 'fused' or 'dense', got {compute_kernel!r}")
        self.compute_kernel = compute_kernel
        self._build_lookup(init=True)
        self.register_state_dict_post_hook(only_embedding_bags)
        #: remappers of the managed-collision tables (raw ids -> rows before the lookup), or None
        self.managed_collision: nn.Module | None = None

    def set_managed_collision(self, mc: nn.Module) -> None:
        """Run ``mc`` (a :class:`~dlrmctl.modules.managed_collision.ManagedCollisionCollection` over
        some of the tables) on the input before every lookup; its features hold raw ids, so they are
        no longer range-checked (the rows it gives always are in range)."""
        self.managed_collision = mc
        managed = set(mc.tables())
        self._bounds = {e: [b for b in bs if b.table not in managed] for e, bs in self._bounds.items()}
        self._bounds = {e: bs for e, bs in self._bounds.items() if bs}

    def _build_lookup(self, init: bool) -> None:
        """(Re)build ``lookup`` and the ``embedding_bags`` views on :attr:`device` with the compute
        kernel asked for at construction; ``init=False``: uninitialised storage (:meth:`materialize`)."""
        self.lookup = GroupedEmbeddingLookup(
            [(t, t.num_embeddings, t.embedding_dim, 0, 0) for t in self._lookup_tables],
            compute_kernel=self.compute_kernel,
            device=self._device,
            optimizer=self._optimizer,
            is_weighted=self._is_weighted,
            seed=self._seed,
            init=init,
        )
        self.embedding_bags = nn.ModuleDict({t.name: TableWeight(self.lookup, t) for t in self._tables})

    @property
    def device(self) -> torch.device:
        """Where the tables live."""
        return self._device

    def materialize(self, device: torch.device | str) -> None:
        """Give the tables storage on ``device``, uninitialised (``torch.empty``): for a collection
        built on the ``meta`` device, to load a checkpoint into (no random-init pass over tables
        about to be overwritten).  The lookup is rebuilt with the compute kernel asked for at
        construction (FBGEMM's fused TBE initialises its own storage when it is built); call
        :meth:`reset_parameters` for the deterministic initial weights instead.

        Memory: exactly the tables' ``sum(rows * dim) * 4`` bytes on ``device`` (pages of a CPU
        ``torch.empty`` are only committed when written).
        """
        self._device = torch.device(device)
        self._build_lookup(init=False)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled lookups: ``KeyedTensor [B, sum(dims)]`` (keys: :meth:`embedding_names`).

        A variable-batch KJT (TorchRec's VBE: ``stride_per_key_per_rank`` + ``inverse_indices``)
        is looked up once per distinct bag (each key padded with empty bags to the largest
        per-key batch) and expanded back to the full batch ``B = inverse_indices[1].shape[1]``.

        Raises:
            SparseInputError: a variable-batch KJT without inverse indices.
        """
        if self.managed_collision is not None:
            features = self.managed_collision(features, self)
        features, inv = split_variable_batch(self.prepare_features(features))
        out = KeyedTensor(self._embedding_names, self._length_per_key, self.lookup(features))
        return out if inv is None else expand_by_inverse_indices(out, inv)

    # ------------------------------------------------------- weights / state
    def reset_parameters(self) -> None:
        """Re-initialise every table (deterministic init, then the configs' ``init_fn``)."""
        self.lookup.reset_parameters(self._seed)

    def embedding_weights(self) -> dict[str, torch.Tensor]:
        """Table name -> ``[rows, dim]`` weight (a view into the TBE for fused tables)."""
        return self.lookup.table_weights()



class GroupedEmbeddingLookup(LookupTables, nn.Module):
    """Local lookups over a list of (possibly sharded) tables.

    The building block used both by the unsharded EmbeddingBagCollection and by
    each rank's part of a sharded one.

    Args:
        shards: per shard ``(config, rows, cols, row_offset, col_offset)``: the
            local block of table ``config`` to hold; features looked up are
            ``config.feature_names``; ids given to :meth:`forward` are already
            local (``0 <= id < rows``).
        compute_kernel: ``fused`` or ``dense`` (dims not divisible by 4 -> dense; on the
            ``meta`` device every shard is a storage-less dense table).
        pooling_override: force ``sum`` pooling (row-wise sharding pools sums
            per shard and divides by the full bag length after the reduce).
        init: draw the deterministic initial weights (:meth:`reset_parameters`); False:
            dense-kernel shards are left uninitialised (``torch.empty``), for a checkpoint to
            be loaded into (FBGEMM's TBE constructor always initialises its own storage).

    Forward:
        ``features``: KJT whose keys are exactly the shards' features in shard
        order (one key per (shard, feature)), local ids.  Returns ``[B, sum of
        cols over (shard, feature)]`` in that order.
    """

    def __init__(
        self,
        shards: Sequence[tuple[EmbeddingBagConfig, int, int, int, int]],
        compute_kernel: str,
        device: torch.device,
        optimizer: EmbeddingOptimizerSpec,
        is_weighted: bool,
        seed: int = 0,
        pooling_override: PoolingType | None = None,
        init: bool = True,
    ) -> None:
        super().__init__()
        self._shards = list(shards)
        self._device = device
        if torch.device(device).type == "meta":
            compute_kernel = "dense"  # shapes only: no FBGEMM storage to build
        self._spec = optimizer
        self._is_weighted = is_weighted
        # shard key: table name (unique per rank: one shard of a table per lookup)
        self._names = [cfg.name for cfg, *_ in self._shards]
        if len(set(self._names)) != len(self._names):
            raise ValueError(f"a lookup holds at most one shard per table, got {self._names}")
        if compute_kernel == "fused" and not _fbgemm.fused_kernel_available():
            compute_kernel = "dense"
        if compute_kernel == "fused" and not fused_supports_optimizer(optimizer.type, device):
            # FBGEMM's CPU TBE has no Adam / LAMB: the dense kernel runs the same update rule
            log.info("embedding optimizer %s on %s: FBGEMM's fused CPU kernel does not implement it; using the "
                     "dense kernel", optimizer.type, torch.device(device).type)
            compute_kernel = "dense"
        if (compute_kernel == "fused" and torch.device(device).type == "cuda"
                and embedding_optimizer(optimizer.type).global_step):  # FBGEMM's Adam / LAMB family
            log.warning("embedding optimizer %s: FBGEMM marks its fused CUDA Adam / LAMB kernels experimental "
                        "(never run by dlrmctl on a GPU); exact_rowwise_adagrad is the default and the fastest "
                        "(one fp32 of state per row)", optimizer.type)
        # FBGEMM's TBE counts its step (`iter`, the Adam family's bias correction) in every forward,
        # evaluation included: eval forwards put it back (see _tbe_forward)
        self._step_in_forward = embedding_optimizer(optimizer.type).global_step
        if compute_kernel == "fused" and optimizer.weight_decay and not fused_supports_weight_decay(optimizer.type, device):
            # FBGEMM's CPU TBE (and exact_sgd everywhere) ignores weight_decay: the dense kernel
            # applies the same L2 rule to the rows looked up (dlrmctl.optim)
            log.warning("embedding weight_decay %g with %s on %s: FBGEMM's fused kernel would ignore it; "
                     "using the dense kernel", optimizer.weight_decay, optimizer.type, torch.device(device).type)
            compute_kernel = "dense"
        self._pooling = [pooling_override or cfg.pooling for cfg, *_ in self._shards]
        # All fused shards (dim % 4 == 0) share one TBE in SUM mode; the others are dense
        # tables.  Mean pooling is applied after the lookup for both kernels (divide by
        # the bag length), which keeps one TBE per lookup and the backward exact
        # (FBGEMM's MEAN mode with per-sample weights has a backward that does not match
        # its forward).
        fused_idx: list[int] = []
        dense_idx: list[int] = []
        for i, (cfg, rows, cols, _, _) in enumerate(self._shards):
            if compute_kernel == "fused" and cols % 4 == 0 and rows > 0:
                fused_idx.append(i)
            else:
                if compute_kernel == "fused" and rows > 0:
                    log.info("table '%s': dim %d is not a multiple of 4; using the dense kernel", cfg.name, cols)
                dense_idx.append(i)
        self.tbes = nn.ModuleList()
        self.dense_tables = nn.ModuleDict()
        self._tbe_members: list[list[int]] = []
        if fused_idx:
            self.tbes.append(self._make_tbe(fused_idx))
            self._tbe_members.append(fused_idx)
        for i in dense_idx:
            cfg, rows, cols, _, _ = self._shards[i]
            self.dense_tables[cfg.name] = DenseTable(rows, cols, device, torch_dtype(cfg.data_type), init=init)
        self._dense_members = dense_idx
        if init:
            self.reset_parameters(seed)
        # output column layout: per (shard, feature) in shard order
        self._feat_keys = [f for cfg, *_ in self._shards for f in cfg.feature_names]
        self._feat_cols = [cols for cfg, _, cols, _, _ in self._shards for _ in cfg.feature_names]
        self._feat_mean = [self._pooling[i] == PoolingType.MEAN for i, (cfg, *_) in enumerate(self._shards) for _ in cfg.feature_names]
        self._any_mean = any(self._feat_mean)
        self.register_buffer("_mean_mask", torch.tensor(self._feat_mean, dtype=torch.bool, device=device), persistent=False)
        self.register_buffer("_feat_cols_t", torch.tensor(self._feat_cols, dtype=torch.int64, device=device), persistent=False)
        key_start, k = [], 0
        for cfg, *_ in self._shards:
            key_start.append(k)
            k += len(cfg.feature_names)
        self._key_start = key_start
        fused_sel = [key_start[i] + j for i in fused_idx for j in range(len(self._shards[i][0].feature_names))]
        self._fused_sel = None if fused_sel == list(range(len(self._feat_keys))) else fused_sel

    def _make_tbe(self, idxs: list[int]) -> nn.Module:
        return build_tbe([self._shards[i] for i in idxs], self._spec, self._device, pooled=True)

    def _tbe_forward(self, tbe: nn.Module, *args, **kwargs) -> torch.Tensor:
        """``tbe(*args)``; in eval mode with an Adam-family optimizer the TBE's step counter
        (``iter`` / ``iter_cpu``, advanced by FBGEMM in every forward) is restored afterwards,
        so the bias correction counts training steps only (as the dense kernel's optimizer)."""
        if self.training or not self._step_in_forward or not hasattr(tbe, "iter"):
            return tbe(*args, **kwargs)
        it = tbe.iter.detach().clone()
        it_cpu = tbe.iter_cpu.detach().clone() if torch.is_tensor(getattr(tbe, "iter_cpu", None)) else None
        try:
            return tbe(*args, **kwargs)
        finally:
            tbe.iter.copy_(it)
            if it_cpu is not None:
                tbe.iter_cpu.copy_(it_cpu)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Deterministic, sharding-independent init of every local shard (:func:`init_shard_weight`:
        bounds ``[cfg.get_weight_init_min(), cfg.get_weight_init_max()]``, drawn block by block
        and copied onto the shard's device, then ``cfg.init_fn``).  Meta shards are skipped."""
        for name, w in self.table_weights().items():
            cfg, rows, cols, r0, c0 = self._shards[self._names.index(name)]
            init_shard_weight(w, cfg, r0, c0, seed)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        B = features.stride()
        keys = features.keys()
        if keys != self._feat_keys:
            raise KeyError(f"lookup expects features {self._feat_keys}, got {keys}")
        weights = features.weights_or_none() if self._is_weighted else None
        parts: dict[int, torch.Tensor] = {}
        if self._tbe_members:
            sub = features if self._fused_sel is None else features.permute(self._fused_sel)
            out = self._tbe_forward(
                self.tbes[0], sub.values(), sub.offsets(),
                per_sample_weights=sub.weights_or_none() if self._is_weighted else None,
            )
            if self._fused_sel is None and not self._dense_members:
                return self._apply_mean(out, features)
            col = 0
            for i in self._tbe_members[0]:
                cfg, _, cols, _, _ = self._shards[i]
                w = cols * len(cfg.feature_names)
                parts[i] = out[:, col : col + w]
                col += w
        if self._dense_members:
            offsets = features.offsets()
            values = features.values()
            opk = features.offset_per_key()
            for i in self._dense_members:
                cfg, rows, cols, _, _ = self._shards[i]
                n = len(cfg.feature_names)
                if rows == 0:  # an empty row shard holds no weights
                    parts[i] = torch.zeros(B, n * cols, device=values.device)
                    continue
                # the table's features are consecutive keys: ONE bag lookup over all of them (one use
                # of the weight in the graph: a second use would make autograd add two sparse fp16
                # gradients, which torch's CPU kernel cannot do), rows [n*B, cols] feature-major.
                # Also for keys with no ids (zero-size batch, all bags empty): zeros that stay
                # connected to the table, so backward runs and leaves every row unchanged
                k = self._key_start[i]
                s0, s1 = opk[k], opk[k + n]
                offs = offsets[k * B : (k + n) * B + 1] - s0
                pooled = self.dense_tables[cfg.name](values[s0:s1], offs, None if weights is None else weights[s0:s1])
                parts[i] = pooled if n == 1 else pooled.view(n, B, cols).transpose(0, 1).reshape(B, n * cols)
        if not parts:
            return torch.zeros(B, 0, device=features.values().device)
        out = torch.cat([parts[i] for i in range(len(self._shards))], dim=1)
        return self._apply_mean(out, features)

    def _apply_mean(self, pooled: torch.Tensor, features: KeyedJaggedTensor) -> torch.Tensor:
        """Divide the columns of mean-pooled features by their bag lengths (empty bag -> 0)."""
        if not self._any_mean:
            return pooled
        lengths = features.lengths_2d().t().to(pooled.dtype)  # [B, F]
        div = torch.where(self._mean_mask, lengths.clamp(min=1), torch.ones_like(lengths))
        # output_size: known on the host (no device read of the repeats on CUDA)
        return pooled / torch.repeat_interleave(div, self._feat_cols_t, dim=1, output_size=pooled.shape[1])
