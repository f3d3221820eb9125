"""Managed-collision tables: a remapper from raw 64-bit ids to the rows of a table of fixed size.

A raw-id feature (meta.json ``"ids": "raw"``, :mod:`dlrmctl.data.ids`) has no vocabulary: its ids
are 63-bit hashes.  A managed-collision (MCH, TorchRec's ``MCHManagedCollisionModule``) table of
``size`` rows gives each id it holds a row of its own (zero collisions among the ids held) and
takes a row for a new id from the free rows, else from the least valuable id held, under an
eviction policy:

* ``lfu``: the row whose id was seen the fewest times (ties: the least recently seen, then the
  lowest row);
* ``lru``: the row whose id was seen the longest ago (ties: the lowest row).

Rows hit by the current batch are never evicted by it.  An evicted row's embedding and optimizer
state are reset (:meth:`ManagedCollisionRemapper.reset_values`, the caller zeroes the optimizer
state), so a newcomer inherits nothing from the id it replaces.

State, all tensors (``N = size``; memory ``O(N)``, independent of the number of distinct ids in
the log): ``row_ids [N+1]`` the raw id each row holds (``EMPTY`` when free; the last entry is a
scratch slot), ``counts [N+1]`` how often, ``last_seen [N+1]`` the step it was last seen,
``sorted_ids [N]`` / ``sorted_rows [N]`` the held ids in ascending order with their rows (the
lookup: one ``torch.searchsorted``), and ``step`` (training remaps so far).

The table has ``N + 1`` rows: row ``N`` is the *default row*, which no id owns.  In evaluation,
export, ``predict`` and ``serve`` the remapper changes nothing and an id it does not hold maps to
the default row (as TorchRec's MCH maps a miss to its last row); that row keeps its initial
values.  In training every id gets a row of its own.

Buckets: with ``buckets = B`` the rows are split into ``B`` equal blocks and an id may only take
a row of block ``id % B``.  The remapper state of a block depends only on the ids of that block,
so a table row_wise-sharded over ``W`` ranks (``W`` dividing ``B``) whose rank ``r`` owns the
*zone* of buckets ``[r B/W, (r+1) B/W)`` and their rows keeps exactly the same state as one
process: each rank runs a remapper of ``N/W`` rows over its zone only (``bucket_offset``,
``total_buckets``; :mod:`dlrmctl.distributed.sharded_mc`).

The training remap is vectorised: one sort of the batch's ids, ``searchsorted`` on the held ids,
the ``n`` first eviction candidates of each bucket by one ``topk`` on a key packing the policy's
fields and the row, and the new ids merged into the sorted held ids with ``searchsorted`` and one
scatter (scatters use a scratch slot for masked entries); no per-id Python loop and no read of a
tensor value on the host.  Cost per step: ``O(n log n + n log N + N)`` for ``n`` ids in the
batch (:attr:`ManagedCollisionRemapper.incremental` = False: stable sorts of every row instead,
``O(N log N)``, the reference the fast path equals).
"""

from __future__ import annotations

import torch
from torch import nn

from dlrmctl.modules.mc_reset import reset_uniform, table_reset_key

__all__ = ["EMPTY", "EVICTION_POLICIES", "ManagedCollisionCollection", "ManagedCollisionRemapper", "remap_features",
           "reset_taken_rows", "reset_uniform", "table_reset_key"]

#: the id of a free row (larger than any raw id: free rows sort after held ones)
EMPTY = (1 << 63) - 1
#: the eviction policies a remapper knows
EVICTION_POLICIES = ("lfu", "lru")


