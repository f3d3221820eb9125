"""MLPerf DLRMv2 multi-hot bags from one-hot ids (used by the Criteo preprocess and the loader)."""

from __future__ import annotations

import numpy as np

MULTI_HOT_CACHE_VECTORS = 1024  # rows of the cached offset table (MLPerf DLRMv2 multi_hot.py)

__all__ = ["MULTI_HOT_CACHE_VECTORS", "multi_hot_expand", "multi_hot_offsets"]


def multi_hot_expand(ids: np.ndarray, num_embeddings: int, size: int,
                     distribution: str = "uniform", seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Turn one-hot ids into multi-hot bags of exactly ``size`` ids (MLPerf DLRMv2 style).

    Bag of id ``i``: ``[i, (i + o_1) mod N, ..., (i + o_{size-1}) mod N]`` where the offset vector
    ``o = offsets[i mod 1024]`` comes from a fixed table of 1024 random offset vectors drawn once
    from ``seed``: uniform in ``[0, N)`` or ``int(pareto(a=0.25)) mod N``.  This is the approach of
    MLPerf Training DLRMv2 (``torchrec_dlrm/multi_hot.py``: one-hot id plus cached random
    offsets, modulo the table size); the bag is a deterministic function of ``(i, seed)``.

    Args:
        ids: ``[n]`` int64 one-hot ids in ``[0, num_embeddings)``.
        num_embeddings: table rows ``N``.
        size: bag size (>= 1).
        distribution: ``"uniform"`` or ``"pareto"``.
        seed: seed of the offset table (use a different one per feature).

    Returns:
        ``(values [n * size] int64, lengths [n] int64)``; bags are contiguous per sample
        (sample ``j`` owns ``values[j*size:(j+1)*size]``), every value in ``[0, N)``.

    Raises:
        ValueError: ``size < 1``, ``num_embeddings < 1``, unknown distribution, or ids out of range.
    """
    ids = np.asarray(ids, dtype=np.int64)
    if size < 1:
        raise ValueError(f"multi_hot_expand: size must be >= 1, got {size}")
    if num_embeddings < 1:
        raise ValueError(f"multi_hot_expand: num_embeddings must be >= 1, got {num_embeddings}")
    if distribution not in ("uniform", "pareto"):
        raise ValueError(f"multi_hot_expand: distribution must be 'uniform' or 'pareto', got {distribution!r}")
    if len(ids) and (ids.min() < 0 or ids.max() >= num_embeddings):
        raise ValueError(f"multi_hot_expand: ids must be in [0, {num_embeddings}), got "
                         f"[{ids.min()}, {ids.max()}]")
    n = len(ids)
    lengths = np.full(n, size, dtype=np.int64)
    if size == 1:
        return ids.copy(), lengths
    offsets = multi_hot_offsets(num_embeddings, size, distribution, seed)
    out = np.empty((n, size), dtype=np.int64)
    out[:, 0] = ids
    out[:, 1:] = (ids[:, None] + offsets[ids % MULTI_HOT_CACHE_VECTORS]) % num_embeddings
    return out.reshape(-1), lengths



def multi_hot_offsets(num_embeddings: int, size: int, distribution: str = "uniform", seed: int = 0) -> np.ndarray:
    """The cached offset table of :func:`multi_hot_expand`: ``[1024, size - 1]`` int64 in
    ``[0, num_embeddings)`` (id ``i``'s bag is ``i`` then ``(i + offsets[i % 1024]) % num_embeddings``).
    The exported inference program carries it to expand one-hot ids the same way."""
    rng = np.random.default_rng(seed)
    shape = (MULTI_HOT_CACHE_VECTORS, size - 1)
    if distribution == "uniform":
        return rng.integers(0, num_embeddings, size=shape, dtype=np.int64)
    p = np.minimum(rng.pareto(0.25, size=shape), float(1 << 62))
    return p.astype(np.int64) % num_embeddings
