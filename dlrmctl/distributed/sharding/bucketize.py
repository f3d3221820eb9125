"""The bucketize core of row-wise input_dist: every id of a key-major KJT sent to the rank holding
its row, made local to that rank's shard, grouped by destination (FBGEMM's
``block_bucketize_sparse_features`` when it is there, else the pure-torch :func:`bucketize_torch`;
the sequence collection's bucketize shares :func:`bucketize_order`)."""

from __future__ import annotations

import torch


try:  # FBGEMM's bucketizer, when fbgemm_gpu is importable (the GPU box may lack it)
    import fbgemm_gpu  # noqa: F401

    HAS_BLOCK_BUCKETIZE = hasattr(torch.ops.fbgemm, "block_bucketize_sparse_features")
except Exception:  # pragma: no cover - depends on the install
    HAS_BLOCK_BUCKETIZE = False


def bucketize_torch(
    values: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor | None,
    F: int,
    B: int,
    W: int,
    feat_base: torch.Tensor,
    shard_starts: torch.Tensor,
    shard_ranks: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Pure-torch equivalent of ``fbgemm.block_bucketize_sparse_features`` for any row split.

    Args:
        values: ``[N]`` global ids, key-major.
        lengths: ``[F * B]``.
        feat_base: ``[F]`` offset of each feature's table in a virtual
            concatenation of all tables.
        shard_starts: ``[S]`` start of every shard in that concatenation
            (non-decreasing); ``shard_ranks [S]`` the rank holding it.

    Returns:
        ``(lengths [W, F, B], local ids [N], weights [N] | None)``, ids grouped by
        destination rank (stable: feature, sample order kept).
    """
    new_lengths, local, order = bucketize_order(values, lengths, F, B, W, feat_base, shard_starts, shard_ranks)
    return new_lengths, local, None if weights is None else weights[order]


def bucketize_order(values: torch.Tensor, lengths: torch.Tensor, F: int, B: int, W: int, feat_base: torch.Tensor,
                    shard_starts: torch.Tensor, shard_ranks: torch.Tensor,
                    raw_route: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The core of the pure-torch bucketize (pooled :func:`bucketize_torch` and the sequence
    collection's): arguments as :func:`bucketize_torch`, without weights.

    ``raw_route``: ``(buckets [F], buckets per rank [F])`` int64: a feature with ``buckets > 0``
    holds raw ids of a sharded managed-collision table (:mod:`dlrmctl.distributed.sharded_mc`),
    each sent unchanged to the rank owning its zone, ``(id % buckets) // buckets per rank``.

    Returns:
        ``(lengths [W, F, B], local ids [N] grouped by destination rank, order [N] int64)``:
        ``order[j]`` is the input position of the j-th id sent (stable: feature, sample order kept).
    """
    N = values.numel()
    dev = values.device
    bag = torch.repeat_interleave(torch.arange(F * B, device=dev), lengths, output_size=N)
    if raw_route is None:
        key = feat_base[torch.div(bag, B, rounding_mode="floor")] + values if B else values
        shard = torch.searchsorted(shard_starts, key, right=True) - 1
        dest = shard_ranks[shard]
        local = key - shard_starts[shard]
    else:
        feat = torch.div(bag, max(B, 1), rounding_mode="floor")
        nb, per = raw_route[0][feat], raw_route[1][feat]
        raw = nb > 0
        key = feat_base[feat] + torch.where(raw, 0, values)  # raw ids stay out of the row arithmetic
        shard = torch.searchsorted(shard_starts, key, right=True) - 1
        dest = torch.where(raw, torch.remainder(values, nb.clamp(min=1)) // per, shard_ranks[shard])
        local = torch.where(raw, values, key - shard_starts[shard])
    order = torch.argsort(dest, stable=True)
    # scatter-add into a buffer of known size (bincount would read the max id back to the host on CUDA)
    new_lengths = torch.zeros(W * F * B, dtype=lengths.dtype, device=dev)
    new_lengths.index_add_(0, dest * (F * B) + bag, torch.ones_like(bag, dtype=lengths.dtype))
    return new_lengths.view(W, F, B), local[order], order
