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

Weight initialisation is ``U(-sqrt(1/rows), sqrt(1/rows))`` as in the DLRM
reference (``dlrm_s_pytorch.py: create_emb``) and TorchRec (or
``U(weight_init_min, weight_init_max)`` when the config sets them), drawn in
fixed blocks of :data:`INIT_BLOCK_ROWS` rows from a generator seeded by
``(seed, table name, block)``, so any shard of a table can be initialised on
its own rank, without materialising the whole table, and gets exactly the
values the unsharded table would have.  A config's ``init_fn`` then runs on
the (local) weight, as in TorchRec.

TorchRec compatibility: ``EmbeddingBagCollection(tables, is_weighted=False,
device=None)`` is TorchRec's signature (dlrmctl's options are keyword-only
after it); built directly it defaults to the ``dense`` kernel, whose backward
fills ``.grad`` for the user's optimizer as TorchRec's unsharded module does
(``compute_kernel="fused"`` moves the optimizer into backward); ``ebc.embedding_bags[name].weight`` is each table's ``[rows, dim]``
weight for both kernels, and ``state_dict()`` holds exactly
``embedding_bags.<table>.weight`` per table.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from dlrmctl import _fbgemm
from dlrmctl.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from dlrmctl.optim.registry import embedding_optimizer
from dlrmctl.sparse import KeyedJaggedTensor, KeyedTensor, SparseInputError
from dlrmctl.sparse.jagged_tensor import expand_by_inverse_indices, split_variable_batch
from dlrmctl.sparse.validation import EmbeddingIdError  # noqa: F401 (re-exported)
from dlrmctl.sparse.validation import ON_INVALID_ID, IdBound, apply_id_policy, with_keys

log = logging.getLogger(__name__)

INIT_BLOCK_ROWS = 65536


@dataclass
class EmbeddingOptimizerSpec:
    """Embedding optimizer hyper-parameters (FBGEMM ``EmbOptimType`` names).

    Attributes:
        type: ``exact_rowwise_adagrad`` | ``exact_adagrad`` | ``exact_sgd`` | ``adam`` |
            ``partial_rowwise_adam`` | ``lamb`` | ``partial_rowwise_lamb``.
        lr: learning rate.
        eps: epsilon (Adagrad: added to ``sqrt(G)``; Adam family: to ``sqrt(v_hat)``).
        weight_decay: 0: none; Adagrads / SGD: L2 coefficient added to the gradient; Adam
            family: FBGEMM's decoupled ``lr * weight_decay * w`` (rows in the batch only).
        betas: the Adam family's ``(beta1, beta2)``.
    """

    type: str = "exact_rowwise_adagrad"
    lr: float = 0.1
    eps: float = 1e-8
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)


