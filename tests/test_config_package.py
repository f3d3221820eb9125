"""Issue 24 item 4: dlrmctl/config/ is a package: the schema (dataclasses), the checks (one function
per section plus the cross-section checks of ``validate``), the loading (files, --set, conversion)
and the table resolution are separate modules; every public name is still ``dlrmctl.config.X``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dlrmctl import config
from dlrmctl.config import (
    ConfigError,
    DataConfig,
    EmbeddingOptimizerConfig,
    ExperimentConfig,
    ModelConfig,
    OptimizerConfig,
    ShardingConfig,
    TableConfig,
    TableShardingConfig,
    TrainConfig,
)
from dlrmctl.config.validation import (
    validate,
    validate_data,
    validate_model,
    validate_optimizer,
    validate_sharding,
    validate_train,
)

PKG = Path(config.__file__).parent


@pytest.mark.parametrize("check, section, path, match", [
    (validate_data, DataConfig(batch_size=0), "data", r"^data\.batch_size: must be > 0"),
    (validate_data, DataConfig(batch_size=2**30), "data", r"^data\.batch_size: 1,073,741,824 is beyond the limit"),
    (validate_data, DataConfig(multi_hot_sizes=[3, 0]), "data", r"^data\.multi_hot_sizes: every size must be > 0"),
    (validate_model, ModelConfig(dropout=1.0), "model", r"^model\.dropout: must be in \[0, 1\)"),
    (validate_model, ModelConfig(tables=[TableConfig("a"), TableConfig("a")]), "model",
     r"^model\.tables\[1\]\.name: duplicate table name 'a'"),
    (validate_model, ModelConfig(dense_arch_layer_sizes=[8]), "m", r"^m\.dense_arch_layer_sizes: the last layer \(8\)"),
    (validate_optimizer, OptimizerConfig(embedding=EmbeddingOptimizerConfig(eps=0.0)), "optimizer",
     r"^optimizer\.embedding\.eps: must be > 0"),
    (validate_train, TrainConfig(early_stopping_patience=2, keep_best="none"), "train",
     r"^train\.early_stopping_patience: stops on the keep_best metric"),
    (validate_train, TrainConfig(precision="fp16", device="cpu"), "train", r"^train\.precision: fp16 autocast needs CUDA"),
    (validate_sharding, ShardingConfig(tables={"t": TableShardingConfig(ranks=[-1])}), "sharding",
     r"^sharding\.tables\.t\.ranks: ranks are >= 0"),
    (validate_sharding, ShardingConfig(hbm_gb=0.0), "sharding", r"^sharding\.hbm_gb: must be > 0"),
])
def test_each_section_checks_itself_under_its_path(check, section, path, match):
    with pytest.raises(ConfigError, match=match):
        check(section, path)
    # the whole config reports the same error (the name of the section is its path)
    if path != "m":
        with pytest.raises(ConfigError, match=match):
            validate(ExperimentConfig(**{path: section}))


def test_cross_section_checks_are_the_whole_configs():
    """Each section alone is valid; together they are not (the checks that span sections)."""
    model = ModelConfig(embedding_precision="fp16")
    opt = OptimizerConfig(embedding=EmbeddingOptimizerConfig(type="adam"))
    validate_model(model)
    validate_optimizer(opt)
    with pytest.raises(ConfigError, match=r"^model\.embedding_precision: fp16 tables train with"):
        validate(ExperimentConfig(model=model, optimizer=opt))
    model = ModelConfig(tables=[TableConfig("a")])
    sharding = ShardingConfig(tables={"b": TableShardingConfig()})
    validate_model(model)
    validate_sharding(sharding)
    with pytest.raises(ConfigError, match=r"^sharding\.tables\.b: no such table in model\.tables \(\['a'\]\)"):
        validate(ExperimentConfig(model=model, sharding=sharding))
    validate(ExperimentConfig())  # the defaults are valid


@pytest.mark.parametrize("module", ["schema.py", "validation.py"])
def test_schema_and_checks_do_no_io(module):
    """Reading files (YAML, meta.json) is loading.py's and tables.py's, not the schema's or the checks'."""
    tree = ast.parse((PKG / module).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"os", "json", "yaml", "pathlib", "dlrmctl.yaml_file", "dlrmctl.config.loading",
                           "dlrmctl.config.tables"}, imported
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert "open" not in calls


def test_modules_stay_small():
    for p in sorted(PKG.glob("*.py")):
        n = len(p.read_text().splitlines())
        assert n <= 520, f"{p.name}: {n} lines; split it"


def test_every_public_name_is_exported_from_the_package():
    for name in config.__all__:
        assert getattr(config, name) is not None
    for name in ("ConfigError", "load_config", "config_from_dict", "to_dict", "resolve_tables", "read_data_meta",
                 "auto_embedding_dim", "weighted_features", "INT_LIMITS", "ExperimentConfig", "ModelConfig",
                 "DenseOptimizerConfig", "LRScheduleConfig", "ShardingConfig", "DataConfig"):
        assert name in config.__all__, name
    assert config.ConfigError is config.schema.ConfigError is config.loading.ConfigError
