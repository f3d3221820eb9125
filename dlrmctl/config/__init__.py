"""Experiment configuration: one YAML per experiment mapped onto typed dataclasses.

Loading is strict (in the spirit of nanoGPT / torchtune overrides): an unknown
key, a missing required key or a value of the wrong type is a
:class:`ConfigError` naming the full key path, e.g.
``configs/x.yaml: model.tables[3].embedding_dim: expected int, got 'abc'``.
``--set a.b=value`` overrides are parsed as YAML scalars and type-checked the
same way.

Top-level sections: ``name``, ``data``, ``model``, ``optimizer``, ``train``,
``sharding``.  Every key is listed in ``docs/configuration.md`` (its key reference is generated
from these dataclasses by ``scripts/gen_config_docs.py``).

The package:

* :mod:`~dlrmctl.config.schema`: the dataclasses (one per section) and :class:`ConfigError`;
* :mod:`~dlrmctl.config.validation`: the checks, one function per section, the bounds
  (:data:`INT_LIMITS`) and :func:`validate`, which runs them and the cross-section checks;
* :mod:`~dlrmctl.config.loading`: YAML files, ``--set`` overrides, the conversion
  (:func:`load_config`, :func:`config_from_dict`, :func:`to_dict`);
* :mod:`~dlrmctl.config.tables`: the data's meta.json and the tables a config resolves to
  (:func:`read_data_meta`, :func:`resolve_tables`, :func:`auto_embedding_dim`,
  :func:`weighted_features`, :func:`recorded_weighted_features`, :func:`meta_as_trained`,
  :func:`check_tables_against_meta`).

Every public name is importable from ``dlrmctl.config``.  Nothing here imports torch at import
time (``dlrmctl --help`` and config errors answer without it).
"""

from dlrmctl.config.loading import apply_override, config_from_dict, load_config, to_dict, type_name
from dlrmctl.config.schema import (
    ConfigError,
    DataConfig,
    DenseOptimizerConfig,
    EmbeddingOptimizerConfig,
    ExperimentConfig,
    LRScheduleConfig,
    ManagedCollisionConfig,
    ModelConfig,
    OptimizerConfig,
    ShardingConfig,
    TableConfig,
    TableConstraintsConfig,
    TableShardingConfig,
    TrainConfig,
)
from dlrmctl.config.tables import (
    auto_embedding_dim,
    check_managed_collision_sharding,
    check_tables_against_meta,
    managed_collision_tables,
    meta_as_trained,
    read_data_meta,
    recorded_weighted_features,
    resolve_tables,
    weighted_features,
)
from dlrmctl.config.validation import FP16_EMBEDDING_OPTIMIZERS, INT64_MAX, INT_LIMITS, check_bounds, validate

__all__ = [
    "ConfigError",
    "DataConfig",
    "DenseOptimizerConfig",
    "EmbeddingOptimizerConfig",
    "ExperimentConfig",
    "FP16_EMBEDDING_OPTIMIZERS",
    "INT64_MAX",
    "INT_LIMITS",
    "LRScheduleConfig",
    "ManagedCollisionConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ShardingConfig",
    "TableConfig",
    "TableConstraintsConfig",
    "TableShardingConfig",
    "TrainConfig",
    "apply_override",
    "auto_embedding_dim",
    "check_bounds",
    "config_from_dict",
    "load_config",
    "check_managed_collision_sharding",
    "check_tables_against_meta",
    "managed_collision_tables",
    "read_data_meta",
    "resolve_tables",
    "to_dict",
    "type_name",
    "validate",
    "weighted_features",
    "meta_as_trained",
    "recorded_weighted_features",
]
