"""Issue 24 item 4: dlrmctl/config/ is a package: the schema (dataclasses), the checks (one function
per section plus the cross-section checks of ``validate``), the loading (files, --set, conversion)
and the table resolution are separate modules; every public name is still ``dlrmctl.config.X``."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
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
REPO = PKG.parent.parent


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


def _config_dataclasses() -> list[type]:
    from dlrmctl.config import schema, sharding_schema

    out = [v for m in (schema, sharding_schema) for v in vars(m).values()
           if isinstance(v, type) and dataclasses.is_dataclass(v) and v.__module__ == m.__name__]
    assert len(out) >= 12, out
    return out


@pytest.mark.parametrize("cls", _config_dataclasses(), ids=lambda c: c.__name__)
def test_every_key_is_documented_once_in_its_dataclass(cls):
    """Each field has an attribute docstring (the key's one documentation, which the
    configuration reference shows), and each section a docstring."""
    from dlrmctl.config.schema import field_docs

    docs = field_docs(cls)
    missing = [f.name for f in dataclasses.fields(cls) if len(docs.get(f.name, "").strip()) < 10]
    assert not missing, f"{cls.__name__}: fields without a docstring: {missing}"
    assert cls.__doc__ and cls.__doc__.strip()


def test_field_docs_finds_a_missing_docstring():
    @dataclasses.dataclass
    class Section:
        a: int = 1
        """The documented key."""
        b: int = 2
        c: list[int] = dataclasses.field(default_factory=list)
        """Another one,
        on two lines."""

    from dlrmctl.config.schema import field_docs

    assert field_docs(Section) == {"a": "The documented key.", "c": "Another one,\non two lines."}


def _gen():
    spec = importlib.util.spec_from_file_location("gen_config_docs", REPO / "scripts" / "gen_config_docs.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return gen


def test_reference_shows_each_keys_docstring_and_links_docs_pages():
    from dlrmctl.config.schema import TrainConfig, field_docs

    gen = _gen()
    page = gen.PAGE.read_text()
    row = next(line for line in page.splitlines() if line.startswith("| `train.keep_best` |"))
    assert row.endswith(" | " + gen._cell(field_docs(TrainConfig)["keep_best"]) + " |")
    assert "[checkpoints: Best checkpoint](checkpoints.md#best-checkpoint)" in row
    assert "## Key details" not in page  # the meanings live in the dataclasses only
    assert gen._cell("see docs/configuration.md#embedding-optimizers.") == \
        "see [Embedding optimizers](#embedding-optimizers)."
    assert gen._cell("a ``x|y`` b") == "a `x\\|y` b"
    with pytest.raises(SystemExit, match="no heading #nope in docs/data.md"):
        gen._cell("docs/data.md#nope")
    with pytest.raises(SystemExit, match="no such page"):
        gen._cell("docs/missing.md")
