"""The public lookup base of the unsharded embedding collections (the pooled
:class:`~dlrmctl.modules.embedding_modules.EmbeddingBagCollection` and the sequence
:class:`~dlrmctl.modules.sequence_embeddings.EmbeddingCollection`) and of each rank's part of a
sharded one.

* :class:`EmbeddingOptimizerSpec`: the embedding optimizer's hyper-parameters;
  :func:`fused_supports_optimizer` / :func:`fused_supports_weight_decay`: whether FBGEMM's fused
  TBE runs it on a device (else the ``dense`` kernel serves the table, same update rule);
* :func:`build_tbe`: one FBGEMM ``SplitTableBatchedEmbeddingBagsCodegen`` over table shards, the
  optimizer fused into its backward; :class:`DenseTable`: one table on ``nn.EmbeddingBag``;
* :class:`LookupTables`: weight and optimizer access over a lookup's TBEs and dense tables;
  :class:`FusedOptimizer`: the handle on the optimizers fused into the TBE backward passes;
* :class:`TableWeight`, :class:`LookupOwner`, :func:`only_embedding_bags`: how a collection
  shows its tables as ``<table>.weight`` in its state dict, whatever the kernel.

Weight initialisation is :mod:`dlrmctl.modules.table_init`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from dlrmctl.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from dlrmctl.optim.registry import embedding_optimizer

__all__ = [
    "DenseTable",
    "EmbeddingOptimizerSpec",
    "FusedOptimizer",
    "LookupOwner",
    "LookupTables",
    "TableWeight",
    "build_tbe",
    "check_trainable",
    "fused_supports_optimizer",
    "fused_supports_weight_decay",
    "only_embedding_bags",
    "torch_dtype",
]


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


def check_trainable(t: EmbeddingBagConfig, who: str) -> None:
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


class DenseTable(nn.Module):
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


class TableWeight(nn.Module):
    """``EmbeddingBagCollection.embedding_bags[name]``: exposes the table's live
    ``[rows, dim]`` weight as ``.weight`` whatever the compute kernel.

    dense kernel: the ``nn.EmbeddingBag`` parameter itself (gradients flow).
    fused kernel: a view into the FBGEMM TBE's weight buffer (writes go to the
    table; no autograd -- the optimizer is fused into the TBE backward).

    It owns no parameters: in ``state_dict()`` it writes ``<prefix>weight`` and
    ``load_state_dict()`` copies ``<prefix>weight`` into the table.
    """

    def __init__(self, lookup: "LookupTables", cfg: EmbeddingBagConfig) -> None:
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


def only_embedding_bags(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """state_dict post-hook of the unsharded collections: drop the kernel-specific ``lookup.*`` entries."""
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