def _stable_seed(seed: int, name: str, block: int) -> int:
    h = hashlib.sha256(f"{seed}:{name}:{block}".encode()).digest()
    return int.from_bytes(h[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


@torch.no_grad()
def init_table_rows(
    out: torch.Tensor,
    table_name: str,
    num_rows: int,
    row_offset: int,
    col_offset: int,
    full_dim: int,
    seed: int = 0,
    *,
    low: float | None = None,
    high: float | None = None,
) -> None:
    """Fill ``out [rows, cols]`` with rows ``row_offset..`` / cols ``col_offset..`` of
    the table's deterministic initial weights ``U(low, high)``, by default
    ``U(-1/sqrt(num_rows), 1/sqrt(num_rows))``.

    The values depend only on ``(seed, table_name, num_rows, full_dim, low, high)``,
    never on how the table is sharded.  Work is proportional to the shard; each block of
    ``INIT_BLOCK_ROWS x full_dim`` float32 is drawn on the CPU (a CPU ``torch.Generator``,
    so CPU and CUDA shards get the same bits) and copied into ``out`` on its own device:
    the only temporary is one block (16 MiB at ``full_dim`` 64), never the whole shard.
    A meta ``out`` (no storage) is left as it is.
    """
    rows, cols = out.shape
    if rows == 0 or cols == 0 or out.is_meta:
        return
    bound = math.sqrt(1.0 / num_rows)
    lo_b = -bound if low is None else float(low)
    hi_b = bound if high is None else float(high)
    r = row_offset
    end = row_offset + rows
    while r < end:
        block = r // INIT_BLOCK_ROWS
        b0 = block * INIT_BLOCK_ROWS
        b1 = min(b0 + INIT_BLOCK_ROWS, num_rows)
        g = torch.Generator(device="cpu")
        g.manual_seed(_stable_seed(seed, table_name, block))
        vals = torch.empty(b1 - b0, full_dim).uniform_(lo_b, hi_b, generator=g)
        lo, hi = r, min(end, b1)
        out[lo - row_offset : hi - row_offset].copy_(vals[lo - b0 : hi - b0, col_offset : col_offset + cols])
        r = hi


@torch.no_grad()
def init_shard_weight(w: torch.Tensor, cfg: EmbeddingBagConfig, row_offset: int, col_offset: int, seed: int) -> None:
    """Fill the local ``[rows, cols]`` weight ``w`` (any device) of table ``cfg`` at ``(row_offset,
    col_offset)`` with its deterministic initial values (:func:`init_table_rows`, bounds
    ``[cfg.get_weight_init_min(), cfg.get_weight_init_max()]``), then run ``cfg.init_fn(w)``
    if set (TorchRec's hook; a returned tensor of ``w``'s shape is copied in).  A meta ``w``
    is left as it is (nothing to fill).  Memory: one init block, whatever the shard size.

    Raises:
        ValueError: ``init_fn`` returned a tensor of another shape.
    """
    if w.is_meta:
        return
    init_table_rows(w, cfg.name, cfg.num_embeddings, row_offset, col_offset, cfg.embedding_dim, seed,
                    low=cfg.get_weight_init_min(), high=cfg.get_weight_init_max())
    if cfg.init_fn is not None and w.numel():
        out = cfg.init_fn(w)
        if isinstance(out, torch.Tensor) and out is not w:
            if tuple(out.shape) != tuple(w.shape):
                raise ValueError(f"table '{cfg.name}': init_fn returned shape {tuple(out.shape)}, expected {tuple(w.shape)}")
            if out.data_ptr() != w.data_ptr():
                w.copy_(out)


def torch_dtype(data_type: DataType) -> torch.dtype:
    """The torch dtype a trainable table's weights are stored in: FP32 -> float32, FP16 -> float16.

    Raises:
        ValueError: any other data type (not trainable).
    """
    if data_type == DataType.FP32:
        return torch.float32
    if data_type == DataType.FP16:
        return torch.float16
    raise ValueError(f"data_type {data_type} is not trainable (FP32 or FP16)")


def _check_trainable(t: EmbeddingBagConfig, who: str) -> None:
    """Refuse configs whose TorchRec meaning dlrmctl does not implement (rather than ignore them)."""
    if not t.name:
        raise ValueError(f"{who}: every table needs a name (EmbeddingBagConfig(name=...)); got {t}")
    if t.pooling == PoolingType.NONE:
        raise ValueError(f"{who}: table '{t.name}': pooling NONE (sequence embeddings) is not supported; use SUM or MEAN")
    if t.data_type not in (DataType.FP32, DataType.FP16):
        raise ValueError(
            f"{who}: table '{t.name}': data_type {t.data_type} is not trainable; dlrmctl trains FP32 and FP16 "
            "tables (quantized tables come from `dlrmctl export --int8`)"
        )
    if t.num_embeddings_post_pruning is not None or t.pruning_indices_remapping is not None:
        raise ValueError(f"{who}: table '{t.name}': row pruning (num_embeddings_post_pruning / "
                         "pruning_indices_remapping) is not supported")


def fused_supports_optimizer(opt_type: str, device: torch.device | str) -> bool:
    """Whether FBGEMM's fused TBE implements ``opt_type`` on ``device``.

    FBGEMM 1.8's CPU TBE accepts only ``EXACT_ADAGRAD``, ``EXACT_ROWWISE_ADAGRAD``,
    ``EXACT_SGD`` and ``EMAINPLACE_ROWWISE_ADAGRAD`` (``SplitTableBatchedEmbeddingBagsCodegen``
    asserts "Optimizer ... is not supported in CPU mode" for the rest); its CUDA TBE also
    has ``ADAM``, ``PARTIAL_ROWWISE_ADAM``, ``LAMB`` and ``PARTIAL_ROWWISE_LAMB``.  Where this
    is False, the lookup serves the table with the ``dense`` kernel and the same update
    rule (:mod:`dlrmctl.optim`).
    """
    rec = embedding_optimizer(opt_type)
    return rec.fbgemm is not None and (rec.fused_on_cpu or torch.device(device).type == "cuda")


def fused_supports_weight_decay(opt_type: str, device: torch.device | str) -> bool:
    """Whether FBGEMM's fused TBE applies ``weight_decay`` for ``opt_type`` on ``device``.

    FBGEMM 1.8's CPU TBE ignores ``weight_decay`` for every optimizer (measured: the row after
    one step is identical with weight_decay 0 and 10); on CUDA, row-wise Adagrad and the Adam
    family apply it (FBGEMM's docstring: "EXACT_ADAGRAD, SGD, EXACT_SGD do not support weight
    decay"; not run on a GPU here).  Where this is False, the lookup serves the table with the
    ``dense`` kernel.
    """
    return torch.device(device).type == "cuda" and embedding_optimizer(opt_type).fused_weight_decay


def build_tbe(shards: Sequence[tuple[EmbeddingBagConfig, int, int, int, int]], spec: EmbeddingOptimizerSpec,
              device: torch.device, pooled: bool) -> nn.Module:
    """One FBGEMM ``SplitTableBatchedEmbeddingBagsCodegen`` over ``shards`` (``(config, rows, cols,
    row_offset, col_offset)``; each config's features are its lookups, in order) with ``spec``'s
    optimizer fused into backward: ``pooled`` (SUM pooling, the EBC) or sequence (``PoolingMode.NONE``,
    the EmbeddingCollection).  Tables live on ``device`` (HOST placement on CPU).  Weights are stored
    in the configs' ``data_type`` (``FP16``: ``weights_precision=SparseType.FP16``; the pooled output,
    the optimizer state and the update math stay fp32 — FBGEMM's CPU and CUDA TBE).

    Raises:
        ValueError: an optimizer type FBGEMM has no name for; shards of different data types.
    """
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        EmbeddingLocation,
        PoolingMode,
        SplitTableBatchedEmbeddingBagsCodegen,
    )
    from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode

    from fbgemm_gpu.split_embedding_configs import SparseType

    on_cuda = torch.device(device).type == "cuda"
    dtypes = {cfg.data_type for cfg, *_ in shards}
    if len(dtypes) > 1:
        raise ValueError(f"one TBE holds one weights precision; tables {[c.name for c, *_ in shards]} have "
                         f"{sorted(d.value for d in dtypes)}")
    fp16 = dtypes == {DataType.FP16}
    specs, ftm = [], []
    for j, (cfg, rows, cols, _, _) in enumerate(shards):
        specs.append((rows, cols, EmbeddingLocation.DEVICE if on_cuda else EmbeddingLocation.HOST,
                      ComputeDevice.CUDA if on_cuda else ComputeDevice.CPU))
        ftm.extend([j] * len(cfg.feature_names))
    fbgemm_type = embedding_optimizer(spec.type).fbgemm
    if fbgemm_type is None:
        raise ValueError(f"embedding optimizer {spec.type!r} has no FBGEMM TBE kernel; use the dense kernel")
    return SplitTableBatchedEmbeddingBagsCodegen(
        specs,
        feature_table_map=ftm,
        optimizer=getattr(EmbOptimType, fbgemm_type),
        learning_rate=spec.lr,
        eps=spec.eps,
        weight_decay=spec.weight_decay,
        weight_decay_mode=WeightDecayMode.L2 if spec.weight_decay else WeightDecayMode.NONE,
        pooling_mode=PoolingMode.SUM if pooled else PoolingMode.NONE,
        device=device,
        stochastic_rounding=False,
        weights_precision=SparseType.FP16 if fp16 else SparseType.FP32,
        beta1=float(spec.betas[0]),
        beta2=float(spec.betas[1]),
    )


class _DenseTable(nn.Module):
    """One table on ``torch.nn.EmbeddingBag(mode='sum', sparse=True)`` (sum pooling).

    ``dtype``: weight storage (float32 or float16); the pooled output ``[B, dim]`` is float32
    either way (an fp16 table pools in ``EmbeddingBag``'s fp16 kernel, its per-sample weights
    cast to fp16, and the result is widened).  ``init=False``: storage only, uninitialised (a
    checkpoint is loaded into it)."""

    def __init__(self, rows: int, dim: int, device: torch.device | None, dtype: torch.dtype = torch.float32,
                 init: bool = True) -> None:
        super().__init__()
        if init:
            # torch.nn's own init runs (and is then overwritten by the deterministic one): it
            # draws from the global RNG, which code building the MLPs next relies on
            self.bag = nn.EmbeddingBag(rows, dim, mode="sum", sparse=True, device=device, include_last_offset=True,
                                       dtype=dtype)
        else:
            self.bag = nn.EmbeddingBag(rows, dim, mode="sum", sparse=True, include_last_offset=True,
                                       _weight=torch.empty(rows, dim, device=device, dtype=dtype))

    @property
    def weight(self) -> torch.Tensor:
        return self.bag.weight

    def forward(self, values: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        w = self.bag.weight
        if w.dtype == torch.float32:
            return self.bag(values, offsets, per_sample_weights=weights)
        return self.bag(values, offsets, per_sample_weights=None if weights is None else weights.to(w.dtype)).float()


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
            _check_trainable(t, type(self).__name__)
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


class _TableWeight(nn.Module):
    """``EmbeddingBagCollection.embedding_bags[name]``: exposes the table's live
    ``[rows, dim]`` weight as ``.weight`` whatever the compute kernel.

    dense kernel: the ``nn.EmbeddingBag`` parameter itself (gradients flow).
    fused kernel: a view into the FBGEMM TBE's weight buffer (writes go to the
    table; no autograd -- the optimizer is fused into the TBE backward).

    It owns no parameters: in ``state_dict()`` it writes ``<prefix>weight`` and
    ``load_state_dict()`` copies ``<prefix>weight`` into the table.
    """

    def __init__(self, lookup: "GroupedEmbeddingLookup", cfg: EmbeddingBagConfig) -> None:
        super().__init__()
        object.__setattr__(self, "_lookup", lookup)  # a plain reference, not a submodule
        self.table_name = cfg.name
        self.num_embeddings = cfg.num_embeddings
        self.embedding_dim = cfg.embedding_dim

    @property
    def weight(self) -> torch.Tensor:
        return self._lookup.table_weight(self.table_name)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        w = self.weight
        destination[prefix + "weight"] = w if keep_vars else w.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        key = prefix + "weight"
        if key not in state_dict:
            missing_keys.append(key)
        else:
            src, w = state_dict[key], self.weight
            if not isinstance(src, torch.Tensor) or tuple(src.shape) != tuple(w.shape):
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape "
                    f"{tuple(getattr(src, 'shape', ()))} from checkpoint, the shape in current model is {tuple(w.shape)}."
                )
            else:
                with torch.no_grad():
                    w.copy_(src)
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k != key)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class LookupOwner:
    """What the unsharded collections (:class:`EmbeddingBagCollection`, ``EmbeddingCollection``)
    share: their tables live in a ``lookup`` child (:class:`LookupTables`), whose fused optimizer
    they give out and whose storage is not part of their state dict (their ``<t>.weight`` keys are).
    A mixin before the ``nn.Module`` base."""

    lookup: nn.Module

    def fused_optimizer(self) -> "FusedOptimizer":
        """The embedding optimizer that runs inside the TBE backward (lr, state)."""
        return self.lookup.fused_optimizer()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,  # type: ignore[misc]
                                      missing_keys, unexpected_keys, error_msgs)
        # the lookup child "loads" its own current tensors (the same tensors: copy_ is a no-op), so
        # it reports no missing keys
        for k, v in self.lookup.state_dict(prefix=prefix + "lookup.", keep_vars=True).items():
            state_dict.setdefault(k, v)


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
        self.register_state_dict_post_hook(_only_embedding_bags)
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
        self.embedding_bags = nn.ModuleDict({t.name: _TableWeight(self.lookup, t) for t in self._tables})

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



