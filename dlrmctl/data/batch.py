"""One training batch: dense features, sparse features (KeyedJaggedTensor), labels."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dlrmctl.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["Batch"]


@dataclass
class Batch:
    """A batch as produced by :class:`dlrmctl.data.loader.BatchLoader`.

    Attributes:
        dense_features: ``[B, D]`` float32 (already transformed, e.g. log(x+1)).
        sparse_features: KeyedJaggedTensor, keys = sparse feature names in meta order,
            int64 values, key-major lengths ``[F * B]``, ``stride() == B``.
        labels: ``[B]`` float32 in {0, 1} (NaN for unlabelled data).
    """

    dense_features: torch.Tensor
    sparse_features: KeyedJaggedTensor
    labels: torch.Tensor

    @property
    def batch_size(self) -> int:
        """``B`` (rows of this batch on this rank)."""
        return int(self.labels.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        """Copy every tensor to ``device`` (asynchronously from pinned memory when ``non_blocking``)."""
        return Batch(
            self.dense_features.to(device, non_blocking=non_blocking),
            self.sparse_features.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> "Batch":
        """Copy into page-locked host memory (needs CUDA); returns a new Batch."""
        return Batch(self.dense_features.pin_memory(), self.sparse_features.pin_memory(),
                     self.labels.pin_memory())

    def record_stream(self, stream: "torch.cuda.Stream") -> None:
        """Mark every tensor as used by ``stream`` (CUDA caching allocator safety after a side-stream copy)."""
        self.dense_features.record_stream(stream)
        self.sparse_features.record_stream(stream)
        self.labels.record_stream(stream)
