"""The offline reshard (``dlrmctl checkpoint reshard``): :func:`reshard_rank`."""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from dlrmctl.train.checkpoint import load as ckpt_load  # (a module: tests patch read_metadata)
from dlrmctl.train.checkpoint.load import load_checkpoint
from dlrmctl.train.checkpoint.save import save_checkpoint
from dlrmctl.train.checkpoint.store import load_checkpoint_meta
from dlrmctl.train.checkpoint.codec import Blocks
from dlrmctl.train.checkpoint.layout import row_moment_keys


# -------------------------------------------------------------- reshard
def reshard_rank(src_ckpt: str, out_run: str, rank: int, world_size: int, plan: Any = None,
                 process_group: Any = None, name: str | None = None, publish_latest: bool = True) -> str:
    """One rank of an offline reshard: read this rank's slices of ``src_ckpt`` under ``plan``
    and write them as a checkpoint of ``world_size`` ranks in ``out_run``.  Collective.

    No model is built: the keys come from the checkpoint.  Each rank allocates
    only its target shards (data_parallel tables and the dense / object entries:
    rank 0 only).  Moments follow :func:`row_moment_keys`, as
    :func:`~dlrmctl.train.checkpoint.layout.embedding_load_request` does (exact per row / element; column shards get their own moment when the
    column split is unchanged, else the row's).  Rank ``r`` keeps the saving job's
    rank-``r`` RNG states (rank 0's for new ranks).

    I/O: the new checkpoint's meta.json records, under ``resharded_from``, the source's size
    (``bytes``, all files) and the bytes every rank read from it (``bytes_read``, summed, and
    ``bytes_read_per_rank``): each rank reads ``.metadata`` once plus the rows of the saved chunks
    its target blocks overlap, rounded out to whole checksum blocks (:data:`BLOCK_BYTES`).

    Args:
        plan: :class:`~dlrmctl.distributed.types.ShardingPlan` for ``world_size`` ranks;
            None: unsharded (every table whole, world size 1).

    Returns:
        the new checkpoint directory.
    """
    from collections import defaultdict

    from dlrmctl.distributed.types import ShardingType

    from dlrmctl.distributed import comm

    meta = load_checkpoint_meta(src_ckpt)
    counter: dict[str, int] = {"bytes_read": 0}
    md = ckpt_load.read_metadata(src_ckpt, meta, counter)
    saved = md.state_dict_metadata
    tables: dict[str, list[int]] = meta["tables"]

    def alloc(key: str, shape: Sequence[int] | None = None) -> torch.Tensor:
        m = saved[key]
        return torch.empty(tuple(m.size) if shape is None else tuple(shape), dtype=m.properties.dtype)

    load: dict[str, Any] = {}
    save: dict[str, Any] = {}
    lblocks: dict[tuple[str, tuple[int, ...]], list] = defaultdict(list)
    sblocks: dict[tuple[str, tuple[int, ...]], list] = defaultdict(list)
    for t, (R, D) in tables.items():
        ps = None if plan is None else plan.plan[t]
        wkey = f"emb/{t}/weight"
        skeys = sorted(k for k in saved if k.startswith(f"emb/{t}/state") and "@" not in k)
        if ps is None or ps.sharding_type == ShardingType.DATA_PARALLEL:
            if rank == 0:
                for k in [wkey, *skeys]:
                    load[k] = save[k] = alloc(k)
            continue
        rows_of: dict[tuple[str, int, int], torch.Tensor] = {}
        for sh in ps.shards or []:
            (r0, c0), (nr, nc) = sh.offsets, sh.sizes
            if sh.rank != rank or nr == 0 or nc == 0:
                continue
            w = alloc(wkey, (nr, nc))
            lblocks[(wkey, (R, D))].append(((r0, c0), w))
            sblocks[(wkey, (R, D))].append(((r0, c0), w))
            for k in skeys:
                if len(saved[k].size) == 2:
                    x = alloc(k, (nr, nc))
                    lblocks[(k, (R, D))].append(((r0, c0), x))
                    sblocks[(k, (R, D))].append(((r0, c0), x))
                    continue
                keys = row_moment_keys(k, c0, nc, D, saved)

                def rows() -> torch.Tensor:
                    if (k, r0, nr) not in rows_of:
                        rows_of[(k, r0, nr)] = alloc(k, (nr,))
                        lblocks[(k, (R,))].append(((r0,), rows_of[(k, r0, nr)]))
                    return rows_of[(k, r0, nr)]

                for sk in keys.save:
                    if sk == k:  # the table's per-row moment: the row block this rank reads
                        sblocks[(k, (R,))].append(((r0,), rows()))
                    elif keys.load == sk:  # the shard's own moment, read as saved
                        x = alloc(k, (nr,))
                        lblocks[(sk, (R,))].append(((r0,), x))
                        sblocks[(sk, (R,))].append(((r0,), x))
                    else:  # a new column split: the row's moment
                        sblocks[(sk, (R,))].append(((r0,), rows()))
    for (k, size), bl in lblocks.items():
        load[k] = Blocks(size, bl)
    for (k, size), bl in sblocks.items():
        save[k] = Blocks(size, bl)
    if rank == 0:
        for k, m in saved.items():
            if k.startswith(("emb/", "rank/")):
                continue
            load[k] = save[k] = alloc(k) if getattr(m, "size", None) is not None else None
    src_rank = rank if rank < int(meta["world_size"]) else 0
    load[f"rank/{src_rank}"] = None
    load_checkpoint(src_ckpt, load, process_group, world_size, meta, counter, md)
    read = [counter["bytes_read"]]
    if world_size > 1:
        read = comm.all_gather_object(counter["bytes_read"], process_group or comm.default_group())
    for k in list(save):
        if save[k] is None:
            save[k] = load[k]
    save[f"rank/{rank}"] = load[f"rank/{src_rank}"]
    extra = {k: v for k, v in meta.items() if k not in ("format", "step", "world_size", "files", "files_crc32")}
    extra.update(plan=None if plan is None else plan.to_dict(),
                 resharded_from={"checkpoint": os.path.abspath(src_ckpt), "world_size": meta["world_size"],
                                 "bytes": sum(int(f["bytes"]) for f in meta["files"].values()),
                                 "bytes_read": int(sum(read)), "bytes_read_per_rank": [int(b) for b in read]})
    return save_checkpoint(out_run, int(meta["step"]), save, rank, world_size, process_group, keep_last=0,
                           publish_latest=publish_latest,
                           extra_meta=extra, name=name)
