"""Synthetic generator: determinism, bayes_auc, Zipf skew, AUC helper vs brute force."""

from __future__ import annotations

import numpy as np
import pytest

from dlrmctl.data.columnar import DataError, ShardWriter, open_split, read_meta, shard_schema
from dlrmctl.data.synthetic import generate_synthetic, roc_auc


def test_roc_auc_matches_brute_force_pair_count_with_ties():
    rng = np.random.default_rng(0)
    s = rng.integers(0, 5, 200).astype(float)  # many ties
    y = rng.integers(0, 2, 200)
    pos, neg = s[y == 1], s[y == 0]
    brute = ((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (len(pos) * len(neg))
    assert roc_auc(s, y) == pytest.approx(brute, abs=1e-12)


def test_synthetic_is_deterministic_and_has_bayes_auc_in_range(tmp_path):
    generate_synthetic(tmp_path / "a", rows=20_000, seed=3)
    generate_synthetic(tmp_path / "b", rows=20_000, seed=3)
    generate_synthetic(tmp_path / "c", rows=20_000, seed=4)
    ma, mb = read_meta(tmp_path / "a"), read_meta(tmp_path / "b")
    assert ma["splits"] == mb["splits"] and ma["bayes_auc"] == mb["bayes_auc"]
    assert 0.5 < ma["bayes_auc"] < 1.0 and 0.15 < ma["ctr"]["train"] < 0.35
    sa, sb, sc = (open_split(tmp_path / x, "train") for x in "abc")
    for col in ("label", "I1", "C1", "C26"):
        assert np.array_equal(sa.shards[0].read_column(col), sb.shards[0].read_column(col))
    assert not np.array_equal(sa.shards[0].read_column("C1")[:1000], sc.shards[0].read_column("C1")[:1000])
    assert sum(ma["splits"][s]["rows"] for s in ma["splits"]) == 20_000
    for f in ma["sparse_features"]:
        ids = sa.shards[0].read_column(f["name"])
        assert ids.min() >= 0 and ids.max() < f["num_embeddings"]


def test_synthetic_ids_are_zipf_skewed(tmp_path):
    generate_synthetic(tmp_path, rows=50_000, seed=0, num_embeddings=1000, zipf_alpha=1.05)
    ids = open_split(tmp_path, "train").shards[0].read_column("C9")
    counts = np.sort(np.bincount(ids, minlength=1000))[::-1]
    # truncated Zipf(1.05) over 1000 ranks: top rank ~13 % of mass, top 10 ranks ~38 %
    p = np.arange(1, 1001) ** -1.05
    p /= p.sum()
    share = counts / counts.sum()
    assert share[0] == pytest.approx(p[0], rel=0.1)
    assert share[:10].sum() == pytest.approx(p[:10].sum(), rel=0.05)
    assert counts[0] / max(counts[99], 1) > 50  # heavy head: uniform would give ~1


def test_planted_signal_is_learnable_by_counting_per_id_ctr(tmp_path):
    """A simple estimator (train-split per-id CTR on the signal tables) beats chance on val
    and stays below the Bayes AUC written in meta."""
    generate_synthetic(tmp_path, rows=100_000, seed=1)
    meta = read_meta(tmp_path)
    tr, va = open_split(tmp_path, "train").shards[0], open_split(tmp_path, "val").shards[0]
    ytr, yva = tr.read_column("label"), va.read_column("label")
    score = np.zeros(len(yva))
    for f in meta["sparse_features"][:8]:
        n = f["num_embeddings"]
        c = np.bincount(tr.read_column(f["name"]), minlength=n)
        s = np.bincount(tr.read_column(f["name"]), weights=ytr, minlength=n)
        rate = (s + 1.0) / (c + 4.0)
        score += np.log(rate / (1 - rate))[va.read_column(f["name"])]
    auc = roc_auc(score, yva)
    assert 0.6 < auc < meta["bayes_auc"]


def test_a_split_whose_shard_cannot_be_opened_leaves_no_temp_file_of_the_splits_opened_before(tmp_path):
    """The train writer's temp file was left behind when opening a later split's writer failed or
    was interrupted (Ctrl-C under load): the writers were opened outside the cleanup."""
    part = tmp_path / "d" / "parts" / "synthetic"
    (part / "val.arrow.tmp").mkdir(parents=True)  # not a file: opening the val writer fails
    with pytest.raises(DataError, match="val.arrow: cannot write: a directory"):
        generate_synthetic(tmp_path / "d", rows=100, seed=0)
    assert sorted(p.name for p in part.iterdir()) == ["val.arrow.tmp"]  # no train.arrow.tmp; the directory kept
    assert (part / "val.arrow.tmp").is_dir()


def test_a_shard_writer_whose_rename_fails_leaves_no_temp_file(tmp_path):
    """``ShardWriter.close`` removes its temp file when the final rename fails (as ``abort``)."""
    schema = shard_schema(["I1"], ["C1"])
    (tmp_path / "s.arrow").mkdir()
    (tmp_path / "s.arrow" / "x").write_text("")  # a non-empty directory: the rename over it fails
    w = ShardWriter(tmp_path / "s.arrow", schema)
    w.write({"label": np.zeros(3, np.float32), "I1": np.ones(3, np.float32), "C1": np.arange(3)})
    with pytest.raises(DataError, match="s.arrow: cannot write: a directory"):
        w.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.arrow"]
