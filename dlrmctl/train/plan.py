"""The sharding plan a training job applies, and the per-rank summary rank 0 prints at start."""

from __future__ import annotations

from typing import Any

from dlrmctl.config import ExperimentConfig
from dlrmctl.distributed import comm
from dlrmctl.distributed.env import RunEnv
from dlrmctl.train.run_dir import TrainError

__all__ = ["plan_rank_summary", "resolve_plan"]


def plan_rank_summary(plan: Any, tables: list, origin: str, full: str) -> str:
    """The applied plan per rank, as rank 0 prints it at start: tables by sharding type and
    weight bytes on each rank (the per-table plan is in ``full``, plan.txt)."""
    from collections import Counter

    from dlrmctl.distributed.types import ShardingType

    kinds = [Counter() for _ in range(plan.world_size)]
    nbytes = [0] * plan.world_size
    for t in tables:
        ps = plan.plan[t.name]
        if ps.sharding_type == ShardingType.DATA_PARALLEL:
            for r in ps.ranks:
                kinds[r][ps.sharding_type.value] += 1
                nbytes[r] += t.num_embeddings * t.embedding_dim * 4
            continue
        for m in ps.shards or []:
            kinds[m.rank][ps.sharding_type.value] += 1
            nbytes[m.rank] += m.sizes[0] * m.sizes[1] * 4
    hosts = plan.world_size // plan.local_world_size
    lines = [f"sharding plan {origin}: {len(tables)} tables on {plan.world_size} rank(s), {hosts} host(s) "
             f"(per table: {full})"]
    for r in range(plan.world_size):
        what = ", ".join(f"{k} {n}" for k, n in sorted(kinds[r].items())) or "no shards"
        lines.append(f"  rank {r}: {sum(kinds[r].values())} shard(s) ({what}), {nbytes[r] / 1e6:,.2f} MB of weights")
    return "\n".join(lines)



def resolve_plan(cfg: ExperimentConfig, tables: list, env: RunEnv, meta: dict | None) -> Any:
    """The sharding plan for this job: ``sharding.plan_file``, else the planner on rank 0, broadcast.

    A GPU run is planned for its GPU (:func:`dlrmctl.distributed.env.device_planning_preset`:
    HBM and NCCL bandwidths), not for the ``cpu`` preset ``sharding.device`` defaults to.  When
    the planner fails on rank 0, the failure is broadcast in place of the plan: rank 0 raises its
    error, every other rank a :class:`TrainError` naming it (none waits out the collective timeout).
    """
    from dlrmctl.distributed.env import device_planning_preset
    from dlrmctl.distributed.types import ShardingPlan

    if cfg.sharding.plan_file:
        return ShardingPlan.load(cfg.sharding.plan_file)
    obj: Any = None
    failure: BaseException | None = None
    if env.is_main:
        from dlrmctl.planner.planner import plan_for_config

        try:
            obj = {"plan": plan_for_config(cfg, env.world_size, env.local_world_size, meta,
                                           device_planning_preset(env.device)).to_dict()}
        except Exception as e:  # noqa: BLE001 - every failure must reach the other ranks
            failure = e
            obj = {"error": f"{type(e).__name__}: {e}"}
    obj = comm.broadcast_object(obj, 0, env.pg)
    if failure is not None:
        raise failure
    if "error" in obj:
        raise TrainError(f"rank {env.rank}: the sharding planner failed on rank 0 ({obj['error']})")
    return ShardingPlan.from_dict(obj["plan"])
