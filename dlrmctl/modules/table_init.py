"""Deterministic, sharding-independent initialisation of embedding tables.

``U(-sqrt(1/rows), sqrt(1/rows))`` as in the DLRM reference (``dlrm_s_pytorch.py: create_emb``)
and TorchRec (or ``U(weight_init_min, weight_init_max)`` when the config sets them), drawn in fixed
blocks of :data:`INIT_BLOCK_ROWS` rows from a generator seeded by ``(seed, table name, block)``:
any shard of a table is initialised on its own rank, without materialising the whole table, with
exactly the values the unsharded table would have.  A config's ``init_fn`` then runs on the
(local) weight, as in TorchRec.
"""

from __future__ import annotations

import hashlib
import math

import torch

from dlrmctl.modules.embedding_configs import EmbeddingBagConfig

__all__ = ["INIT_BLOCK_ROWS", "init_shard_weight", "init_table_rows"]

INIT_BLOCK_ROWS = 65536


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
