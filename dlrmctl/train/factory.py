"""Build the model described by an :class:`~dlrmctl.config.ExperimentConfig`."""

from __future__ import annotations

import math
import os
from typing import Any, Sequence

import torch

from dlrmctl.config import ConfigError, ExperimentConfig, weighted_features
from dlrmctl.modules.dlrm import DLRM, InteractionArch
from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
from dlrmctl.modules.embedding_modules import EmbeddingBagCollection, EmbeddingOptimizerSpec


def embedding_optimizer_spec(cfg: ExperimentConfig) -> EmbeddingOptimizerSpec:
    """``optimizer.embedding`` as the spec the embedding modules take."""
    e = cfg.optimizer.embedding
    return EmbeddingOptimizerSpec(e.type, e.lr, e.eps, e.weight_decay, tuple(e.betas))


def build_interaction(cfg: ExperimentConfig, num_sparse_features: int, embedding_dim: int) -> torch.nn.Module:
    """``model.interaction`` -> module with ``forward(dense, KeyedTensor)`` and ``output_dim(d)``."""
    if cfg.model.interaction == "dot":
        return InteractionArch(num_sparse_features)
    from dlrmctl.modules import interactions  # DCN-v2 / projection

    return interactions.build_interaction(cfg.model, num_sparse_features, embedding_dim)


