"""Evaluation with O(local rows) memory per rank (issue 13 item 2).

Each rank keeps its own rows; the AUC's rarer class travels around a ring of point-to-point
shifts and every sum is exact, so the metrics of 2 or 3 ranks (uneven, empty, one-class ranks)
equal the 1-process metrics bit for bit (weighted AUC: 1e-12 relative, see metrics/compute.py and
metrics/exact.py).
"""

import itertools
import logging
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from dlrmctl.metrics import auc, compute_metrics_from_logits
from dlrmctl.metrics.exact import PairCounter, circulating_rows, exact_sum, from_pieces, sum_pieces
from tests.dist_utils import run_multiprocess

KEYS = ("auc", "logloss", "ne", "calibration", "accuracy", "ctr", "num_samples")


def brute_force_auc(s, y, w=None) -> Fraction:
    """O(n^2) reference over every (positive, negative) pair, exact rationals (ties 1/2)."""
    w = [1.0] * len(s) if w is None else list(w)
    num, wp, wn = Fraction(0), Fraction(0), Fraction(0)
    pos = [(a, Fraction(c)) for a, b, c in zip(s, y, w) if b > 0.5]
    neg = [(a, Fraction(c)) for a, b, c in zip(s, y, w) if b <= 0.5]
    for (a, ca), (b, cb) in itertools.product(pos, neg):
        num += ca * cb * (1 if a > b else Fraction(1, 2) if a == b else 0)
    wp, wn = sum(c for _, c in pos), sum(c for _, c in neg)
    return num / (wp * wn)


def _same(a: dict, b: dict) -> bool:
    return all(a[k] == b[k] or (isinstance(a[k], float) and math.isnan(a[k]) and math.isnan(b[k])) for k in KEYS)


def _ring_auc(z, y, w, parts: list[np.ndarray]) -> float:
    """The ring of :func:`compute_metrics_from_logits` run in one process over row index sets ``parts``."""
    pos = y > 0.5
    circulate_pos = pos.sum() <= (~pos).sum()
    total = Fraction(0)
    travelling = [circulating_rows(z[p], pos[p], None if w is None else w[p], circulate_pos) for p in parts]
    for p in parts:
        c = PairCounter(z[p], pos[p], None if w is None else w[p], circulate_pos)
        for rows in travelling:
            c.visit(*rows)
        total += c.total
    ww = np.ones(z.size) if w is None else w
    return float(total / (exact_sum(ww[pos]) * exact_sum(ww[~pos])))


# ------------------------------------------------------------ exact sums
def test_exact_sum_equals_rational_sum_over_the_whole_float64_range_and_pieces_round_trip():
    rng = np.random.default_rng(0)
    for _ in range(100):
        x = rng.normal(size=int(rng.integers(0, 60))) * 10.0 ** rng.integers(-320, 300, size=1)
        x = np.concatenate([x, [5e-324, -5e-324, 2.2e-308, -0.0]])
        want = sum((Fraction(float(v)) for v in x), Fraction(0))
        got = exact_sum(x)
        assert got == want
        assert float(got) == math.fsum(x)
        assert from_pieces(sum_pieces(got)) == want
    # cancellation that a float64 sum gets wrong: (1e16 + 1 - 1e16) is 1, numpy says 0 or 2
    assert exact_sum(np.array([1e16, 1.0, -1e16])) == 1
    assert math.isnan(exact_sum(np.array([1.0, np.nan]))) and exact_sum(np.array([np.inf, 1.0])) == math.inf
    big = exact_sum(np.full(4, 1.7e308))
    assert sum_pieces(big)[0] == math.inf  # beyond float64: one inf piece


# ------------------------------------------------------------------- ring AUC
@pytest.mark.parametrize("weighted", [False, True])
def test_ring_auc_over_any_partition_equals_brute_force_pair_counting(weighted):
    rng = np.random.default_rng(5)
    for trial in range(40):
        n = int(rng.integers(2, 70))
        z = rng.integers(0, 8, n).astype(np.float64) if trial % 2 else rng.normal(size=n)  # many ties
        y = (rng.random(n) < rng.uniform(0.1, 0.9)).astype(np.float64)
        w = rng.integers(0, 4, n) * 0.75 if weighted else None
        ww = np.ones(n) if w is None else w
        if ww[y > 0.5].sum() == 0 or ww[y <= 0.5].sum() == 0:
            continue
        want = float(brute_force_auc(z, y, w))
        for k in (1, 2, 3, 5):
            cut = np.sort(rng.integers(0, n + 1, k - 1))  # uneven parts, empty ones included
            parts = np.split(rng.permutation(n), cut)
            got = _ring_auc(z, y, w, parts)
            if weighted:
                assert got == pytest.approx(want, rel=1e-12, abs=0), (trial, k)
            else:
                assert got == want, (trial, k)  # integer pair counts: exact
        assert auc(z, y, w) == pytest.approx(want, rel=1e-12, abs=0)


