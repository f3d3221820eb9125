"""THE shard-key layout of a checkpoint, used by save, load, reload and the offline reshard alike:
which keys a model's (and its optimizers') state is written under (format: :mod:`dlrmctl.train.checkpoint`),
what a rank requests to fill its shards on load, and the column-wise per-row moment rule
(:func:`row_moment_keys`).

Model / optimizer modules are imported where they are used: reading or resharding a checkpoint
does not load the embedding kernels.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from dlrmctl.optim.dense import ensure_optimizer_state, row_state_tensors
from dlrmctl.train.checkpoint import load as ckpt_load  # (a module: tests patch read_metadata)
from dlrmctl.train.checkpoint.codec import Blocks, pack, unpack
from dlrmctl.train.checkpoint.format import CheckpointError
from dlrmctl.train.checkpoint.load import load_checkpoint
from dlrmctl.train.checkpoint.rng import rng_state, set_rng_state
from dlrmctl.train.checkpoint.store import load_checkpoint_meta

if TYPE_CHECKING:
    from dlrmctl.distributed.model_parallel import TrainModel
    from dlrmctl.train.optimizers import TrainOptimizers

log = logging.getLogger("dlrmctl.train")


def _unwrap(model: "TrainModel") -> Any:
    """The DLRM inside a (possibly DistributedModelParallel-wrapped) model."""
    from dlrmctl.distributed.model_parallel import unwrap_dlrm

    return unwrap_dlrm(model)


# ------------------------------------------------------ column-wise key rule
class RowMomentKeys(NamedTuple):
    """Where a per-row moment of one shard goes: ``save``, the keys it is written under;
    ``load``, the key it is read from."""

    save: tuple[str, ...]
    load: str


def row_moment_keys(key: str, col: int, cols: int, dim: int, saved: Any = ()) -> RowMomentKeys:
    """THE column-wise rule for a per-row moment ``key`` (``emb/<t>/state<i>``, ``[rows]``) of a
    shard at column ``col``, ``cols`` wide, of a ``dim``-wide table; used by save, load and
    reshard alike.

    A row-wise moment is one value per row for the whole row; under column-wise sharding each
    column shard keeps its own.  Saved: the shard at column 0 gives ``key`` (the table's
    per-row moment) and every column shard ``[a, b)`` narrower than the table also gives
    ``key@cols<a>-<b>``.  Loaded: ``key@cols<a>-<b>`` when ``saved`` (the checkpoint's keys)
    has it (same column split: exact), else ``key`` (copied into each column shard).
    """
    own = f"{key}@cols{col}-{col + cols}" if cols != dim else None
    save = ((key,) if col == 0 else ()) + ((own,) if own is not None else ())
    return RowMomentKeys(save, own if own is not None and own in saved else key)


def local_embedding_shards(model: TrainModel, emb_dense_opt: torch.optim.Optimizer | None = None):
    """This rank's embedding shards as ``(table, offsets [r0, c0], sizes [rows, cols], weight, [state tensors])``.

    Sharded models use :meth:`ShardedEmbeddingBagCollection.local_shards`; an
    unsharded EBC gives each table as one full shard.  Weights and states are
    live views.  State tensors: the fused optimizer's moments, or the torch
    optimizer's per-row / per-element state for dense-kernel tables (created
    here if the optimizer has not stepped yet) — the same layout for both kernels.
    """
    ensure_optimizer_state(emb_dense_opt)
    sa = _unwrap(model).sparse_arch
    out = []
    if hasattr(sa, "local_shards"):
        for name, shards in sa.local_shards(emb_dense_opt).items():
            for meta, w, states in shards:
                out.append((name, list(meta.offsets), list(meta.sizes), w, list(states)))
        return out
    fused = sa.fused_optimizer().momentum()
    weights = sa.embedding_weights()
    for t in sa.embedding_bag_configs():
        w = weights[t.name]
        states = fused.get(t.name)
        if states is None:
            states = row_state_tensors(emb_dense_opt, w)
        out.append((t.name, [0, 0], [t.num_embeddings, t.embedding_dim], w, list(states)))
    return out


def _replicated_tables(model: TrainModel) -> set[str]:
    """Tables every rank holds whole (data_parallel, or all tables of an unsharded model)."""
    from dlrmctl.distributed.types import ShardingType

    sa = _unwrap(model).sparse_arch
    plan = getattr(sa, "plan", None) if hasattr(sa, "local_shards") else None
    if plan is None:
        return {t.name for t in sa.embedding_bag_configs()}
    return {n for n, ps in plan.plan.items() if ps.sharding_type == ShardingType.DATA_PARALLEL}


def embedding_state(model: TrainModel, emb_dense_opt: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """This rank's embedding entries of a checkpoint: ``key -> Tensor | Blocks`` (live views, no copies).

    * ``emb/<t>/weight [rows, dim]``: sharded tables as :class:`~dlrmctl.train.checkpoint.Blocks`
      (this rank's shards at their offsets); replicated tables (data_parallel, unsharded)
      as plain tensors, which DCP writes once.
    * ``emb/<t>/state<i>``: the i-th optimizer moment, per element (``[rows, dim]``,
      sharded like the weight) or per row (``[rows]``).  A row-wise moment is one value
      per row for the whole row; under column-wise sharding each column shard keeps its
      own, so those are saved twice: the column shard at column 0 gives ``state<i>``
      and every column shard ``[a, b)`` gives ``state<i>@cols<a>-<b>``.
    """
    out, blocks, row_states = _embedding_entries(model, emb_dense_opt, skip_empty=False)
    for key, (r0, c0), (nr, nc), (R, D), m in row_states:
        for k in row_moment_keys(key, c0, nc, D).save:
            blocks[(k, (R,))].append(((r0,), m))
    for (key, size), bl in blocks.items():
        out[key] = Blocks(size, bl)
    return out


def _embedding_entries(model: TrainModel, emb_dense_opt: Any, skip_empty: bool):
    """Checkpoint keys shared by save and load: ``(plain, blocks, row_states)``.

    ``plain``: replicated tables' weights / moments as whole tensors; ``blocks``:
    ``(key, global shape) -> [(offsets, view)]`` for sharded weights and per-element
    moments; ``row_states``: the per-row moments of sharded tables as
    ``(key, (r0, c0), (rows, cols), (R, D), view)``, whose mapping differs between
    save and load (column-wise shards, see :func:`embedding_load_request`).
    """
    from collections import defaultdict

    sa = _unwrap(model).sparse_arch
    dims = {t.name: (t.num_embeddings, t.embedding_dim) for t in sa.embedding_bag_configs()}
    repl = _replicated_tables(model)
    plain: dict[str, Any] = {}
    blocks: dict[tuple[str, tuple[int, ...]], list] = defaultdict(list)
    row_states = []
    for name, (r0, c0), (nr, nc), w, states in local_embedding_shards(model, emb_dense_opt):
        if skip_empty and (nr == 0 or nc == 0):
            continue
        R, D = dims[name]
        if name in repl:
            plain[f"emb/{name}/weight"] = w.detach()
            for i, m in enumerate(states):
                plain[f"emb/{name}/state{i}"] = m.detach()
            continue
        blocks[(f"emb/{name}/weight", (R, D))].append(((r0, c0), w.detach()))
        for i, m in enumerate(states):
            key = f"emb/{name}/state{i}"
            if m.dim() == 2:
                blocks[(key, (R, D))].append(((r0, c0), m.detach()))
            else:
                row_states.append((key, (r0, c0), (nr, nc), (R, D), m.detach()))
    return plain, blocks, row_states


def embedding_load_request(model: TrainModel, md: Any, emb_dense_opt: Any = None) -> tuple[dict[str, Any], Any]:
    """What this rank reads to fill its embedding shards from a checkpoint (metadata ``md``).

    Returns ``(request, finish)``: ``request`` maps keys to live views of the
    weights / moments (:class:`Blocks` or full tensors), filled in place by
    :func:`~dlrmctl.train.checkpoint.load_checkpoint`; call ``finish()`` afterwards.

    Moment mapping across plans: weights, per-element moments and row-wise moments of
    row-wise / table-wise / table_row_wise / data_parallel tables are exact under any
    resharding.  A column shard ``[a, b)`` takes ``state<i>@cols<a>-<b>`` when the
    checkpoint has it (same column split: exact, e.g. resuming with the same plan),
    else the table's row-wise moment ``state<i>`` copied into each column shard
    (exact at save time if the source was not column-wise; from a column-wise source
    ``state<i>`` is the column-0 shard's moment): :func:`~dlrmctl.train.checkpoint.row_moment_keys`.
    """
    saved = md.state_dict_metadata
    req, blocks, row_states = _embedding_entries(model, emb_dense_opt, skip_empty=True)
    first: dict[tuple[str, int, int], torch.Tensor] = {}
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    for key, (r0, c0), (nr, nc), (R, D), m in row_states:
        load = row_moment_keys(key, c0, nc, D, saved).load
        if load != key:  # this column shard's own moment (same column split)
            blocks[(load, (R,))].append(((r0,), m))
            continue
        prev = first.get((key, r0, nr))
        if prev is not None:  # another column shard of the same rows on this rank
            copies.append((prev, m))
            continue
        first[(key, r0, nr)] = m
        blocks[(key, (R,))].append(((r0,), m))
    for (key, size), bl in blocks.items():
        req[key] = Blocks(size, bl)

    @torch.no_grad()
    def finish() -> None:
        for src, dst in copies:
            dst.copy_(src)

    return req, finish


@torch.no_grad()
def check_tables(meta: dict[str, Any], tables: list, ckpt_dir: str) -> None:
    """Refuse a checkpoint whose tables differ from the model's (names the table and both shapes).

    Raises:
        CheckpointError
    """
    where = os.path.join(ckpt_dir, "meta.json")
    saved = meta.get("tables") or {}
    have = {t.name: [t.num_embeddings, t.embedding_dim] for t in tables}
    for n, shape in have.items():
        if n not in saved:
            raise CheckpointError(f"{where}: has no table '{n}' (saved tables: {sorted(saved)[:8]}...)")
        if list(saved[n]) != shape:
            raise CheckpointError(
                f"{where}: table '{n}' was saved as {saved[n][0]} x {saved[n][1]} (rows x dim), "
                f"the model's is {shape[0]} x {shape[1]}"
            )
    extra = sorted(set(saved) - set(have))
    if extra:
        raise CheckpointError(f"{where}: holds table(s) {extra} that the model does not have")


def dense_state_dict(model: TrainModel) -> dict[str, torch.Tensor]:
    """State of everything but the embeddings (MLPs, interaction): identical on every rank (live views)."""
    return {k: v for k, v in _unwrap(model).state_dict().items() if not k.startswith("sparse_arch.")}


def _managed_collision(model: TrainModel) -> Any:
    return getattr(_unwrap(model).sparse_arch, "managed_collision", None)


def managed_collision_state(model: TrainModel) -> dict[str, Any]:
    """The remappers of the managed-collision tables as ``mc/<table>.<buffer>`` entries, as one
    process writes them whatever the sharding (a sharded model's zones give their row blocks and
    the gathered lookup: collective, see :mod:`dlrmctl.distributed.sharded_mc`); empty without
    managed-collision tables."""
    mc = _managed_collision(model)
    return {} if mc is None else mc.checkpoint_state()


def managed_collision_load_request(model: TrainModel) -> tuple[dict[str, Any], set[str], Any]:
    """``(request, keys a checkpoint must hold, finish)`` for the remappers: the request's live
    buffers (or zone blocks) are filled by the load, then ``finish()`` rebuilds what is derived."""
    mc = _managed_collision(model)
    if mc is None:
        return {}, set(), lambda: None
    return mc.load_request(), mc.checkpoint_keys(), mc.after_load


def load_dense_state_dict(model: TrainModel, state: dict[str, torch.Tensor], where: str) -> None:
    """Load :func:`dense_state_dict` output.

    Raises:
        CheckpointError: keys or shapes do not match the model.
    """
    m = _unwrap(model)
    try:
        missing, unexpected = m.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shape mismatch
        raise CheckpointError(f"{where}: dense state does not match the model: {e}") from e
    bad = [k for k in missing if not k.startswith("sparse_arch.")]
    if bad or unexpected:
        raise CheckpointError(f"{where}: dense state does not match the model: missing {bad}, unexpected {unexpected}")


# ------------------------------------------------------------ the optimizers' keys
#: each packed (JSON) part of the optimizers' state (:meth:`TrainOptimizers.state_dict`) -> its key
OPTIMIZER_KEYS = {"dense": "meta/dense_optimizer", "fused": "meta/fused_optimizer",
                  "embedding_dense": "meta/embedding_dense_optimizer", "lr_schedule": "meta/lr_schedule"}
#: the dense optimizer's state tensors: ``dense_opt/<param>/<key>`` (replicated)
DENSE_OPT_PREFIX = "dense_opt/"
#: in a rank's ``rank/<r>`` entry: the optimizers' per-rank state (:meth:`TrainOptimizers.rank_state`)
RANK_OPTIMIZER_KEY = "embedding_dense_scalars"


def optimizer_entries(optimizers: "TrainOptimizers", step: int) -> dict[str, Any]:
    """The optimizers' checkpoint entries at trainer step ``step``: the dense optimizer's state
    tensors under ``dense_opt/<param>/<key>`` (live views) and each other part packed under its
    :data:`OPTIMIZER_KEYS` key."""
    sd = optimizers.state_dict(step)
    dense = sd["dense"]
    out: dict[str, Any] = {f"{DENSE_OPT_PREFIX}{p}/{k}": v for p, st in dense["tensors"].items() for k, v in st.items()}
    parts = {"dense": {"param_groups": dense["param_groups"], "scalars": dense["scalars"]}, "fused": sd["fused"],
             "embedding_dense": sd["embedding_dense"], "lr_schedule": sd["lr_schedule"]}
    out.update({OPTIMIZER_KEYS[n]: pack(v, OPTIMIZER_KEYS[n]) for n, v in parts.items()})
    return out


def optimizer_load_request(md: Any) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
    """``(request, tensors)``: the optimizers' keys to read (``md``: the checkpoint's DCP metadata;
    every ``dense_opt/`` key it lists) and the dense optimizer's state tensors they fill
    (parameter -> key -> tensor), for :func:`optimizer_state`."""
    req: dict[str, Any] = {OPTIMIZER_KEYS["dense"]: None}
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for k, m in md.state_dict_metadata.items():
        if k.startswith(DENSE_OPT_PREFIX):
            pname, skey = k[len(DENSE_OPT_PREFIX):].rsplit("/", 1)
            t = torch.empty(tuple(m.size), dtype=m.properties.dtype)
            tensors.setdefault(pname, {})[skey] = t
            req[k] = t
    req.update({OPTIMIZER_KEYS["fused"]: None, OPTIMIZER_KEYS["embedding_dense"]: None})
    return req, tensors


def optimizer_state(req: dict[str, Any], tensors: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
    """The optimizers' state (:meth:`TrainOptimizers.load_state_dict`) from a filled
    :func:`optimizer_load_request` (the LR schedule's part is not read back)."""
    def part(name: str) -> Any:
        return unpack(req[OPTIMIZER_KEYS[name]], OPTIMIZER_KEYS[name])

    return {"fused": part("fused"), "dense": {**part("dense"), "tensors": tensors},
            "embedding_dense": part("embedding_dense")}


def checkpoint_state(model: TrainModel, optimizers: "TrainOptimizers", rank: int,
                     trainer: dict[str, Any], device: torch.device | str | None = None) -> dict[str, Any]:
    """Everything one rank contributes to a checkpoint, as a flat DCP state dict (format:
    :mod:`dlrmctl.train.checkpoint`).  Tensors are live views: no copy of a table is made.

    ``trainer``: ``{step, epoch, best, evals_since_best, data}`` (``meta/trainer``); the
    optimizers' state (:meth:`TrainOptimizers.state_dict` at ``trainer["step"]``) under
    :func:`optimizer_entries`' keys.
    ``device``: this rank's device (its CUDA generator is saved with the CPU ones, no other GPU's)."""
    state: dict[str, Any] = embedding_state(model, optimizers.embedding_dense)
    state.update({f"dense/{k}": v for k, v in dense_state_dict(model).items()})
    state.update(managed_collision_state(model))
    state.update(optimizer_entries(optimizers, int(trainer["step"])))
    state["meta/trainer"] = pack(trainer, "meta/trainer")
    state[f"rank/{rank}"] = pack({"rng": rng_state(device), RANK_OPTIMIZER_KEY: optimizers.rank_state()},
                                 f"rank/{rank}")
    return state


def checkpoint_meta(model: TrainModel, plan: Any, optimizers: "TrainOptimizers") -> dict[str, Any]:
    """Descriptive fields of meta.json: table shapes, plan, embedding optimizer type."""
    tables = _unwrap(model).sparse_arch.embedding_bag_configs()
    return {"tables": {t.name: [t.num_embeddings, t.embedding_dim] for t in tables},
            "plan": None if plan is None else plan.to_dict(),
            "embedding_optimizer": optimizers.fused.spec.type}


def restore_checkpoint(path: str, model: TrainModel, optimizers: "TrainOptimizers", rank: int = 0,
                       world_size: int = 1, process_group: Any = None, plan: Any = None,
                       device: torch.device | str | None = None) -> dict[str, Any]:
    """Load a checkpoint (saved by any world size / plan) into this rank's model and optimizers.  Collective.

    Restores weights and moments (see :func:`embedding_load_request` for the
    column-wise moment rule), dense layers, every optimizer (:meth:`TrainOptimizers.load_state_dict`:
    the dense optimizer, the fused optimizer's lr and step, the embedding-dense optimizer's
    hyper-parameters) and this rank's RNG states (rank ``r`` of the saving job; rank 0's when
    the job had fewer ranks; the CUDA generator of ``device`` only, see :func:`~.rng.set_rng_state`).

    Returns:
        ``{"trainer": {step, epoch, best, data}, "world_size": saving job's ranks, "eval": the
        validation record meta.json holds, or None}``.

    Raises:
        CheckpointError: damaged files (named), different tables / shapes / optimizer type.
    """
    meta = load_checkpoint_meta(path)
    check_tables(meta, _unwrap(model).sparse_arch.embedding_bag_configs(), path)
    optimizers.check_saved_type(meta, path)
    md = ckpt_load.read_metadata(path, meta)
    req, finish = embedding_load_request(model, md, optimizers.embedding_dense)
    dense = dense_state_dict(model)
    saved_dense = {k[len("dense/"):] for k in md.state_dict_metadata if k.startswith("dense/")}
    if saved_dense != set(dense):
        raise CheckpointError(
            f"{path}: dense layers do not match the model: missing {sorted(set(dense) - saved_dense)}, "
            f"unexpected {sorted(saved_dense - set(dense))}"
        )
    req.update({f"dense/{k}": v for k, v in dense.items()})
    mc, mc_keys, mc_finish = managed_collision_load_request(model)
    saved_mc = {k for k in md.state_dict_metadata if k.startswith("mc/")}
    if saved_mc != mc_keys:
        raise CheckpointError(
            f"{path}: managed-collision remappers do not match the model: missing {sorted(mc_keys - saved_mc)}, "
            f"unexpected {sorted(saved_mc - mc_keys)}")
    req.update(mc)
    opt_req, opt_tensors = optimizer_load_request(md)
    req.update(opt_req)
    src_rank = rank if rank < int(meta["world_size"]) else 0
    req.update({k: None for k in ("meta/trainer", f"rank/{src_rank}")})
    load_checkpoint(path, req, process_group, world_size, meta, metadata=md)
    finish()
    mc_finish()
    per_rank = unpack(req[f"rank/{src_rank}"], f"rank/{src_rank}")
    trainer = unpack(req["meta/trainer"], "meta/trainer")
    same_layout = int(meta["world_size"]) == world_size and meta.get("plan") == (None if plan is None else plan.to_dict())
    optimizers.load_state_dict(optimizer_state(req, opt_tensors), per_rank[RANK_OPTIMIZER_KEY], int(trainer["step"]),
                               same_layout, path)
    set_rng_state(per_rank["rng"], device)
    return {"trainer": trainer, "world_size": int(meta["world_size"]), "eval": meta.get("eval")}