def available_memory_bytes(device: torch.device | str) -> tuple[int, str]:
    """Bytes free for new tensors on ``device`` and what they are, for messages.

    CUDA: ``torch.cuda.mem_get_info`` (free device memory); CPU: ``MemAvailable`` of
    ``/proc/meminfo`` (else the machine's physical memory).
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free), f"free on {dev}"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "of host memory available"
    except (OSError, ValueError, IndexError):
        pass
    from dlrmctl.planner.devices import host_memory_bytes

    return host_memory_bytes(), "of host memory"


def check_tables_fit(cfg: ExperimentConfig, tables: Sequence[EmbeddingBagConfig], device: torch.device | str) -> None:
    """Before allocating an unsharded collection: its tables' weights and embedding optimizer
    state (the planner's byte counts, :func:`dlrmctl.planner.storage.optimizer_state_bytes`) must
    fit the memory free on ``device`` (:func:`available_memory_bytes`).

    Raises:
        ConfigError: naming the largest table, the bytes needed and the bytes available, and the remedy.
    """
    from dlrmctl.modules.embedding_configs import DataType
    from dlrmctl.planner.storage import optimizer_state_bytes
    from dlrmctl.planner.types import fmt_bytes

    if not tables:
        return
    need = {}
    for t in tables:
        wb = 2 if t.data_type == DataType.FP16 else 4
        need[t.name] = (t.num_embeddings * t.embedding_dim * wb
                        + optimizer_state_bytes(cfg.optimizer.embedding.type, t.num_embeddings, t.embedding_dim))
    total = sum(need.values())
    have, what = available_memory_bytes(device)
    if total <= have:
        return
    big = max(tables, key=lambda t: need[t.name])
    mc = cfg.model.managed_collision is not None or any(t.managed_collision is not None for t in cfg.model.tables or [])
    # managed-collision tables shard row_wise by zone of their buckets: N must divide the buckets
    nproc = ("--nproc N, N dividing the managed-collision buckets" if mc else "--nproc N")
    raise ConfigError(
        f"model.tables: the tables need {fmt_bytes(total)} (weights + {cfg.optimizer.embedding.type} state) in one "
        f"process but there is {fmt_bytes(have)} {what}; the largest, '{big.name}' ({big.num_embeddings:,} rows x "
        f"{big.embedding_dim}), needs {fmt_bytes(need[big.name])}: shard the tables over ranks ({nproc}; "
        f"`dlrmctl plan CONFIG --gpus N --device cpu` shows how many), use fp16 weights (model.embedding_precision) or fewer rows"
        + (" (model.managed_collision.size)" if mc else ""))


def build_model(
    cfg: ExperimentConfig,
    tables: Sequence[EmbeddingBagConfig],
    num_dense_features: int,
    device: torch.device | str = "cpu",
    compute_kernel: str | None = None,
    is_weighted: bool | None = None,
    sparse_placeholder: bool = False,
    check_ids: bool = True,
    meta: dict | None = None,
) -> DLRM:
    """A DLRM with an (unsharded) EmbeddingBagCollection over ``tables``.

    Args:
        tables: resolved tables (:func:`dlrmctl.config.resolve_tables`).
        num_dense_features: ``D_in`` of the dense arch (13 for Criteo).
        compute_kernel: overrides ``model.compute_kernel``.
        is_weighted: the EBC takes per-id weights; None: when a table of ``model.tables`` has
            ``weighted: true``, or (tables derived from the data) meta.json marks a feature
            ``"weighted": true`` (:func:`dlrmctl.config.weighted_features`).
        check_ids: the EBC applies ``model.on_invalid_id`` on every forward (a host read per
            feature; the trainer turns it off because its loaders apply it to the CPU batches).
        sparse_placeholder: build ``sparse_arch`` as a weightless
            :class:`~dlrmctl.distributed.model_parallel.TableConfigs` (to be sharded by
            DistributedModelParallel), so no rank ever allocates a whole table.
        meta: the data's meta.json (default: read from ``data.path``; needed there, unless
            ``is_weighted`` is given, when ``model.tables`` is empty): which tables are
            managed-collision tables (:func:`dlrmctl.config.managed_collision_tables`); their
            collection runs a :class:`~dlrmctl.modules.managed_collision.ManagedCollisionCollection`.
        device: where the model lives.  ``meta``: the tables are built on the meta device
            (no storage, no init: for a checkpoint to be loaded into, see
            :func:`materialize_model` and :func:`dlrmctl.train.reload.load_trained_model`); the
            dense part (MLPs, interaction: small) is built on the CPU as for any device.

    Initialisation is deterministic in ``train.seed`` (MLPs via
    ``torch.manual_seed``; tables via :func:`~dlrmctl.modules.embedding_modules.init_table_rows`).

    ``model.embedding_dim: auto`` (tables of several widths, each <= ``d =
    dense_arch_layer_sizes[-1]``): the interaction is wrapped in a
    :class:`~dlrmctl.modules.dlrm.ProjectedInteraction` (one linear projection per narrower
    pooled embedding); ``model.dropout`` goes to the dense and over arch MLPs;
    ``model.first_order`` adds a :class:`~dlrmctl.modules.dlrm.FirstOrder` term over the raw
    dense features and the pooled embeddings (width: the sum of every lookup's table dim);
    ``model.dense_standardize`` holds a :class:`~dlrmctl.modules.dlrm.DenseStandardize` (identity
    until the trainer sets the train split's statistics).

    Raises:
        ConfigError: tables derived from the data (``model.tables`` empty) with neither ``meta``
            nor ``is_weighted`` and no ``data.path/meta.json`` (naming that file).
        ValueError: the dot interaction with tables of different dims (not ``auto``).
        ConfigError: the tables do not fit the memory of ``device`` (:func:`check_tables_fit`).
    """
    dims = {t.embedding_dim for t in tables}
    d = cfg.model.dense_arch_layer_sizes[-1]
    auto = cfg.model.embedding_dim == "auto"
    if auto and max(dims, default=d) > d:
        raise ValueError(f"embedding_dim auto: table widths {sorted(dims)} exceed dense_arch_layer_sizes[-1] ({d})")
    if cfg.model.interaction == "dot" and dims != {d} and not auto:
        raise ValueError(
            f"dot interaction needs every table's embedding_dim == dense_arch_layer_sizes[-1] ({d}); got {sorted(dims)}"
        )
    if is_weighted is None:
        if meta is None and not cfg.model.tables:  # tables derived from the data: meta.json says which are weighted
            from dlrmctl.config import read_data_meta

            meta = read_data_meta(cfg)
            if meta is None:  # not "unweighted" by default: the file that decides it is missing
                raise ConfigError(
                    f"{os.path.join(cfg.data.path, 'meta.json')}: not found; model.tables is empty (tables derived "
                    "from the data), and the data's meta.json says which features are weighted: preprocess into "
                    "data.path first (or pass meta / is_weighted)")
        is_weighted = bool(weighted_features(cfg, meta))
    if sparse_placeholder:
        from dlrmctl.distributed.model_parallel import TableConfigs

        ebc: torch.nn.Module = TableConfigs(tables, is_weighted, on_invalid_id=cfg.model.on_invalid_id)
    else:
        if torch.device(device).type != "meta":
            check_tables_fit(cfg, tables, device)
        ebc = EmbeddingBagCollection(
            tables,
            is_weighted=is_weighted,
            device=device,
            compute_kernel=compute_kernel or cfg.model.compute_kernel,
            optimizer=embedding_optimizer_spec(cfg),
            seed=cfg.train.seed,
            check_ids=check_ids,
            on_invalid_id=cfg.model.on_invalid_id,
        )
    _attach_managed_collision(cfg, tables, ebc, meta, device, sparse_placeholder)
    # one sparse feature of the interaction per (table, feature) lookup: a feature shared by
    # two tables enters twice (feature@table)
    num_features = len(ebc.embedding_names())
    torch.manual_seed(cfg.train.seed)
    interaction = build_interaction(cfg, num_features, d)
    from dlrmctl.modules.embedding_modules import embedding_names_by_table

    # pooled embeddings in KeyedTensor order: each table's lookups, in table order
    names_by_table = embedding_names_by_table(tables)
    keys = [n for names in names_by_table for n in names]
    widths = [t.embedding_dim for t, names in zip(tables, names_by_table) for _ in names]
    if auto:
        from dlrmctl.modules.dlrm import ProjectedInteraction

        interaction = ProjectedInteraction(interaction, keys, widths, d)
    model = DLRM(
        ebc,
        dense_in_features=num_dense_features,
        dense_arch_layer_sizes=cfg.model.dense_arch_layer_sizes,
        over_arch_layer_sizes=cfg.model.over_arch_layer_sizes,
        num_sparse_features=num_features,
        embedding_dim=d,
        interaction=interaction,
        dropout=cfg.model.dropout,
        first_order_width=sum(widths) if cfg.model.first_order else None,
        dense_standardize=cfg.model.dense_standardize,
    )
    # MLPs live on `device`; the EBC already does.  On meta the dense part stays on the CPU
    # (materialize_model moves it).
    if torch.device(device).type != "meta":
        _dense_parts_to(model, device)
    return model


def _attach_managed_collision(cfg: ExperimentConfig, tables: Sequence[EmbeddingBagConfig], ebc: torch.nn.Module,
                              meta: dict | None, device: torch.device | str, sharded: bool) -> None:
    """Give ``ebc`` the remappers of its managed-collision tables (none: nothing to do); a
    sharded placeholder (``sharded``) gets their configs as ``managed_collision_configs``
    (``(tables, table -> (size, eviction, buckets), seed)``), which DistributedModelParallel turns
    into this rank's zones (:mod:`dlrmctl.distributed.sharded_mc`).

    Raises:
        ConfigError: a feature shared by a managed and an unmanaged table.
    """
    from dlrmctl.config import managed_collision_tables, read_data_meta

    mc = managed_collision_tables(cfg, meta if meta is not None else read_data_meta(cfg))
    if not mc:
        return
    managed = [t for t in tables if t.name in mc]
    shared = {f for t in managed for f in t.feature_names} & {f for t in tables if t.name not in mc for f in t.feature_names}
    if shared:
        raise ConfigError(f"model.tables: feature(s) {sorted(shared)} feed a managed-collision table and another "
                          "table; a raw-id feature feeds managed-collision tables only")
    configs = {n: (c.size, c.eviction, c.buckets) for n, c in mc.items()}
    if sharded:
        ebc.managed_collision_configs = (managed, configs, cfg.train.seed)
        return
    from dlrmctl.modules.managed_collision import ManagedCollisionCollection

    dev = "cpu" if torch.device(device).type == "meta" else device
    ebc.set_managed_collision(ManagedCollisionCollection(managed, configs, cfg.train.seed, dev))


def attach_eviction_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Give the managed-collision tables of ``model`` (if any) the dense-kernel tables' optimizer,
    whose per-row state an eviction resets (the fused TBE's state they reach themselves)."""
    from dlrmctl.distributed.model_parallel import unwrap_dlrm

    mc = getattr(unwrap_dlrm(model).sparse_arch, "managed_collision", None)
    if mc is not None:
        mc.dense_optimizer = optimizer


def _dense_parts_to(model: DLRM, device: torch.device | str) -> None:
    for part in model.dense_parts().values():
        part.to(device)


def materialize_model(model: DLRM, device: torch.device | str) -> DLRM:
    """Give a ``build_model(device="meta")`` model's tables storage on ``device``, uninitialised
    (:meth:`~dlrmctl.modules.embedding_modules.EmbeddingBagCollection.materialize`), and move
    its dense part there: ready for a checkpoint to be loaded into (nothing is randomly
    initialised).  Returns ``model`` (changed in place).

    Raises:
        TypeError: ``model.sparse_arch`` cannot be materialized (e.g. a sharded model).
    """
    sa = model.sparse_arch
    if not hasattr(sa, "materialize"):
        raise TypeError(f"materialize_model: sparse_arch is a {type(sa).__name__}; an EmbeddingBagCollection "
                        "built with build_model(device='meta') is expected")
    sa.materialize(device)
    _dense_parts_to(model, device)
    return model


def init_from_train_split(model: torch.nn.Module, cfg: ExperimentConfig, meta: dict[str, Any]) -> None:
    """The initial values a fresh model (a DLRM, or its sharded / DDP wrapper) takes from its
    train split (``model`` changed in place):

    * ``model.over_arch_bias_init: ctr``: the over arch's output bias ``= logit(p)``, ``p`` the
      train CTR of meta.json (``meta["ctr"]["train"]``);
    * ``model.dense_standardize``: ``model.dense_norm`` gets the train split's per-column mean /
      std (:func:`dlrmctl.data.columnar.dense_column_stats`).

    Deterministic (every rank computes the same values); nothing happens with neither key set.

    Raises:
        TrainError: ``ctr`` asked for but meta.json has no train CTR strictly in (0, 1); a dense
            column with NaN / inf values under ``dense_standardize`` (names the columns).
    """
    from dlrmctl.distributed.model_parallel import unwrap_dlrm
    from dlrmctl.train.run_dir import TrainError

    if cfg.model.over_arch_bias_init == "ctr":
        p = (meta.get("ctr") or {}).get(cfg.data.train_split)
        if p is None or not 0.0 < float(p) < 1.0:
            raise TrainError(f"model.over_arch_bias_init: ctr needs the train split's CTR in (0, 1) in "
                             f"{cfg.data.path}/meta.json (ctr.{cfg.data.train_split}), got {p!r}")
        last = [m for m in unwrap_dlrm(model).over_arch.modules() if isinstance(m, torch.nn.Linear)][-1]
        with torch.no_grad():
            last.bias.fill_(math.log(float(p) / (1.0 - float(p))))
    norm = unwrap_dlrm(model).dense_norm
    if norm is not None:
        from dlrmctl.data.columnar import dense_column_stats

        mean, std = dense_column_stats(cfg.data.path, cfg.data.train_split, meta=meta)
        bad = [n for n, m, s in zip(meta["dense_features"], mean, std) if not (math.isfinite(m) and math.isfinite(s))]
        if bad:
            raise TrainError(f"model.dense_standardize: dense column(s) {bad} of the {cfg.data.train_split!r} split "
                             f"of {cfg.data.path} hold NaN or inf values (no mean / std to standardise with); "
                             "re-run `dlrmctl preprocess` or drop model.dense_standardize")
        norm.set_stats(torch.from_numpy(mean), torch.from_numpy(std))