def test_all_equal_logits_give_auc_one_half_exactly():
    y = np.array([0, 1, 1, 0, 1], dtype=np.float64)
    assert compute_metrics_from_logits(np.full(5, 2.5), y)["auc"] == 0.5
    assert _ring_auc(np.full(5, 2.5), y, None, [np.array([0, 1]), np.array([], dtype=np.int64), np.array([2, 3, 4])]) == 0.5


# ------------------------------------------------------- spawned gloo ranks
def _dataset(seed: int, n: int, ties: bool, weighted: bool):
    rng = np.random.default_rng(seed)
    z = rng.normal(size=n).astype(np.float32) * 2
    if ties:
        z = np.round(z * 2) / 2  # a handful of distinct logits
    y = (rng.random(n) < 1 / (1 + np.exp(-z))).astype(np.float32)
    w = rng.uniform(0, 3, n) if weighted else None
    return z, y, w


#: row index sets of each rank: uneven, an empty rank, a positives-only rank
def _split(y: np.ndarray, world: int) -> list[np.ndarray]:
    idx = np.arange(y.size)
    if world == 2:
        return [idx[:700], idx[700:]]
    pos = idx[y > 0.5]
    rest = np.setdiff1d(idx, pos[:40])
    return [np.array([], dtype=np.int64), pos[:40], rest]  # rank 0 empty, rank 1 only positives


CASES = [
    # (name, seed, n, ties, weighted, transform)
    ("plain", 1, 1000, False, False, None),
    ("ties", 2, 1000, True, False, None),
    ("weighted ties", 3, 1000, True, True, None),
    ("one class", 4, 1000, False, False, "all_neg"),
    ("nan logit", 5, 1000, False, False, "nan"),
    ("all equal", 6, 1000, False, False, "equal"),
]


def _case(name):
    _, seed, n, ties, weighted, tr = next(c for c in CASES if c[0] == name)
    z, y, w = _dataset(seed, n, ties, weighted)
    if tr == "all_neg":
        y[:] = 0
    elif tr == "nan":
        z[333] = np.nan
    elif tr == "equal":
        z[:] = 1.25
    return z, y, w


def _rank_metrics(env, world):
    out = {}
    for name, *_ in CASES:
        z, y, w = _case(name)
        mine = _split(y, world)[env.rank]
        out[name] = compute_metrics_from_logits(z[mine], y[mine], None if w is None else w[mine], pg=env.pg,
                                                device=env.device)
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3])
def test_distributed_metrics_equal_one_process_metrics(world, caplog):
    got = run_multiprocess(_rank_metrics, world, world, timeout_s=120)
    for name, *_ in CASES:
        z, y, w = _case(name)
        with caplog.at_level(logging.WARNING, logger="dlrmctl.metrics"):
            want = compute_metrics_from_logits(z, y, w)
        for r in range(world):
            m = got[r][name]
            assert m["num_samples"] == y.size
            if w is None:
                assert _same(m, want), (name, r, m, want)  # bit for bit
            else:
                for k in KEYS:
                    if k == "auc":  # weighted AUC: float64 cumulative weights, partition-dependent last bits
                        assert m[k] == pytest.approx(want[k], rel=1e-12, abs=0), (name, k)
                    else:
                        assert m[k] == want[k], (name, k)
    assert got[0]["one class"]["auc"] == 0.5
    assert math.isnan(got[0]["nan logit"]["auc"]) and not math.isnan(got[0]["nan logit"]["ctr"])
    assert got[0]["all equal"]["auc"] == 0.5
    assert got[0]["ties"]["auc"] == float(brute_force_auc(*_case("ties")[:2]))


def _rank_errors(env):
    z = np.arange(4, dtype=np.float64)
    y = np.array([0, 1, 0, 1], dtype=np.float64)
    out = []
    for bad in ("length", "weights"):
        try:
            if bad == "length":
                compute_metrics_from_logits(z if env.rank else z[:3], y, pg=env.pg, device=env.device)
            else:
                compute_metrics_from_logits(z, y, np.ones(4) if env.rank else None, pg=env.pg, device=env.device)
        except ValueError as e:
            out.append(str(e))
    return out


