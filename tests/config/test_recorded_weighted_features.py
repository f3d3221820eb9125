"""The weighted features a reload builds a checkpoint's model with: its record, else what the
config alone says, and a refusal where tables derived from the data meet meta.json marks (runs of
that kind were trained weighted by some versions and unweighted by others, without a record)."""

from __future__ import annotations

import pytest

from dlrmctl.config import ConfigError, ExperimentConfig, TableConfig, recorded_weighted_features

META = {"sparse_features": [{"name": "a", "weighted": True}, {"name": "b"}, {"name": "c", "weighted": True}]}
SRC = "/runs/r/checkpoints/step_00000006/meta.json"


def test_the_record_wins_whatever_meta_json_marks():
    cfg = ExperimentConfig()
    assert recorded_weighted_features(cfg, ["c"], META, SRC) == ["c"]
    assert recorded_weighted_features(cfg, [], META, SRC) == []


def test_no_record_hand_written_tables_keep_their_weighted_key():
    cfg = ExperimentConfig()
    cfg.model.tables = [TableConfig(name="t", num_embeddings=3, feature_names=["b"], weighted=True),
                        TableConfig(name="u", num_embeddings=3, feature_names=["a"])]
    assert recorded_weighted_features(cfg, None, META, SRC) == ["b"]  # meta.json's marks were never read for them


def test_no_record_derived_tables_over_unmarked_data_are_unweighted():
    cfg = ExperimentConfig()
    assert recorded_weighted_features(cfg, None, {"sparse_features": [{"name": "a"}]}, SRC) == []
    assert recorded_weighted_features(cfg, None, None, SRC) == []


def test_no_record_derived_tables_over_marked_data_is_refused_naming_file_features_and_fix():
    with pytest.raises(ConfigError) as e:
        recorded_weighted_features(ExperimentConfig(), None, META, SRC)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{SRC}: no \"weighted_features\" record")
    assert '"a", "c" weighted' in msg
    assert '"weighted_features": ["a", "c"] (trained weighted)' in msg and '"weighted_features": [] (unweighted)' in msg
    assert "docs/checkpoints.md" in msg
