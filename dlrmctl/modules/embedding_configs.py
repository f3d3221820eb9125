"""Embedding table configuration (names as in ``torchrec.modules.embedding_configs``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class PoolingType(str, enum.Enum):
    """How the ids of one bag are reduced: ``sum`` or ``mean`` (empty bag -> zeros)."""

    SUM = "sum"
    MEAN = "mean"


@dataclass
class EmbeddingBagConfig:
    """One embedding table.

    Attributes:
        name: table name (unique in a model), e.g. ``t_cat_0``.
        num_embeddings: rows (hash size).
        embedding_dim: columns.
        feature_names: sparse features (KJT keys) looked up in this table.
        pooling: ``sum`` or ``mean``.
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: list[str] = field(default_factory=list)
    pooling: PoolingType = PoolingType.SUM

    def __post_init__(self) -> None:
        self.pooling = PoolingType(self.pooling)
        if not self.feature_names:
            self.feature_names = [self.name]
        if self.num_embeddings <= 0:
            raise ValueError(f"table '{self.name}': num_embeddings must be > 0, got {self.num_embeddings}")
        if self.embedding_dim <= 0:
            raise ValueError(f"table '{self.name}': embedding_dim must be > 0, got {self.embedding_dim}")