@pytest.mark.multiprocess
def test_bad_input_on_one_rank_raises_on_every_rank_instead_of_hanging():
    r0, r1 = run_multiprocess(_rank_errors, 2, timeout_s=60)
    assert "rank 0: logits: 3 values for 4 labels" in r0[0] and "rank(s) [0]" in r1[0]
    assert all("weights given on rank(s) [1] only" in e[1] for e in (r0, r1))


def _rank_ring(env):
    from dlrmctl.distributed import comm

    rows = [3, 0, 2]  # rank 1 sends nothing
    t = torch.full((rows[env.rank], 2), float(env.rank), dtype=torch.float64)
    got = comm.ring_shift(t, rows[(env.rank - 1) % 3], env.pg)
    return got.tolist(), comm.all_gather_tensor(torch.tensor([env.rank, 10 * env.rank]), env.pg).tolist()


@pytest.mark.multiprocess
def test_ring_shift_moves_uneven_rows_to_the_next_rank():
    out = run_multiprocess(_rank_ring, 3, timeout_s=60)
    assert out[0][0] == [[2.0, 2.0]] * 2 and out[1][0] == [[0.0, 0.0]] * 3 and out[2][0] == []
    assert all(o[1] == [[0, 0], [1, 10], [2, 20]] for o in out)


# --------------------------------------------------------- Trainer.evaluate
def _trainer_eval(env, data, run_dir):
    from dlrmctl.config import config_from_dict
    from dlrmctl.train import evaluator
    from dlrmctl.distributed.env import RunEnv
    from dlrmctl.train.trainer import Trainer

    seen = []
    real = evaluator.compute_metrics_from_logits

    def spy(z, y, w=None, **kw):
        seen.append((np.array(z), np.array(y)))
        return real(z, y, w, **kw)

    evaluator.compute_metrics_from_logits = spy
    cfg = config_from_dict({
        "name": "ev", "data": {"path": data, "batch_size": 64, "eval_batch_size": 37, "prefetch": 0},
        "model": {"embedding_dim": 8, "dense_arch_layer_sizes": [16, 8], "over_arch_layer_sizes": [16, 1]},
        "train": {"epochs": 1, "max_steps": 3, "log_every": 0, "eval_every": 0, "run_dir": run_dir,
                  "progress": False},
    })
    renv = RunEnv(env.rank, env.world_size, env.local_world_size, env.device, env)
    t = Trainer(cfg, renv, run_dir)
    m = t.evaluate()
    return m, seen[-1]


@pytest.mark.multiprocess
def test_trainer_evaluate_on_2_ranks_keeps_rows_local_and_equals_one_process_metrics_of_all_rows(tmp_path):
    from dlrmctl.data.synthetic import generate_synthetic

    data = tmp_path / "data"
    generate_synthetic(data, rows=1500, seed=4, num_embeddings=[40] * 26)
    out = run_multiprocess(_trainer_eval, 2, str(data), str(tmp_path / "run"), timeout_s=180)
    (m0, (z0, y0)), (m1, (z1, y1)) = out
    assert _same(m0, m1)
    assert 0 < z0.size and 0 < z1.size  # each rank saw only its own rows
    want = compute_metrics_from_logits(np.concatenate([z0, z1]), np.concatenate([y0, y1]))
    assert _same(m0, want) and m0["num_samples"] == z0.size + z1.size


def _rank_odd_inputs(env):
    z = torch.arange(4.0, requires_grad=True) * 1  # a torch tensor that needs grad, as a model returns it
    y = torch.tensor([0, 1, 0, 1.0])
    out = [compute_metrics_from_logits(z, y, pg=env.pg, device=env.device)["auc"]]
    try:  # an input numpy cannot read as numbers (TypeError) on rank 1 only: every rank must raise
        compute_metrics_from_logits([object()] * 4 if env.rank == 1 else z, y, pg=env.pg, device=env.device)
    except ValueError as e:
        out.append(str(e))
    return out


@pytest.mark.multiprocess
def test_tensor_inputs_on_any_device_work_and_an_unreadable_input_on_one_rank_raises_everywhere():
    # torch tensors (grad, or another device) raised in np.asarray on one rank while the others
    # waited in the collective; any input error is now told to every rank
    z = torch.arange(4.0, requires_grad=True) * 1
    y = torch.tensor([0, 1, 0, 1.0])
    want = compute_metrics_from_logits(z.detach().numpy(), y.numpy())
    assert _same(compute_metrics_from_logits(z, y), want) and auc(z, y) == want["auc"] == 0.75
    r0, r1 = run_multiprocess(_rank_odd_inputs, 2, timeout_s=60)
    assert r0[0] == r1[0] == 0.75
    assert "rank 1: TypeError" in r1[1] and "invalid metric input on rank(s) [1]" in r0[1]
