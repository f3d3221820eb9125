"""Config schema: every shipped YAML loads; errors name the key path."""

import pytest

from dlrmctl.config import ConfigError, config_from_dict, load_config

from tests.conftest import REPO

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def test_configs_directory_is_not_empty():
    names = {p.name for p in CONFIGS}
    assert {"demo.yaml", "criteo_sample.yaml", "criteo_kaggle.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.name


def test_criteo_kaggle_is_the_standard_dlrm():
    cfg = load_config(REPO / "configs" / "criteo_kaggle.yaml")
    assert len(cfg.model.tables) == 26
    assert cfg.model.dense_arch_layer_sizes == [512, 256, 64, 16]
    assert cfg.model.over_arch_layer_sizes == [512, 256, 1]


@pytest.mark.parametrize(
    "raw,overrides,match",
    [
        ({"model": {"embeding_dim": 8}}, [], r"x.yaml: model.embeding_dim: unknown key"),
        ({"model": {"tables": [{"name": "a"}, {"name": "b", "embedding_dim": "abc"}]}}, [],
         r"model.tables\[1\].embedding_dim: expected int \| null, got 'abc'"),
        ({}, ["model.embedding_dim=abc"], r"model.embedding_dim: expected int \| 'auto', got 'abc'"),
        ({}, ["train.nosuch=1"], r"train.nosuch: unknown key"),
        ({}, ["optimizer.embedding.type=adamw"], r"optimizer.embedding.type: expected one of"),
        ({}, ["data.batch_size=0"], r"data.batch_size: must be > 0"),
        ({"model": {"tables": [{"name": "a"}, {"name": "a"}]}}, [], r"model.tables\[1\].name: duplicate"),
        ({}, ["model.over_arch_layer_sizes=[8, 2]"], r"last layer must have size 1"),
        ({}, ["model.embedding_dim=32"], r"dense_arch_layer_sizes: the last layer \(16\) must equal the embedding dim \(32\)"),
        ({}, ["model.embedding_dim"], r"expected KEY=VALUE"),
        ({"train": {"progress": "yes"}}, [], r"train.progress: expected bool"),
        ({}, ["data.shuffle_window_rows=0"], r"data.shuffle_window_rows: must be an integer >= 1 \(rows\), got 0"),
        ({}, ["data.shuffle_block_rows=-5"], r"data.shuffle_block_rows: must be an integer >= 1 \(rows\), got -5"),
        ({}, ["data.shuffle_window_rows=1.5"], r"data.shuffle_window_rows: expected int"),
        ({}, ["data.workers=-1"], r"data.workers: must be >= 0, got -1"),
        ({}, ["data.workers=many"], r"data.workers: expected int \| 'auto', got 'many'"),
        ({"data": {"worker": 2}}, [], r"data.worker: unknown key \(did you mean 'workers'\?\)"),
        ({"model": {"managed_collision": {"size": 100, "eviction": "fifo"}}}, [],
         r"model.managed_collision.eviction: expected one of \['lfu', 'lru'\], got 'fifo'"),
        ({"model": {"managed_collision": {"size": 0}}}, [], r"model.managed_collision.size: .* integer >= 1; got 0"),
        ({"model": {"tables": [{"name": "a", "managed_collision": {"size": 10, "buckets": 3}}]}}, [],
         r"model.tables\[0\].managed_collision.buckets: must be >= 1 and divide"),
    ],
)
def test_config_errors_name_the_key_path(raw, overrides, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict(raw, overrides, source="x.yaml")


def test_set_overrides_are_type_checked_and_applied():
    cfg = config_from_dict({}, ["model.embedding_dim=32", "model.dense_arch_layer_sizes=[64, 32]", "train.max_steps=5",
                               "optimizer.embedding.eps=1e-6"])
    assert cfg.model.embedding_dim == 32 and cfg.model.dense_arch_layer_sizes == [64, 32]
    assert cfg.train.max_steps == 5 and cfg.optimizer.embedding.eps == pytest.approx(1e-6)


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: x\nmodel:\n  embedding_dim: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+: invalid YAML"):
        load_config(p)


def test_shuffle_defaults_are_the_loaders():
    from dlrmctl.config import DataConfig
    from dlrmctl.data.loader import DEFAULT_SHUFFLE_BLOCK_ROWS, DEFAULT_SHUFFLE_WINDOW_ROWS

    assert DataConfig().shuffle_window_rows == DEFAULT_SHUFFLE_WINDOW_ROWS == 262_144
    assert DataConfig().shuffle_block_rows == DEFAULT_SHUFFLE_BLOCK_ROWS == 8_192


@pytest.mark.parametrize("table, match", [
    ({"sharding_type": "column_wise", "column_sizes": [16, 0], "ranks": [0, 1]}, r"t\.column_sizes: every column shard"),
    ({"sharding_type": "column_wise", "column_sizes": [-4, 20], "ranks": [0, 1]}, r"t\.column_sizes: every column shard"),
    ({"sharding_type": "column_wise", "column_sizes": []}, r"t\.column_sizes: every column shard"),
    ({"sharding_type": "table_wise", "ranks": [-1]}, r"t\.ranks: ranks are >= 0"),
])
def test_hand_given_shard_widths_and_ranks_are_checked_at_load(table, match):
    """A zero-width or negative column shard (or a negative rank) was accepted by the config and refused
    only after the ranks were launched."""
    with pytest.raises(ConfigError, match=r"sharding\.tables\." + match):
        config_from_dict({"sharding": {"tables": {"t": table}}})


@pytest.mark.parametrize("kind", ["config", "plan", "topology"])
def test_every_yaml_file_reader_names_the_file_and_line_and_wants_a_mapping(tmp_path, kind):
    """Configs, sharding plans and topology files go through one reader (dlrmctl/yaml_file.py): a syntax
    error names file:line, a missing file the path, a top level that is not a mapping says so."""
    from dlrmctl.distributed.types import PlanError, ShardingPlan
    from dlrmctl.planner.types import PlanError, load_topology_file

    load, err = {"config": (load_config, ConfigError), "plan": (ShardingPlan.load, PlanError),
                 "topology": (load_topology_file, PlanError)}[kind]
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: 1\nb: [1, 2\nc: 3\n")
    with pytest.raises(err, match=r"bad.yaml:\d+: invalid YAML in "):
        load(bad)
    with pytest.raises(err, match=r"missing.yaml: cannot read "):
        load(tmp_path / "missing.yaml")
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(err, match=r"list.yaml: expected a mapping at the top level of the .*got list"):
        load(lst)


def test_a_bad_value_from_set_names_the_override(tmp_path):
    """A type or range error in a value given by --set names that override, not just the file."""
    from dlrmctl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"demo.yaml with --set train.malloc_tuning=1: train.malloc_tuning: expected bool"):
        load_config("configs/demo.yaml", ["train.max_steps=3", "train.malloc_tuning=1"])
    with pytest.raises(ConfigError, match=r"with --set data.batch_size=-4: data.batch_size: must be > 0"):
        load_config("configs/demo.yaml", ["data.batch_size=-4"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: {batch_size: -4}\n")
    with pytest.raises(ConfigError) as e:  # the file's own value: no --set named
        load_config(bad, ["train.max_steps=3"])
    assert "--set" not in str(e.value) and str(e.value).startswith(f"{bad}: data.batch_size")


def _raw_meta(tmp_path, pooling=1):
    import json

    meta = {"dense_features": ["I1"], "sparse_features": [
        {"name": "C1", "num_embeddings": 5000, "multi_hot": pooling > 1, "max_pooling_factor": pooling, "ids": "raw"},
        {"name": "C2", "num_embeddings": 7, "multi_hot": False}]}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    return meta


def test_a_raw_id_feature_gets_a_managed_collision_table_of_size_plus_one_rows_or_an_error_naming_the_key(tmp_path):
    from dlrmctl.config import managed_collision_tables, resolve_tables

    meta = _raw_meta(tmp_path)
    cfg = config_from_dict({"data": {"path": str(tmp_path), "batch_size": 64}})
    with pytest.raises(ConfigError, match=r"meta.json: feature 'C1' holds raw ids .*set model.managed_collision: ") as e:
        resolve_tables(cfg, meta)
    assert "(or model.managed_collision)" not in str(e.value)  # the default key is named once
    cfg = config_from_dict({"data": {"path": str(tmp_path), "batch_size": 64},
                            "model": {"managed_collision": {"size": 64, "eviction": "lru"}}})
    assert {t.name: t.num_embeddings for t in resolve_tables(cfg, meta)} == {"t_C1": 65, "t_C2": 7}
    assert managed_collision_tables(cfg, meta)["t_C1"].eviction == "lru"
    cfg = config_from_dict({"data": {"path": str(tmp_path), "batch_size": 64},
                            "model": {"tables": [{"name": "t", "feature_names": ["C1", "C2"]}]}})
    with pytest.raises(ConfigError, match=r"model.tables\[0\].managed_collision"):
        resolve_tables(cfg, meta)


def test_a_managed_collision_size_below_one_batchs_distinct_ids_is_an_error_naming_the_key(tmp_path):
    from dlrmctl.config import resolve_tables

    meta = _raw_meta(tmp_path, pooling=3)
    cfg = config_from_dict({"data": {"path": str(tmp_path), "batch_size": 64},
                            "model": {"managed_collision": {"size": 400, "buckets": 2}}})
    assert resolve_tables(cfg, meta)[0].num_embeddings == 401  # 2 buckets of 200 >= 64 x 3
    cfg = config_from_dict({"data": {"path": str(tmp_path), "batch_size": 64},
                            "model": {"tables": [{"name": "C1", "managed_collision": {"size": 300, "buckets": 2}}]}})
    with pytest.raises(ConfigError, match=r"model.tables\[0\].managed_collision.size: 300 rows \(2 bucket\(s\) "
                                          r"of 150\) .* up to 192 .* give size >= 384"):
        resolve_tables(cfg, meta)