class ManagedCollisionRemapper(nn.Module):
    """The remapper of one managed-collision table (see the module docstring).

    Args:
        size: ``N``, the rows ids can own (the table has ``N + 1``: row ``N`` is the default row).
        eviction: ``"lfu"`` or ``"lru"``.
        buckets: ``B``, a divisor of ``size``; an id takes rows of block ``id % B`` only.
        device: where the state lives.
        bucket_offset, total_buckets: a zone remapper (one rank's part of a row_wise-sharded
            table): its ``buckets`` blocks are the buckets ``bucket_offset ...`` of
            ``total_buckets``, i.e. an id takes rows of local block ``id % total_buckets -
            bucket_offset`` (it must be one of them); default: the whole table.

    Raises:
        ValueError: ``size < 1``, ``buckets`` not a divisor of ``size``, or an unknown policy.
    """

    def __init__(self, size: int, eviction: str = "lfu", buckets: int = 1,
                 device: torch.device | str | None = None, bucket_offset: int = 0,
                 total_buckets: int | None = None) -> None:
        super().__init__()
        if size < 1:
            raise ValueError(f"managed collision: size must be >= 1, got {size}")
        if buckets < 1 or size % buckets:
            raise ValueError(f"managed collision: buckets ({buckets}) must divide size ({size})")
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"managed collision: eviction must be one of {list(EVICTION_POLICIES)}, got {eviction!r}")
        self.size = int(size)
        self.eviction = eviction
        self.buckets = int(buckets)
        self.bucket_offset = int(bucket_offset)
        self.total_buckets = int(total_buckets or buckets)
        kw = {"dtype": torch.int64, "device": device}
        self.register_buffer("row_ids", torch.full((size + 1,), EMPTY, **kw))
        self.register_buffer("counts", torch.zeros(size + 1, **kw))
        self.register_buffer("last_seen", torch.full((size + 1,), -1, **kw))
        self.register_buffer("sorted_ids", torch.full((size,), EMPTY, **kw))
        self.register_buffer("sorted_rows", torch.arange(size, **kw))
        self.register_buffer("step", torch.zeros((), **kw))
        #: host-side upper bounds of ``step`` and of any count (no device read in the step): the
        #: packed eviction key is used while they keep it within 62 bits (:meth:`_candidates`)
        self._host_step = 0
        self._count_bound = 0
        self.register_buffer("_bucket_pos", torch.arange(size // buckets, **kw).repeat(buckets), persistent=False)

    @property
    def default_row(self) -> int:
        """The row an id not held maps to outside training (``size``)."""
        return self.size

    def extra_repr(self) -> str:
        return f"size={self.size}, eviction={self.eviction}, buckets={self.buckets}"

    #: topk eviction and merged lookup updates (False: sort every row each step, the reference)
    incremental: bool = True

    def sync_host_bounds(self) -> None:
        """Reset the host-side bounds of ``step`` and the counts from the state (one host read:
        after a load)."""
        self._host_step = int(self.step)
        self._count_bound = int(self.counts.max())

    @torch.no_grad()
    def rebuild_lookup(self) -> None:
        """Recompute ``sorted_ids`` / ``sorted_rows`` from ``row_ids`` (after a load of the row
        state alone, e.g. a sharded checkpoint read into a zone)."""
        sid, spos = torch.sort(self.row_ids[: self.size], stable=True)
        self.sorted_ids.copy_(sid)
        self.sorted_rows.copy_(spos)

    # ------------------------------------------------------------------ lookup
    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ``ids`` without changing the state.

        Args:
            ids: ``[n]`` int64 raw ids.

        Returns:
            ``(rows [n] int64, held [n] bool)``: the row of each held id, :attr:`default_row`
            for the others.
        """
        pos = torch.searchsorted(self.sorted_ids, ids).clamp_(max=self.size - 1)
        held = self.sorted_ids[pos] == ids
        return torch.where(held, self.sorted_rows[pos], self.size), held

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """:meth:`lookup`'s rows (what evaluation and the exported program run)."""
        return self.lookup(ids)[0]

    # ------------------------------------------------------------------ training
    def _candidates(self, protected: torch.Tensor, k: int) -> torch.Tensor:
        """``[B, k']`` rows of each bucket in eviction order (``k' = k`` or ``N/B``): free rows
        first, then by the policy; rows in ``protected`` (``[N]`` bool) last.

        Incremental (:attr:`incremental`, while the packed key fits): one ``topk`` of the ``k``
        smallest per bucket on a key packing the policy's fields and the row, ``O(N + B k log k)``;
        else stable sorts of every row by each field, ``O(N log N)``.  Same order either way."""
        n, b = self.size, self.buckets
        per = n // b
        big = torch.iinfo(torch.int64).max
        steps = self._host_step + 2  # last_seen + 1 is in [0, steps)
        lfu = self.eviction == "lfu"
        bound = ((self._count_bound + 2) * steps if lfu else steps) * per
        if self.incremental and bound < 1 << 62:
            # a free row has counts 0 and last_seen -1 (never written since): it sorts first
            key = self.last_seen[:n] + 1
            if lfu:
                key = key.add_(self.counts[:n] * steps)
            key = (key * per).add_(self._bucket_pos).masked_fill_(protected, big).view(b, per)
            _, idx = torch.topk(key, min(k, per), dim=1, largest=False, sorted=True)
            return idx + torch.arange(b, device=idx.device)[:, None] * per
        free = self.row_ids[:n] == EMPTY
        last = torch.where(free, -1, self.last_seen[:n])
        counts = torch.where(free, -1, self.counts[:n])
        rows = torch.arange(n, device=self.row_ids.device).view(b, per)
        order = rows
        for key in ([last, counts] if lfu else [last]):  # secondary first
            key = torch.where(protected, big, key).view(b, per)
            _, idx = torch.sort(torch.gather(key, 1, order - rows[:, :1]), dim=1, stable=True)
            order = torch.gather(order, 1, idx)
        return order

    @torch.no_grad()
    def _merge_lookup(self, s: torch.Tensor, new: torch.Tensor, took: torch.Tensor) -> None:
        """Update ``sorted_ids`` / ``sorted_rows`` for the new ids ``s[new]`` (ascending) taking
        rows ``took[new]``: drop the entries of the rows they took (an evicted id, or a free
        row), merge them in with ``searchsorted`` and one scatter; ``O(N + n log N)``, the
        same arrays as :meth:`rebuild_lookup`."""
        n = self.size
        dev = s.device
        mark = torch.zeros(n + 1, dtype=torch.bool, device=dev)
        mark[torch.where(new, took, n)] = True
        mark[n] = False
        kept = ~mark[self.sorted_rows]
        zero = torch.zeros(1, dtype=torch.int64, device=dev)
        cnew = torch.cat([zero, torch.cumsum(new, 0)])  # new ids before each batch position
        ckept = torch.cat([zero, torch.cumsum(kept, 0)])  # kept entries before each position
        p = torch.searchsorted(self.sorted_ids, s)  # where each new id goes among the old entries
        ins = torch.zeros(n + 1, dtype=torch.int64, device=dev).index_add_(0, p, new.to(torch.int64))
        pos_k = ckept[1:] - 1 + torch.cumsum(ins[:n], 0)  # + new ids inserted at or before
        pos_n = cnew[:-1] + ckept[p]
        ids = torch.empty(n + 1, dtype=torch.int64, device=dev)
        rows = torch.empty(n + 1, dtype=torch.int64, device=dev)
        at_k, at_n = torch.where(kept, pos_k, n), torch.where(new, pos_n, n)
        ids[at_k], rows[at_k] = self.sorted_ids, self.sorted_rows
        ids[at_n], rows[at_n] = s, took
        self.sorted_ids.copy_(ids[:n])
        self.sorted_rows.copy_(rows[:n])

    @torch.no_grad()
    def remap_train(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows of ``ids`` for a training step, giving every new id a row and updating the state.

        Every id gets a row of its own: held ids keep theirs; each new id takes the first
        candidate of its bucket (:meth:`_candidates`).  The batch's distinct ids of one bucket
        must fit ``size / buckets`` rows (the config check guarantees it).

        Args:
            ids: ``[n]`` int64 raw ids (``>= 0``).

        Returns:
            ``(rows [n], taken_rows [n], taken_ids [n])``, int64: each id's row; and, at the
            positions of the first occurrence of each new id, the row it took and the id
            (elsewhere ``taken_rows`` is :attr:`default_row`, i.e. nothing to reset), so the
            caller resets those rows' embedding (:func:`reset_uniform`) and optimizer state.
        """
        n_ids = ids.numel()
        dev = ids.device
        n, b = self.size, self.buckets
        self.step += 1  # a training step, with or without ids (LRU's clock is the step)
        self._host_step += 1
        self._count_bound += n_ids
        if n_ids == 0:
            e = torch.zeros(0, dtype=torch.int64, device=dev)
            return e, e, e
        s, perm = torch.sort(ids)
        first = torch.ones(n_ids, dtype=torch.bool, device=dev)
        first[1:] = s[1:] != s[:-1]
        ar = torch.arange(n_ids, device=dev)
        first_pos = torch.cummax(torch.where(first, ar, 0), 0).values  # position of each group's first
        occ = torch.zeros(n_ids, dtype=torch.int64, device=dev).index_add_(
            0, first_pos, torch.ones(n_ids, dtype=torch.int64, device=dev))  # count, at the first position
        row, held = self.lookup(s)
        new = first & ~held
        protected = torch.zeros(n + 1, dtype=torch.bool, device=dev)
        protected[torch.where(held, row, n)] = True
        cand = self._candidates(protected[:n], n_ids)
        k = cand.shape[1]
        cand = cand.reshape(-1)
        # rank of each new id within its bucket: sort new first-positions by bucket
        bucket = torch.where(new, s % self.total_buckets - self.bucket_offset, b)
        sb, order = torch.sort(bucket, stable=True)
        rank = ar - torch.searchsorted(sb, sb)
        slot = (sb * k + rank).clamp_(max=b * k - 1)
        took = torch.full((n_ids,), n, dtype=torch.int64, device=dev)
        took[order] = torch.where(sb < b, cand[slot], n)
        row = torch.where(new, took, row)
        row = row[first_pos]  # every occurrence: its group's row
        # state: the first position of each group writes; the others write the scratch slot n
        tgt = torch.where(first, row, n)
        self.row_ids[tgt] = s
        self.counts[tgt] = torch.where(new, 0, self.counts[tgt]) + occ
        self.last_seen[tgt] = self.step
        self.row_ids[n] = EMPTY  # the scratch slot: nothing held, nothing counted
        self.counts[n] = 0
        self.last_seen[n] = -1
        if self.incremental:
            self._merge_lookup(s, new, took)
        else:
            self.rebuild_lookup()
        out = torch.empty_like(row)
        out[perm] = row
        return out, torch.where(new, took, n), torch.where(new, s, 0)

    def held(self) -> int:
        """Number of rows that hold an id (a host read: for reports and tests, not the step)."""
        return int((self.row_ids[: self.size] != EMPTY).sum())


class ManagedCollisionCollection(nn.Module):
    """The remappers of an EmbeddingBagCollection's managed-collision tables, run on its input KJT
    before the lookup (TorchRec's ``ManagedCollisionCollection`` inside an MC-EBC).

    In training (``self.training``) each table's ids (all its features, concatenated) go through
    :meth:`ManagedCollisionRemapper.remap_train`; the rows new ids take are reset before the
    lookup reads them: weights to :func:`reset_uniform` of the newcomer's id (the table's init
    bounds, ``seed`` mixed with the table's name), and every optimizer state tensor with one entry
    per row (the fused TBE's momentum, or the dense-kernel optimizer's state of the table's weight,
    see :attr:`dense_optimizer`) to zero.  Outside training the ids are only looked up (an id not
    held maps to the default row).

    Args:
        tables: the collection's tables (``EmbeddingBagConfig``) that are managed, each with
            ``num_embeddings = size + 1``.
        configs: table name -> ``(size, eviction, buckets)``.
        seed: ``train.seed``.
        device: where the remapper state lives (the tables' device).

    Raises:
        ValueError: a table whose ``num_embeddings`` is not ``size + 1``.
    """

    def __init__(self, tables: list, configs: dict[str, tuple[int, str, int]], seed: int = 0,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.remappers = nn.ModuleDict()
        self._features: dict[str, list[str]] = {}
        self._init: dict[str, tuple[float, float, int]] = {}
        for t in tables:
            size, eviction, buckets = configs[t.name]
            if t.num_embeddings != size + 1:
                raise ValueError(f"managed-collision table '{t.name}' has {t.num_embeddings} rows; size + 1 = "
                                 f"{size + 1} expected")
            self.remappers[t.name] = ManagedCollisionRemapper(size, eviction, buckets, device)
            self._features[t.name] = list(t.feature_names)
            self._init[t.name] = (t.get_weight_init_min(), t.get_weight_init_max(), table_reset_key(seed, t.name))
        #: the torch optimizer of dense-kernel tables (its per-row state is reset on eviction); set by the trainer
        self.dense_optimizer: torch.optim.Optimizer | None = None

    def tables(self) -> list[str]:
        """Names of the managed tables."""
        return list(self._features)

    def features(self) -> list[str]:
        """Input features of the managed tables."""
        return [f for fs in self._features.values() for f in fs]

    def forward(self, features, ebc: nn.Module):
        """``features`` (a KeyedJaggedTensor of raw ids) with every managed feature's ids replaced by
        rows; in training also resets the rows new ids took in ``ebc`` (the EmbeddingBagCollection
        whose tables these are) and in its optimizers."""
        return remap_features(features, self._features, self.remappers, self.training,
                              lambda table: self._row_state(ebc, table), self.reset_values)

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """``mc/<table>.<buffer>`` checkpoint entries (live buffers: a load writes into them)."""
        return {f"mc/{k[len('remappers.'):]}": v for k, v in self.state_dict(keep_vars=True).items()}

    load_request = checkpoint_state

    def checkpoint_keys(self) -> set[str]:
        """The ``mc/`` keys of a checkpoint of these tables."""
        return set(self.checkpoint_state())

    def after_load(self) -> None:
        """The lookup is loaded with the rows; the host-side bounds are read from the state."""
        for rm in self.remappers.values():
            rm.sync_host_bounds()

    def reset_values(self, table: str, ids: torch.Tensor, dim: int) -> torch.Tensor:
        """``[n, dim]`` float32: the weights a row of ``table`` restarts from when new id ``ids[i]``
        takes it (:func:`reset_uniform` within the table's init bounds, keyed by ``train.seed`` and
        the table's name)."""
        low, high, key = self._init[table]
        return reset_uniform(ids, dim, key, low, high)

    def _row_state(self, ebc: nn.Module, table: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        w = ebc.embedding_weights()[table]
        if getattr(ebc, "compute_kernel", "") == "fused":
            return w, list(ebc.fused_optimizer().momentum().get(table, []))
        from dlrmctl.optim.dense import row_state_tensors

        return w, list(row_state_tensors(self.dense_optimizer, w))

    def held_rows(self, feature_names: list[str]) -> list[tuple[int, torch.Tensor, torch.Tensor, int]]:
        """What an exported program's remap step freezes, per managed feature among the program's
        input features ``feature_names``: ``(feature index, held ids [S] int64 ascending, their rows
        [S] int64, default row)``, copies on the CPU
        (:class:`~dlrmctl.inference.raw_id_remap.RawIdRemap` looks them up)."""
        per = []
        for table, fnames in self._features.items():
            rm = self.remappers[table]
            for f in fnames:
                per.append((feature_names.index(f), rm.sorted_ids.detach().cpu().clone(),
                            rm.sorted_rows.detach().cpu().clone(), rm.default_row))
        return per


def remap_features(features, table_features: dict[str, list[str]], remappers, training: bool, row_state,
                   reset_values):
    """A KeyedJaggedTensor with the ids of every managed feature replaced by rows (no host read).

    Args:
        features: KJT whose managed features hold raw ids (int64).
        table_features: table -> its features (all of them in ``features``); a table's ids are
            its features' ids concatenated.
        remappers: table -> :class:`ManagedCollisionRemapper` (a whole table, or one rank's zone).
        training: :meth:`~ManagedCollisionRemapper.remap_train` and reset the rows new ids took
            (:func:`reset_taken_rows`); else :meth:`~ManagedCollisionRemapper.lookup` only.
        row_state: table -> ``(weight [rows, dim], optimizer state tensors)`` of the rows the
            remapper's rows index (live views; called in training only).
        reset_values: ``(table, ids [n], dim) -> [n, dim]`` float32, a newcomer's weights.

    Returns:
        The KJT with the same structure and the rows as values.
    """
    from dlrmctl.sparse.jagged_tensor import KeyedJaggedTensor

    values = features.values()
    offs = features.offset_per_key()
    idx = features.index_per_key()
    out = values.clone()
    for table, fnames in table_features.items():
        segs = [(offs[idx[f]], offs[idx[f] + 1]) for f in fnames]
        ids = torch.cat([values[s:e] for s, e in segs]) if len(segs) > 1 else values[segs[0][0]:segs[0][1]]
        rm = remappers[table]
        if training:
            rows, taken, taken_ids = rm.remap_train(ids)
            w, states = row_state(table)
            reset_taken_rows(w, states, rows, taken, taken_ids, rm.size,
                             lambda i, d, t=table: reset_values(t, i, d))
        else:
            rows = rm(ids)
        p = 0
        for s, e in segs:
            out[s:e] = rows[p:p + e - s]
            p += e - s
    # the input's structure with new values: nothing to validate (and no host read to do so)
    return KeyedJaggedTensor(features.keys(), out, weights=features.weights_or_none(),
                             lengths=features.lengths(), offsets=features.offsets_or_none(),
                             stride=features.stride(), length_per_key=features.length_per_key_or_none(),
                             offset_per_key=offs, index_per_key=idx, validate=False)


@torch.no_grad()
def reset_taken_rows(w: torch.Tensor, states: list[torch.Tensor], rows: torch.Tensor, taken: torch.Tensor,
                     taken_ids: torch.Tensor, size: int, fresh) -> None:
    """Reset the rows new ids took (:meth:`ManagedCollisionRemapper.remap_train`'s output): their
    weights to ``fresh(ids, dim)`` and every optimizer state tensor with one entry per row of
    ``w`` to zero; no host read.

    Every position writes: a new id's its row; the others repeat the first new id's write
    (same row, same value), or, without any new id, rewrite the first id's row unchanged, so no
    write leaves ``w`` (a shard may not have row ``size``) and duplicate indices always carry
    equal values.

    Args:
        w: ``[R, dim]`` the rows (``R >= size``, or a zone's ``size`` rows).
        states: optimizer state tensors; those with ``R`` leading entries are reset.
        rows: ``[n]`` every id's row; ``taken`` / ``taken_ids``: ``[n]``, the row a new id took
            and the id (``size`` / anything elsewhere).
    """
    if taken.numel() == 0:
        return
    new = taken != size
    anyn = new.any()
    a = torch.argmax(new.to(torch.int8))  # the first new id, or 0
    anchor = torch.where(anyn, taken[a], rows[0])
    idx = torch.where(new, taken, anchor)
    ids = torch.where(new, taken_ids, taken_ids[a])
    mask = (new | anyn)[:, None]
    w[idx] = torch.where(mask, fresh(ids, w.shape[1]).to(w.dtype), w[idx])
    for s in states:
        if s.dim() >= 1 and s.shape[0] == w.shape[0]:
            m = mask.view(-1, *([1] * (s.dim() - 1)))
            s[idx] = torch.where(m, torch.zeros_like(s[idx]), s[idx])