def _only_embedding_bags(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """state_dict post-hook of EmbeddingBagCollection: drop the kernel-specific ``lookup.*`` entries."""
    for k in [k for k in state_dict if k.startswith(prefix + "lookup.")]:
        del state_dict[k]


class FusedOptimizer:
    """Handle on the optimizers fused into TBE backward passes.

    Exposes what a training loop needs from a torch optimizer — learning rate
    get/set (for LR schedules) and state save/load — though ``step()`` is a
    no-op because the update already happened in backward.
    """

    def __init__(self, tbes: list[tuple[nn.Module, list[str]]], spec: EmbeddingOptimizerSpec) -> None:
        self._tbes = tbes
        self.spec = spec
        self._lr = spec.lr

    @property
    def lr(self) -> float:
        return self._lr

    def set_lr(self, lr: float) -> None:
        self._lr = lr
        for tbe, _ in self._tbes:
            tbe.set_learning_rate(lr)

    def set_optimizer_step(self, step: int) -> None:
        """Set every TBE's optimizer step counter (FBGEMM's ``iter``: the Adam family's bias
        correction) to ``step``, the trainer's global step (on resume)."""
        for tbe, _ in self._tbes:
            if hasattr(tbe, "set_optimizer_step"):
                tbe.set_optimizer_step(int(step))

    def optimizer_steps(self) -> list[int]:
        """Each TBE's optimizer step counter (FBGEMM's ``iter``), for TBEs that keep one."""
        return [int(tbe.iter[0]) for tbe, _ in self._tbes if getattr(tbe, "iter", None) is not None]

    def renamed(self, key: dict[str, str]) -> list[tuple[nn.Module, list[str]]]:
        """``(tbe, table keys)`` of every fused TBE, each table name mapped through ``key``
        (names not in ``key`` unchanged): the parts of a combined :class:`FusedOptimizer` over
        several collections, e.g. a sharded collection's (``"<table>@<shard index>"`` keys)."""
        return [(tbe, [key.get(n, n) for n in names]) for tbe, names in self._tbes]

    def step(self) -> None:
        """No-op: FBGEMM applies the update inside backward."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No-op: fused tables have no .grad."""

    def state_dict(self) -> dict:
        """``{"hyper": {type, lr, eps, weight_decay}, "state": {table: [momentum tensors]}}``.

        Momentum shapes: row-wise Adagrad ``[rows]``, Adagrad ``[rows, dim]``, SGD none,
        Adam / LAMB ``[rows, dim]`` x 2, partial row-wise Adam / LAMB ``[rows, dim]`` + ``[rows]``.
        """
        state = {}
        for tbe, names in self._tbes:
            for name, states in zip(names, tbe.split_optimizer_states()):
                state[name] = [s.detach().clone() for s in states]
        return {
            "hyper": {"type": self.spec.type, "lr": self._lr, "eps": self.spec.eps, "weight_decay": self.spec.weight_decay},
            "state": state,
        }

    def load_state_dict(self, sd: dict) -> None:
        self.set_lr(float(sd["hyper"]["lr"]))
        for tbe, names in self._tbes:
            for name, states in zip(names, tbe.split_optimizer_states()):
                for dst, src in zip(states, sd["state"][name]):
                    dst.copy_(src)

    def momentum(self) -> dict[str, list[torch.Tensor]]:
        """Table name -> live views of its optimizer state tensors."""
        out = {}
        for tbe, names in self._tbes:
            for name, states in zip(names, tbe.split_optimizer_states()):
                out[name] = list(states)
        return out


class LookupTables:
    """Weight / optimizer access shared by the pooled and the sequence lookups: both keep
    ``tbes`` (FBGEMM TBEs) with ``_tbe_members`` (shard indices per TBE), ``dense_tables``
    (name -> module with ``.weight``) with ``_dense_members``, ``_names`` and ``_spec``."""

    def table_weight(self, name: str) -> torch.Tensor:
        """Local weight ``[rows, cols]`` of table ``name`` (live: the dense parameter or a TBE view).

        Raises:
            KeyError: no such table in this lookup.
        """
        if name in self.dense_tables:
            return self.dense_tables[name].weight
        i = self._names.index(name) if name in self._names else -1
        for tbe, idxs in zip(self.tbes, self._tbe_members):
            if i in idxs:
                return tbe.split_embedding_weights()[idxs.index(i)]
        raise KeyError(f"no table '{name}' in this lookup; tables are {self._names}")

    def table_weights(self) -> dict[str, torch.Tensor]:
        """Table name -> local shard weight ``[rows, cols]`` (live view)."""
        out: dict[str, torch.Tensor] = {}
        for tbe, idxs in zip(self.tbes, self._tbe_members):
            for i, w in zip(idxs, tbe.split_embedding_weights()):
                out[self._names[i]] = w
        for i in self._dense_members:
            out[self._names[i]] = self.dense_tables[self._names[i]].weight
        return out

    def dense_parameters(self) -> list[nn.Parameter]:
        """Weights of dense-kernel tables (they need a torch optimizer)."""
        return [t.weight for t in self.dense_tables.values()]

    def fused_optimizer(self) -> FusedOptimizer:
        """The optimizer fused into the TBE backward passes (keys: table names)."""
        return FusedOptimizer(
            [(tbe, [self._names[i] for i in idxs]) for tbe, idxs in zip(self.tbes, self._tbe_members)], self._spec
        )


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
                and optimizer.type in ("adam", "partial_rowwise_adam", "lamb", "partial_rowwise_lamb")):
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
            self.dense_tables[cfg.name] = _DenseTable(rows, cols, device, torch_dtype(cfg.data_type), init=init)
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


def __getattr__(name: str):  # PEP 562: TorchRec's module also holds EmbeddingCollection (lives in sequence_embeddings)
    if name == "EmbeddingCollection":
        from dlrmctl.modules.sequence_embeddings import EmbeddingCollection

        return EmbeddingCollection
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
