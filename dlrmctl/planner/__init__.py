"""Embedding sharding planner: tables + topology -> ShardingPlan (see planner.py for the pipeline).

The pipeline's names are imported on first use, so ``dlrmctl.planner.types`` (the device presets
the CLI names in ``plan --help``) is read without the planner's modules or NumPy."""

from dlrmctl.planner.types import DEVICE_PRESETS, PlanError, TableSpec, Topology

_PIPELINE = ("EmbeddingShardingPlanner", "PlanResult", "evaluate_plan", "plan_config", "plan_for_config",
             "table_specs_from_config")


def __getattr__(name: str):
    if name in _PIPELINE:
        from dlrmctl.planner import planner

        return getattr(planner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
