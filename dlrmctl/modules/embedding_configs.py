"""Embedding table configuration, as ``torchrec.modules.embedding_configs``.

``EmbeddingBagConfig`` and ``EmbeddingConfig`` have TorchRec's fields in TorchRec's order, so
``EmbeddingBagConfig(num_embeddings, embedding_dim, name, ...)`` written
positionally or by keyword means the same thing in both libraries.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


class PoolingType(str, enum.Enum):
    """How the ids of one bag are reduced (TorchRec's ``PoolingType``).

    ``SUM``: weighted sum; ``MEAN``: that sum divided by the bag length (empty
    bag -> zeros); ``NONE``: no pooling (sequence embeddings) -- exists for
    TorchRec compatibility, an EmbeddingBagCollection rejects it as TorchRec's
    does.  Values are lower case (``"sum"``, as dlrmctl's YAML configs and
    export manifests write them); ``PoolingType("SUM")`` (TorchRec's value) is
    accepted too.
    """

    SUM = "sum"
    MEAN = "mean"
    NONE = "none"

    @classmethod
    def _missing_(cls, value: object) -> "PoolingType | None":
        if isinstance(value, str):
            for m in cls:
                if m.value == value.lower():
                    return m
        return None


class DataType(str, enum.Enum):
    """Table weight data type (TorchRec's ``torchrec.types.DataType`` names).

    dlrmctl trains ``FP32`` and ``FP16`` tables (fp16 weight storage, fp32 optimizer math:
    ``model.embedding_precision``); the others exist so TorchRec configs construct, and an
    EmbeddingBagCollection rejects them with a message (quantized tables come from
    ``dlrmctl export --int8``).
    """

    FP32 = "FP32"
    FP16 = "FP16"
    BF16 = "BF16"
    INT64 = "INT64"
    INT32 = "INT32"
    INT8 = "INT8"
    UINT8 = "UINT8"
    INT4 = "INT4"
    INT2 = "INT2"

    @classmethod
    def _missing_(cls, value: object) -> "DataType | None":
        if isinstance(value, str):
            for m in cls:
                if m.value == value.upper():
                    return m
        return None

    def __str__(self) -> str:
        return self.value


def _positive_int(x: object, what: str, table: str) -> int:
    try:
        if isinstance(x, bool):
            raise TypeError
        v = operator.index(x)  # int, numpy integers; not floats / strings
    except TypeError:
        raise ValueError(f"table '{table}': {what} must be an int > 0, got {x!r}") from None
    if v <= 0:
        raise ValueError(f"table '{table}': {what} must be an int > 0, got {v}")
    return int(v)


@dataclass
class BaseEmbeddingConfig:
    """The fields and init bounds every table config shares (TorchRec's ``BaseEmbeddingConfig``;
    see :class:`EmbeddingBagConfig` for their meaning).

    Raises:
        ValueError: ``num_embeddings`` or ``embedding_dim`` not positive,
            ``weight_init_min > weight_init_max``, an unknown data type.
    """

    num_embeddings: int
    embedding_dim: int
    name: str = ""
    data_type: DataType = DataType.FP32
    feature_names: list[str] = field(default_factory=list)
    weight_init_max: Optional[float] = None
    weight_init_min: Optional[float] = None
    num_embeddings_post_pruning: Optional[int] = None
    init_fn: Optional[Callable[[torch.Tensor], Optional[torch.Tensor]]] = None
    need_pos: bool = False

    def __post_init__(self) -> None:
        self.data_type = DataType(self.data_type)
        self.feature_names = list(self.feature_names)
        if not self.feature_names and self.name:
            self.feature_names = [self.name]
        label = self.name or "<unnamed>"
        self.num_embeddings = _positive_int(self.num_embeddings, "num_embeddings", label)
        self.embedding_dim = _positive_int(self.embedding_dim, "embedding_dim", label)
        if self.get_weight_init_min() > self.get_weight_init_max():
            raise ValueError(
                f"table '{label}': weight_init_min {self.get_weight_init_min()} > weight_init_max "
                f"{self.get_weight_init_max()}"
            )

    def get_weight_init_max(self) -> float:
        """Upper init bound: ``weight_init_max`` or ``sqrt(1 / num_embeddings)``."""
        return float(self.weight_init_max) if self.weight_init_max is not None else (1.0 / self.num_embeddings) ** 0.5

    def get_weight_init_min(self) -> float:
        """Lower init bound: ``weight_init_min`` or ``-sqrt(1 / num_embeddings)``."""
        return float(self.weight_init_min) if self.weight_init_min is not None else -((1.0 / self.num_embeddings) ** 0.5)

    def num_features(self) -> int:
        return len(self.feature_names)


@dataclass
class EmbeddingBagConfig(BaseEmbeddingConfig):
    """One pooled embedding table; TorchRec's fields, in TorchRec's order.

    Attributes:
        num_embeddings: rows (hash size), > 0.
        embedding_dim: columns, > 0.
        name: table name, unique in a model, e.g. ``t_cat_0``; required by
            EmbeddingBagCollection (TorchRec's default ``""`` is kept for the
            dataclass signature).
        data_type: weight data type; only ``DataType.FP32`` trains.
        feature_names: sparse features (KJT keys) looked up in this table;
            default ``[name]``.
        weight_init_max / weight_init_min: bounds of the uniform initial
            weights, default ``+-sqrt(1 / num_embeddings)`` (TorchRec's).  dlrmctl
            draws them deterministically per ``(seed, table, row block)``, so a
            sharded table gets exactly the unsharded values.
        num_embeddings_post_pruning: TorchRec's inference-time row pruning; not
            supported (an EmbeddingBagCollection raises if set).
        init_fn: optional ``fn(weight)`` that fills the ``[rows, dim]`` float32
            weight in place, called after the default init (as TorchRec calls it
            on ``embedding_bags[name].weight``).  Unlike TorchRec's default, None
            keeps dlrmctl's deterministic, sharding-independent init; a given
            ``init_fn`` runs on each local shard of a sharded table.  If it
            returns another tensor of the weight's shape, that is copied in.
        need_pos: TorchRec's position-weighted flag; stored, not used.
        pooling: ``PoolingType.SUM`` or ``MEAN`` (strings accepted).
        pruning_indices_remapping: (keyword-only) older TorchRec releases'
            pruning field; not supported (EmbeddingBagCollection raises if set).

    Raises:
        ValueError: ``num_embeddings`` or ``embedding_dim`` not positive,
            ``weight_init_min > weight_init_max``, an unknown pooling or data type.
    """

    pooling: PoolingType = PoolingType.SUM
    pruning_indices_remapping: Optional[torch.Tensor] = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        self.pooling = PoolingType(self.pooling)
        super().__post_init__()


@dataclass
class EmbeddingConfig(BaseEmbeddingConfig):
    """One unpooled (sequence) embedding table; TorchRec's fields, in TorchRec's order.

    Looked up by :class:`~dlrmctl.modules.sequence_embeddings.EmbeddingCollection`:
    every id gets its own ``[embedding_dim]`` row (no pooling).

    Attributes:
        num_embeddings: rows (hash size), > 0.
        embedding_dim: columns, > 0 (all tables of one EmbeddingCollection share it,
            as in TorchRec).
        name: table name, unique in a model; required by EmbeddingCollection.
        data_type: weight data type; only ``DataType.FP32`` trains.
        feature_names: sparse features (KJT keys) looked up in this table;
            default ``[name]``.
        weight_init_max / weight_init_min: bounds of the uniform initial
            weights, default ``+-sqrt(1 / num_embeddings)``, drawn
            deterministically per ``(seed, table, row block)`` as for
            :class:`EmbeddingBagConfig`.
        num_embeddings_post_pruning: TorchRec's inference-time row pruning; not
            supported (EmbeddingCollection raises if set).
        init_fn: optional ``fn(weight)`` run on the (local) ``[rows, dim]``
            float32 weight after the default init (see :class:`EmbeddingBagConfig`).
        need_pos: TorchRec's position-weighted flag; stored, not used.

    ``pooling`` is a read-only property, always ``PoolingType.NONE`` (not a
    field: TorchRec's EmbeddingConfig has none).

    Raises:
        ValueError: ``num_embeddings`` or ``embedding_dim`` not positive,
            ``weight_init_min > weight_init_max``, an unknown data type.
    """

    @property
    def pooling(self) -> PoolingType:
        """Always ``PoolingType.NONE``: one embedding row per id."""
        return PoolingType.NONE
