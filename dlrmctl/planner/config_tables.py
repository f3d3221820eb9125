"""What an experiment config asks of the planner: its tables as :class:`TableSpec` (rows, dims,
pooling factors from meta.json, optimizer, bytes per weight, constraints and fixed shardings) and
the memory each rank holds back for the dense model.  :mod:`dlrmctl.planner.planner` (which plans a
config with them) re-exports all three functions."""

from __future__ import annotations

from typing import Any

from dlrmctl.distributed.types import ComputeKernel, ShardingType
from dlrmctl.planner.storage import HeuristicStorageReservation, dense_model_bytes
from dlrmctl.planner.types import PlanError, TableSpec, compute_kernels_of, sharding_types_of


def count_dense_params(cfg: Any, num_features: int, num_dense: int, key_dims: list[int] | None = None) -> int:
    """Parameters of the dense part of a DLRM config (bottom MLP, interaction, top MLP).

    Bottom MLP ``num_dense -> dense_arch_layer_sizes``; the top MLP's input is,
    for ``dot``: ``d + F(F-1)/2`` with ``F = num_features + 1`` (DLRM, Naumov et
    al. 2019); for ``dcn``: ``(num_features + 1) * d`` plus the DCN-v2 low-rank
    layers ``2 * n * (F*d) * r + n * F*d``; for ``projection``: as ``dot`` (an
    approximation; these bytes only enter the memory reservation).  ``d`` is
    ``dense_arch_layer_sizes[-1]`` (the interaction width; it equals ``model.embedding_dim``
    unless that is ``auto``).  ``key_dims``: the widths of the pooled embeddings; each one
    narrower than ``d`` adds its projection ``w * d`` (no bias; ``embedding_dim: auto``).
    """
    m = cfg.model
    d = m.dense_arch_layer_sizes[-1]

    def mlp(n_in: int, sizes: list[int]) -> tuple[int, int]:
        n = 0
        for s in sizes:
            n += n_in * s + s
            n_in = s
        return n, n_in

    n, _ = mlp(num_dense, m.dense_arch_layer_sizes)
    F = num_features + 1
    if m.interaction == "dcn":
        fd = F * d
        n += m.dcn_num_layers * (2 * fd * m.dcn_low_rank_dim + fd)
        top_in = fd
    else:
        top_in = d + F * (F - 1) // 2
    n += mlp(top_in, m.over_arch_layer_sizes)[0]
    n += sum(w * d for w in key_dims or [] if w != d)
    if m.first_order:  # FirstOrder: bias-free Linear(num_dense, 1) + Linear(pooled width, 1)
        n += num_dense + (sum(key_dims) if key_dims else num_features * d)
    return n


def table_specs_from_config(cfg: Any, meta: dict | None, weight_bytes: int | None = None,
                            fused_available: bool = True) -> list[TableSpec]:
    """The planner's tables for an :class:`~dlrmctl.config.ExperimentConfig`.

    * rows / dim / features: :func:`dlrmctl.config.resolve_tables` (meta.json when
      the config says so).
    * pooling factor of a feature: meta.json's ``sparse_features[i].mean_pooling_factor``
      (1.0 when absent), times ``data.multi_hot_sizes[i]`` when set (each id becomes
      a bag of that many ids).  ``i`` is the feature's position in meta.json, or
      without meta.json its position in the tables' feature lists.
    * optimizer: ``optimizer.embedding.type`` (also used by dense-kernel tables).
    * bytes per weight: ``weight_bytes``, default from ``model.embedding_precision`` (fp32 4, fp16 2).
    * kernels: ``model.compute_kernel: dense`` allows only ``dense``; ``fused`` allows both.
      ``fused_available=False`` (this process has no ``fbgemm_gpu``, so training runs every
      table on the dense kernel): only ``dense``, also for constraints and fixed tables, so
      the plan is costed for the kernel that will run.
    * ``sharding.constraints.<table>`` and ``sharding.tables.<table>`` (fixed).

    Raises:
        PlanError: constraints for unknown tables, bad names, or a
            ``multi_hot_sizes`` list of the wrong length.
    """
    from dlrmctl.config import resolve_tables

    if weight_bytes is None:
        weight_bytes = 2 if cfg.model.embedding_precision == "fp16" else 4
    tables = resolve_tables(cfg, meta)
    names = {t.name for t in tables}
    for where, d in (("constraints", cfg.sharding.constraints), ("tables", cfg.sharding.tables)):
        unknown = sorted(set(d) - names)
        if unknown:
            raise PlanError(f"sharding.{where}: unknown table(s) {unknown}; the model has {sorted(names)}")
    feats = [f["name"] for f in (meta or {}).get("sparse_features", [])]
    if not feats:
        feats = [f for t in tables for f in t.feature_names]
    meta_pf = {f["name"]: float(f.get("mean_pooling_factor", 1.0)) for f in (meta or {}).get("sparse_features", [])}
    mh = cfg.data.multi_hot_sizes
    if mh is not None and len(mh) != len(feats):
        raise PlanError(f"data.multi_hot_sizes has {len(mh)} sizes but there are {len(feats)} sparse features")
    pos = {f: i for i, f in enumerate(feats)}
    default_kernels = [ComputeKernel.DENSE] if cfg.model.compute_kernel == "dense" or not fused_available else None
    from dlrmctl.config import managed_collision_tables

    # managed-collision tables train row_wise by zone of their buckets (dlrmctl.distributed.sharded_mc):
    # planned (and costed) row_wise, whatever else a constraint would allow
    managed = set(managed_collision_tables(cfg, meta))
    out = []
    for t in tables:
        pfs = []
        for f in t.feature_names:
            pf = meta_pf.get(f, 1.0)
            if mh is not None and f in pos:
                pf *= mh[pos[f]]
            pfs.append(pf)
        c = cfg.sharding.constraints.get(t.name)
        fx = cfg.sharding.tables.get(t.name)
        fixed = None
        if fx is not None:
            fixed = (ShardingType(fx.sharding_type),
                     ComputeKernel(fx.compute_kernel if fused_available else "dense"), fx.ranks, fx.column_sizes)
        out.append(
            TableSpec(
                name=t.name,
                num_embeddings=t.num_embeddings,
                embedding_dim=t.embedding_dim,
                pooling_factors=pfs,
                optimizer=cfg.optimizer.embedding.type,
                weight_bytes=weight_bytes,
                sharding_types=([ShardingType.ROW_WISE] if t.name in managed
                                else sharding_types_of(c.sharding_types) if c else None),
                compute_kernels=(compute_kernels_of(c.compute_kernels) if c and c.compute_kernels and fused_available
                                 else default_kernels),
                ranks=list(c.ranks) if c and c.ranks is not None else None,
                min_column_shard_dim=c.min_column_shard_dim if c else None,
                fixed=fixed,
            )
        )
    return out


def reservation_for_config(cfg: Any, meta: dict | None, num_features: int, percentage: float = 0.15,
                           key_dims: list[int] | None = None) -> HeuristicStorageReservation:
    """15% of each rank's memory plus the dense model (:func:`count_dense_params`, ``key_dims``: the
    pooled embeddings' widths) with its optimizer."""
    num_dense = 13
    if meta:
        num_dense = int(meta.get("num_dense_features", len(meta.get("dense_features", [])) or 13))
    params = count_dense_params(cfg, num_features, num_dense, key_dims)
    return HeuristicStorageReservation(percentage, dense_model_bytes(params, cfg.optimizer.dense.type))
