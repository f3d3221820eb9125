"""Embedding sharding planner: tables + topology -> ShardingPlan (see planner.py for the pipeline)."""

from dlrmctl.planner.planner import (
    EmbeddingShardingPlanner,
    PlanResult,
    evaluate_plan,
    plan_config,
    plan_for_config,
    table_specs_from_config,
)
from dlrmctl.planner.types import DEVICE_PRESETS, PlanError, TableSpec, Topology

__all__ = [
    "DEVICE_PRESETS",
    "EmbeddingShardingPlanner",
    "PlanResult",
    "PlanError",
    "TableSpec",
    "Topology",
    "evaluate_plan",
    "plan_config",
    "plan_for_config",
    "table_specs_from_config",
]
