"""Planner: storage and perf estimates against hand formulas, infeasibility messages,
constraints, report columns, and plans that ``ShardingPlan.validate`` accepts."""

from __future__ import annotations

import dataclasses
import tracemalloc

import pytest

from dlrmctl.config import config_from_dict, resolve_tables
from dlrmctl.distributed.types import ComputeKernel, ShardingType
from dlrmctl.planner.enumerator import build_option, column_splits, enumerate_options
from dlrmctl.planner.perf import estimate_shard
from dlrmctl.planner.planner import EmbeddingShardingPlanner, plan_for_config, table_specs_from_config
from dlrmctl.planner.report import RANK_COLUMNS, TABLE_COLUMNS, fmt_ms
from dlrmctl.planner.storage import HeuristicStorageReservation, optimizer_state_bytes
from dlrmctl.planner.types import GiB, PlanError, TableSpec, Topology

ST = ShardingType
CK = ComputeKernel


def toy_topology(**kw) -> Topology:
    """4 ranks = 2 hosts x 2, round numbers: HBM 1 TB/s, intra 100 GB/s, inter 10 GB/s."""
    d = dict(
        world_size=4, local_world_size=2, compute_device="cuda", hbm_cap=int(10e9), ddr_cap=int(100e9),
        hbm_mem_bw=1e12, ddr_mem_bw=1e11, intra_host_bw=1e11, inter_host_bw=1e10,
    )
    d.update(kw)
    return Topology(**d)


# two features (pooling factors 2 and 1): P = 3 ids per sample, F = 2 pooled outputs
SMALL = TableSpec("small", 1000, 64, [2.0, 1.0])
B = 1024


# ------------------------------------------------------------------ storage
@pytest.mark.parametrize(
    "optimizer, state",
    [
        ("exact_rowwise_adagrad", 1000 * 4),  # one fp32 per row
        ("exact_adagrad", 1000 * 64 * 4),  # one fp32 per weight
        ("adam", 2 * 1000 * 64 * 4),  # two fp32 moments per weight
        ("exact_sgd", 0),
    ],
)
def test_table_wise_storage_matches_hand_count_per_optimizer(optimizer, state):
    assert optimizer_state_bytes(optimizer, 1000, 64) == state
    t = dataclasses.replace(SMALL, optimizer=optimizer)
    opt = build_option(toy_topology(), t, ST.TABLE_WISE, CK.FUSED, B)
    (s,) = opt.shards
    weights = 1000 * 64 * 4
    ids_in = (B * 2 + B * 3) * 4  # int32 lengths (2 features) + ids of the whole global batch
    pooled_out = B * 2 * 64 * 4  # fp32 pooled rows for every sample and feature
    assert s.weights_bytes == weights and s.optimizer_bytes == state
    assert s.storage.hbm == weights + state + ids_in + pooled_out
    assert s.storage.ddr == 0


def test_fp16_halves_weights_not_optimizer_state_and_cpu_puts_everything_in_ddr():
    t = dataclasses.replace(SMALL, weight_bytes=2, optimizer="exact_adagrad")
    (s,) = build_option(toy_topology(compute_device="cpu"), t, ST.TABLE_WISE, CK.FUSED, B).shards
    assert s.weights_bytes == 1000 * 64 * 2
    assert s.optimizer_bytes == 1000 * 64 * 4
    assert s.storage.hbm == 0 and s.storage.ddr == s.weights_bytes + s.optimizer_bytes + B * 5 * 4 + B * 2 * 64 * 4


def test_row_wise_splits_weights_and_data_parallel_replicates_with_dense_gradient():
    topo = toy_topology()
    rw = build_option(topo, SMALL, ST.ROW_WISE, CK.FUSED, B)
    assert [s.size for s in rw.shards] == [[250, 64]] * 4
    assert all(s.weights_bytes == 250 * 64 * 4 and s.optimizer_bytes == 250 * 4 for s in rw.shards)
    dp = build_option(topo, SMALL, ST.DATA_PARALLEL, CK.DENSE, B)
    assert [s.rank for s in dp.shards] == [0, 1, 2, 3]
    ids = B * 3 / 4
    for s in dp.shards:
        grad = 1000 * 64 * 4
        assert s.storage.hbm == 1000 * 64 * 4 + 1000 * 4 + grad + int(ids * 8) + int(B / 4 * 2 * 64 * 4)


def test_reservation_keeps_percentage_and_dense_model():
    topo = toy_topology()
    r = HeuristicStorageReservation(0.15, dense_bytes=10**6)
    assert r.usable(topo) == int(10e9) - int(0.15 * 10e9) - 10**6


# --------------------------------------------------------------------- perf
def test_table_wise_perf_matches_hand_formula():
    topo = toy_topology()
    perf, ids, inp, out = estimate_shard(topo, SMALL, ST.TABLE_WISE, CK.FUSED, 1000, 64, 1, B)
    ids_ = B * 3
    in_b, out_b, lookup = (B * 2 + ids_) * 4, B * 2 * 64 * 4, ids_ * max(64 * 4, 128)  # int32 lengths + ids
    assert (ids, inp, out) == (ids_, in_b, out_b)
    fwd = (in_b + lookup + out_b) / 1e12
    assert perf.fwd_compute == pytest.approx(fwd)
    # 2 hosts: the all-to-all is bounded by the inter-host link; 3/4 of it leaves the rank
    assert perf.fwd_comms == pytest.approx(0.75 * (in_b + out_b) / 1e10)
    assert perf.bwd_compute == pytest.approx(2 * fwd)
    assert perf.bwd_comms == pytest.approx(0.75 * out_b / 1e10)
    # a calibrated backward multiplier replaces TorchRec's 2.0
    p3, *_ = estimate_shard(toy_topology(bwd_compute_multiplier=3.0), SMALL, ST.TABLE_WISE, CK.FUSED, 1000, 64, 1, B)
    assert p3.bwd_compute == pytest.approx(3 * fwd)


def test_fused_backward_per_id_cost_is_paid_per_id_whatever_the_width():
    """``Topology.fused_bwd_id_s``: ids * s on a fused shard's backward (a column shard looks up
    every id of its table, so four 16-column shards pay it 4x where one 64-column shard pays it once);
    the dense kernel and data_parallel do not get it."""
    s = 20e-9
    base, topo = toy_topology(), toy_topology(fused_bwd_id_s=s)
    tw0, *_ = estimate_shard(base, SMALL, ST.TABLE_WISE, CK.FUSED, 1000, 64, 1, B)
    tw, ids, *_ = estimate_shard(topo, SMALL, ST.TABLE_WISE, CK.FUSED, 1000, 64, 1, B)
    assert ids == B * 3 and tw.bwd_compute == pytest.approx(tw0.bwd_compute + B * 3 * s)
    assert (tw.fwd_compute, tw.fwd_comms, tw.bwd_comms) == (tw0.fwd_compute, tw0.fwd_comms, tw0.bwd_comms)
    cw0, *_ = estimate_shard(base, SMALL, ST.COLUMN_WISE, CK.FUSED, 1000, 16, 1, B)
    cw, *_ = estimate_shard(topo, SMALL, ST.COLUMN_WISE, CK.FUSED, 1000, 16, 1, B)
    assert cw.bwd_compute == pytest.approx(cw0.bwd_compute + B * 3 * s)  # all the table's ids per column shard
    rw0, *_ = estimate_shard(base, SMALL, ST.ROW_WISE, CK.FUSED, 250, 64, 4, B)
    rw, *_ = estimate_shard(topo, SMALL, ST.ROW_WISE, CK.FUSED, 250, 64, 4, B)
    assert rw.bwd_compute == pytest.approx(rw0.bwd_compute + B * 3 / 4 * s)  # its row block's ids
    for st, kernel in ((ST.TABLE_WISE, CK.DENSE), (ST.DATA_PARALLEL, CK.DENSE)):
        a, *_ = estimate_shard(base, SMALL, st, kernel, 1000, 64, 1, B)
        b, *_ = estimate_shard(topo, SMALL, st, kernel, 1000, 64, 1, B)
        assert a == b, st
    with pytest.raises(PlanError, match="fused_bwd_id_s must be >= 0"):
        toy_topology(fused_bwd_id_s=-1e-9)


def test_calibration_fit_of_the_fused_lookup_recovers_its_parts():
    """``calibrate.fit_fused_lookup`` inverts the perf model: forward and backward times made from
    known per-byte, per-id and per-bag costs at the three calibration lookups give them back;
    noise that would make any part negative is clamped, a bad bandwidth is refused."""
    from dlrmctl.planner import calibrate as cal

    eff, mem_bw, mult, f_id, f_bag, b_id, b_bag = 3.0, 40e9, 6.0, 8e-9, 5e-9, 9e-9, 45e-9
    ids = cal.BATCH * cal.POOL
    shapes = ((cal.DIM, cal.POOL), (cal.NARROW_DIM, cal.POOL), (cal.DIM, 1))
    byt = [cal.fwd_bytes(d, pool=p) / (eff * mem_bw) for d, p in shapes]
    bags = [ids // p for _, p in shapes]
    fwd = [x + ids * f_id + g * f_bag for x, g in zip(byt, bags)]
    bwd = [mult * x + ids * b_id + g * b_bag for x, g in zip(byt, bags)]
    fit = cal.fit_fused_lookup(mem_bw, fwd, bwd, cal.NARROW_DIM, fallback_eff=0.5)
    assert (fit.efficiency, fit.bwd_multiplier, fit.fwd_id_s, fit.fwd_bag_s, fit.bwd_id_s, fit.bwd_bag_s) == (
        pytest.approx(eff), pytest.approx(mult), pytest.approx(f_id), pytest.approx(f_bag), pytest.approx(b_id),
        pytest.approx(b_bag))
    # narrow slower than wide (noise): bytes at the fallback efficiency, multiplier floored, nothing negative
    noisy = cal.fit_fused_lookup(mem_bw, [1e-3, 1.1e-3, 1.2e-3], [1e-3, 1.1e-3, 0.5e-3], cal.NARROW_DIM, 0.5)
    assert noisy.efficiency == pytest.approx(0.5) and noisy.bwd_multiplier == 0.1
    assert min(noisy.fwd_id_s, noisy.fwd_bag_s, noisy.bwd_id_s, noisy.bwd_bag_s) >= 0
    with pytest.raises(ValueError, match="mem_bw and fallback_eff must be > 0"):
        cal.fit_fused_lookup(0.0, fwd, bwd, cal.NARROW_DIM, 0.5)

def test_row_wise_and_table_row_wise_perf_match_hand_formulas():
    topo = toy_topology()
    rw, *_ = estimate_shard(topo, SMALL, ST.ROW_WISE, CK.FUSED, 250, 64, 4, B)
    ids = B * 3 / 4
    in_b, out_b = (B * 2 + ids) * 4, B * 2 * 64 * 4  # all lengths, the block's ids; full partial sums
    fwd = (in_b + ids * 256 + out_b) / 1e12
    assert rw.fwd_compute == pytest.approx(fwd)
    assert rw.bwd_compute == pytest.approx(2 * fwd)
    assert rw.fwd_comms == pytest.approx(0.75 * (in_b + out_b) / 1e10)
    assert rw.bwd_comms == pytest.approx(0.75 * out_b / 1e10)
    # TWRW over one host's 2 ranks of 2 hosts: the two-level output dist. The full partial sums
    # are summed inside the host (half of them leave the rank, at the intra-host 100 GB/s), then
    # each owner sends the summed rows of the half of the samples it serves, half of which are on
    # the other host (inter-host 10 GB/s): 1/2 of the flat scheme's bytes between hosts
    tw, *_ = estimate_shard(topo, SMALL, ST.TABLE_ROW_WISE, CK.FUSED, 500, 64, 2, B)
    ids = B * 3 / 2
    in_b = (B * 2 + ids) * 4
    out_s = 0.5 * out_b / 1e11 + out_b / 2 * 0.5 / 1e10
    assert tw.fwd_comms == pytest.approx(0.75 * in_b / 1e10 + out_s)
    assert tw.bwd_comms == pytest.approx(out_s)
    assert out_s < 0.75 * out_b / 1e10  # the flat all-to-all over the inter-host link


def test_data_parallel_perf_matches_hand_formula():
    topo = toy_topology()
    dp, *_ = estimate_shard(topo, SMALL, ST.DATA_PARALLEL, CK.DENSE, 1000, 64, 1, B)
    ids = B * 3 / 4
    bw = 0.5 * 1e12  # dense kernel reaches half the HBM bandwidth (TorchRec kernel_bw_lookup)
    fwd = (ids * 8 + ids * 256 + B / 4 * 2 * 64 * 4) / bw
    assert dp.fwd_compute == pytest.approx(fwd)
    assert dp.fwd_comms == 0
    assert dp.bwd_compute == pytest.approx(2 * fwd + 9.22 * 1000 * 64 * 4 / bw)
    # 256 KB <= 8 MiB: densified gradient, ring all-reduce
    assert dp.bwd_comms == pytest.approx(2 * 3 / 4 * 1000 * 64 * 4 / 1e10)
    # 10M rows: all-gather of each rank's sparse rows (int64 row + 64 fp32 values per local id)
    big = dataclasses.replace(SMALL, num_embeddings=10**7)
    dpb, *_ = estimate_shard(topo, big, ST.DATA_PARALLEL, CK.DENSE, 10**7, 64, 1, B)
    assert dpb.bwd_comms == pytest.approx(3 * (ids * (8 + 4 * 64) + 8) / 1e10)
    assert dpb.bwd_compute == pytest.approx(2 * fwd + 9.22 * B * 3 * 64 * 4 / bw)
    # Adam (and weight decay) on a small table: the densified all-reduce plus one float per row
    # counting its look-ups (so only rows looked up are updated, with no host sync)
    adam, *_ = estimate_shard(topo, dataclasses.replace(SMALL, optimizer="adam"), ST.DATA_PARALLEL, CK.DENSE,
                              1000, 64, 1, B)
    assert adam.bwd_comms == pytest.approx(2 * 3 / 4 * 1000 * (64 + 1) * 4 / 1e10)


def test_perf_follows_bytes_moved_not_rows_held():
    topo = toy_topology()
    for st in (ST.TABLE_WISE, ST.ROW_WISE, ST.COLUMN_WISE):
        small = build_option(topo, SMALL, st, CK.FUSED, B, None, [32, 32] if st == ST.COLUMN_WISE else None)
        huge_t = dataclasses.replace(SMALL, num_embeddings=10**8)
        huge = build_option(topo, huge_t, st, CK.FUSED, B, None, [32, 32] if st == ST.COLUMN_WISE else None)
        # 100,000x the rows, same ids looked up: same time
        assert huge.total_perf == pytest.approx(small.total_perf)
        # twice the batch moves twice the bytes: twice the time
        double = build_option(topo, SMALL, st, CK.FUSED, 2 * B, None, [32, 32] if st == ST.COLUMN_WISE else None)
        assert double.total_perf == pytest.approx(2 * small.total_perf)
    # more ids per sample -> more lookup bytes -> strictly more time
    heavier = dataclasses.replace(SMALL, pooling_factors=[20.0, 1.0])
    a = build_option(topo, SMALL, ST.TABLE_WISE, CK.FUSED, B).total_perf
    b = build_option(topo, heavier, ST.TABLE_WISE, CK.FUSED, B).total_perf
    assert b > a
    # data_parallel up to 8 MiB is the exception: its densified all-reduce and optimizer sweep are table-sized
    def dp(rows: int) -> float:
        return build_option(topo, dataclasses.replace(SMALL, num_embeddings=rows), ST.DATA_PARALLEL, CK.DENSE, B).total_perf

    assert dp(30_000) > 10 * dp(1000)  # 7.7 MB: still densified
    # larger tables all-gather sparse rows: the cost follows the ids, not the rows
    assert dp(10**6) == pytest.approx(dp(10**8))
    assert dp(10**6) < dp(30_000)


def test_single_host_uses_intra_host_link_and_one_rank_has_no_communication():
    one_host = toy_topology(local_world_size=4)
    p1, *_ = estimate_shard(one_host, SMALL, ST.TABLE_WISE, CK.FUSED, 1000, 64, 1, B)
    assert p1.fwd_comms == pytest.approx(0.75 * (B * 5 * 4 + B * 2 * 64 * 4) / 1e11)
    alone = toy_topology(world_size=1, local_world_size=1)
    p0, *_ = estimate_shard(alone, SMALL, ST.TABLE_WISE, CK.FUSED, 1000, 64, 1, B)
    assert p0.fwd_comms == 0 and p0.bwd_comms == 0


# ----------------------------------------------------------------- enumerator
def test_column_splits_keep_min_width_and_multiples_of_4():
    assert column_splits(128, 32, 8, True) == [[64, 64], [32, 32, 32, 32]]
    assert column_splits(192, 32, 4, True) == [[96, 96], [64, 64, 64], [48, 48, 48, 48]]
    assert column_splits(16, 4, 8, True) == [[8, 8], [4, 4, 4, 4]]
    assert column_splits(16, 4, 3, True) == [[8, 8]]


def test_enumerator_respects_types_kernels_and_data_parallel_only_dense():
    topo = toy_topology()
    # row-wise Adagrad (SMALL's optimizer) leaves the column kinds out unless asked for
    opts, _ = enumerate_options(SMALL, topo, B, int(8e9))
    assert not {ST.COLUMN_WISE, ST.TABLE_COLUMN_WISE} & {o.sharding_type for o in opts}
    opts, rej = enumerate_options(dataclasses.replace(SMALL, optimizer="exact_adagrad"), topo, B, int(8e9))
    assert rej is None
    kinds = {(o.sharding_type, o.compute_kernel) for o in opts}
    assert (ST.DATA_PARALLEL, CK.FUSED) not in kinds
    assert (ST.DATA_PARALLEL, CK.DENSE) in kinds
    assert {ST.TABLE_WISE, ST.ROW_WISE, ST.TABLE_ROW_WISE, ST.COLUMN_WISE, ST.TABLE_COLUMN_WISE} <= {k[0] for k in kinds}
    only = dataclasses.replace(SMALL, sharding_types=[ST.COLUMN_WISE], compute_kernels=[CK.DENSE])
    opts, _ = enumerate_options(only, topo, B, int(8e9))
    assert opts and all(o.sharding_type == ST.COLUMN_WISE and o.compute_kernel == CK.DENSE for o in opts)


# ----------------------------------------------------------------- feasibility
BIG = TableSpec("big", 274_352_000, 192, [1.0])


def test_huge_table_fits_four_h100_only_when_split():
    topo = Topology.from_preset("h100", 4)
    tracemalloc.start()
    res = EmbeddingShardingPlanner(topo, 16384).plan([BIG])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 * 2**20  # arithmetic only: nothing near the table's 196 GiB is ever allocated
    assert BIG.weight_bytes_total / GiB == pytest.approx(196.2, abs=0.05)
    ps = res.plan.plan["big"]
    assert ps.sharding_type in (ST.ROW_WISE, ST.COLUMN_WISE, ST.TABLE_ROW_WISE)
    assert sorted({s.rank for s in ps.shards}) == [0, 1, 2, 3]
    with pytest.raises(PlanError) as e:
        EmbeddingShardingPlanner(topo, 16384).plan([dataclasses.replace(BIG, sharding_types=[ST.TABLE_WISE])])
    msg = str(e.value)
    assert "'big'" in msg and "196.2 GiB" in msg and "63.3 GiB usable" in msg
    assert "allow row_wise over all 4 ranks" in msg


def test_huge_table_with_adam_cannot_fit_four_h100_and_the_message_says_why():
    topo = Topology.from_preset("h100", 4)
    with pytest.raises(PlanError) as e:
        EmbeddingShardingPlanner(topo, 16384).plan([dataclasses.replace(BIG, optimizer="adam")])
    msg = str(e.value)
    assert "table 'big' (274,352,000 rows x 192, fp32, adam" in msg
    assert "588.7 GiB in total (weights 196.2 GiB + optimizer state 392.5 GiB)" in msg
    assert "each of the 4 rank(s) has 63.3 GiB usable of 74.5 GiB HBM (80 GB" in msg
    # what would make it fit
    assert "more ranks: >= 10 x h100 split row-wise" in msg
    assert "exact_rowwise_adagrad (one fp32 per row) instead of adam" in msg
    assert "a smaller embedding_dim: <= 80 (61.3 GiB per rank row-wise on 4 ranks)" in msg
    assert "UVM / DDR offload" in msg


def test_tables_that_fit_alone_but_not_together_name_totals():
    topo = toy_topology(hbm_cap=int(2e9))
    tables = [TableSpec(f"t{i}", 2_000_000, 128, [1.0], sharding_types=[ST.TABLE_WISE]) for i in range(8)]
    with pytest.raises(PlanError) as e:
        EmbeddingShardingPlanner(topo, 1024).plan(tables)
    msg = str(e.value)
    assert "together need at least 7.7 GiB" in msg and "4 rank(s) have 6.3 GiB usable" in msg
    assert "at least 5 ranks of this kind" in msg  # 8.3 GB / 1.7 GB usable per rank


# ----------------------------------------------------------------- constraints
def test_pinned_ranks_allowed_types_and_kernels_are_respected():
    topo = toy_topology(local_world_size=4)
    tables = [
        TableSpec("pinned", 10_000, 64, [4.0], ranks=[2]),
        TableSpec("rw_only", 50_000, 64, [1.0], sharding_types=[ST.ROW_WISE]),
        TableSpec("dense_cw", 5_000, 64, [2.0], sharding_types=[ST.COLUMN_WISE], compute_kernels=[CK.DENSE]),
        TableSpec("two_ranks", 5_000, 64, [8.0], ranks=[0, 3], sharding_types=[ST.TABLE_WISE, ST.COLUMN_WISE]),
        TableSpec("free", 100_000, 64, [3.0]),
    ]
    res = EmbeddingShardingPlanner(topo, 4096).plan(tables)
    p = res.plan.plan
    assert {s.rank for s in p["pinned"].shards} == {2}
    assert p["rw_only"].sharding_type == ST.ROW_WISE and p["rw_only"].ranks == [0, 1, 2, 3]
    assert p["dense_cw"].sharding_type == ST.COLUMN_WISE and p["dense_cw"].compute_kernel == CK.DENSE
    assert {s.rank for s in p["two_ranks"].shards} <= {0, 3}
    res.plan.validate(res.tables, 4)


def test_fixed_shardings_from_config_are_kept_verbatim():
    cfg = config_from_dict(
        {
            "model": {"embedding_dim": 16, "dense_arch_layer_sizes": [32, 16],
                      "tables": [{"name": "a", "num_embeddings": 1000}, {"name": "b", "num_embeddings": 500},
                                 {"name": "c", "num_embeddings": 70}]},
            "data": {"path": "/nonexistent", "batch_size": 512},
            "sharding": {
                "tables": {"a": {"sharding_type": "column_wise", "ranks": [3, 1], "column_sizes": [4, 12]},
                           "b": {"sharding_type": "table_row_wise", "ranks": [2, 3]}},
                "constraints": {"c": {"sharding_types": ["data_parallel"]}},
            },
        }
    )
    plan = plan_for_config(cfg, 4, 2, None)
    a, b, c = plan.plan["a"], plan.plan["b"], plan.plan["c"]
    assert (a.sharding_type, a.ranks, [s.sizes for s in a.shards]) == (ST.COLUMN_WISE, [3, 1], [[1000, 4], [1000, 12]])
    assert (b.sharding_type, b.ranks) == (ST.TABLE_ROW_WISE, [2, 3])
    assert c.sharding_type == ST.DATA_PARALLEL and c.compute_kernel == CK.DENSE
    plan.validate(resolve_tables(cfg, None), 4)


def test_without_fbgemm_the_trainers_plan_is_all_dense_kernel(monkeypatch):
    """Training without fbgemm_gpu runs every table on the dense kernel, so the plan it makes
    (plan_for_config) costs and names that kernel, for free tables, kernel constraints and
    fixed tables alike; plan_config told the fused kernel is available keeps it."""
    from dlrmctl import _fbgemm
    from dlrmctl.planner.planner import plan_config

    raw = {
        "model": {"embedding_dim": 16, "dense_arch_layer_sizes": [32, 16],
                  "tables": [{"name": n, "num_embeddings": r} for n, r in (("a", 1000), ("b", 500), ("c", 70000))]},
        "data": {"path": "/nonexistent", "batch_size": 512},
        "sharding": {"tables": {"a": {"sharding_type": "table_wise", "compute_kernel": "fused", "ranks": [1]}},
                     "constraints": {"b": {"compute_kernels": ["fused"]}}},
    }
    cfg = config_from_dict(raw)
    monkeypatch.setattr(_fbgemm, "HAS_FBGEMM", False)
    plan = plan_for_config(cfg, 2, 2, None)
    assert {n: ps.compute_kernel for n, ps in plan.plan.items()} == {n: CK.DENSE for n in "abc"}
    plan.validate(resolve_tables(cfg, None), 2)
    topo = Topology.from_preset("cpu", 2, 2)
    kept = plan_config(cfg, topo, None, fused_available=True).plan
    assert kept.plan["a"].compute_kernel == CK.FUSED and kept.plan["b"].compute_kernel == CK.FUSED


def test_bad_constraints_are_errors_that_name_the_table():
    topo = toy_topology()
    with pytest.raises(PlanError, match="constraints.x.ranks"):
        EmbeddingShardingPlanner(topo, 64).plan([TableSpec("x", 10, 16, ranks=[7])])
    with pytest.raises(PlanError, match="table 'y': no sharding is allowed"):
        # data_parallel needs every rank, but the table is pinned to one
        EmbeddingShardingPlanner(topo, 64).plan([TableSpec("y", 10, 16, ranks=[1], sharding_types=[ST.DATA_PARALLEL])])


# -------------------------------------------------------------- config bridge
def _meta(pfs: list[float]) -> dict:
    return {"dense_features": [f"I{i}" for i in range(13)],
            "sparse_features": [{"name": f"C{i}", "num_embeddings": 100 * (i + 1), "mean_pooling_factor": pf}
                                for i, pf in enumerate(pfs)]}


def test_pooling_factors_come_from_meta_and_multi_hot_sizes():
    cfg = config_from_dict({"data": {"path": "/nonexistent"}})
    specs = table_specs_from_config(cfg, _meta([1.0, 2.5, 1.0]))
    assert [t.name for t in specs] == ["t_C0", "t_C1", "t_C2"]
    assert [t.pooling_factors for t in specs] == [[1.0], [2.5], [1.0]]
    assert [t.num_embeddings for t in specs] == [100, 200, 300]
    cfg = config_from_dict({"data": {"path": "/nonexistent", "multi_hot_sizes": [3, 1, 7]}})
    assert [t.pooling_factors for t in table_specs_from_config(cfg, _meta([1.0, 2.5, 1.0]))] == [[3.0], [2.5], [7.0]]
    cfg = config_from_dict({"data": {"path": "/nonexistent"}, "model": {"tables": [{"name": "x", "num_embeddings": 9}]}})
    assert table_specs_from_config(cfg, None)[0].pooling_factors == [1.0]
    cfg = config_from_dict({"data": {"path": "/nonexistent", "multi_hot_sizes": [3, 1]}})
    with pytest.raises(PlanError, match="multi_hot_sizes has 2 sizes but there are 3"):
        table_specs_from_config(cfg, _meta([1.0, 1.0, 1.0]))


MIXED = {
    "data": {"path": "/nonexistent", "batch_size": 2048, "multi_hot_sizes": [1, 3, 1, 20, 2, 1]},
    "model": {
        "embedding_dim": 16,
        "dense_arch_layer_sizes": [64, 16],
        "tables": [
            {"name": "big", "num_embeddings": 2_000_000},
            {"name": "mid", "num_embeddings": 60_000},
            {"name": "tiny", "num_embeddings": 3},
            {"name": "heavy", "num_embeddings": 400_000},
            {"name": "shared", "num_embeddings": 1000, "feature_names": ["f1", "f2"]},
        ],
    },
}


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("st", [None, *[t.value for t in ShardingType]])
def test_cpu_plans_for_2_3_4_ranks_pass_validate(world, st):
    cfg_raw = {**MIXED, "sharding": {"device": "cpu", "ddr_gb": 8.0}}
    lws = 2 if world == 4 else world  # 4 ranks: pretend 2 hosts x 2 so table_row/column_wise are real
    if st is not None:
        cfg_raw["sharding"]["constraints"] = {t["name"]: {"sharding_types": [st]} for t in MIXED["model"]["tables"]}
    cfg = config_from_dict(cfg_raw)
    plan = plan_for_config(cfg, world, lws, None)
    plan.validate(resolve_tables(cfg, None), world)
    assert (plan.world_size, plan.local_world_size) == (world, lws)
    if st is not None:
        assert {ps.sharding_type.value for ps in plan.plan.values()} == {st}


# --------------------------------------------------------------------- report
def test_report_has_required_columns_step_time_proposals_and_runner_up():
    topo = toy_topology(local_world_size=4)
    tables = [TableSpec(f"t{i}", 10_000 * (i + 1), 64, [float(1 + 3 * i)]) for i in range(6)]
    res = EmbeddingShardingPlanner(topo, 4096).plan(tables)
    text = res.report()
    for col in RANK_COLUMNS + TABLE_COLUMNS:
        assert col in text
    for col in ("HBM (GB)", "DDR (GB)", "Perf (ms)", "Input (MB)", "Output (MB)", "Shards",
                "Sharding", "Kernel", "Ranks", "Shard sizes", "Storage", "Pooling factor", "Dim", "Rows"):
        assert col in text
    p = res.partition
    assert f"Estimated embedding step time: {fmt_ms(p.critical_path)} ms = bandwidth (slowest rank): " \
           f"{fmt_ms(p.bandwidth_path)} ms" in text
    assert p.latency > 0 and p.critical_path == pytest.approx(p.bandwidth_path + p.latency)
    assert "fixed latency" in text and "kernel launches" in text and "Why this plan: " in text
    assert f"Proposals evaluated: {res.proposals_evaluated}" in text and res.proposals_evaluated > 1
    assert "Runner-up: " in text and " vs " in text
    for t in tables:
        assert t.name in text


def test_planning_dlrmv2_on_8_h100_is_feasible_and_balanced():
    rows = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209,
            11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]
    mh = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]
    tables = [TableSpec(f"t_cat_{i}", n, 128, [float(m)]) for i, (n, m) in enumerate(zip(rows, mh))]
    topo = Topology.from_preset("h100", 8)
    res = EmbeddingShardingPlanner(topo, 65536).plan(tables)
    res.plan.validate(tables, 8)
    p = res.partition
    assert max(p.mem) <= res.reservation.usable(topo)
    assert p.bandwidth_path / (sum(p.loads) / 8) < 1.10
    # the critical path can never beat the heaviest single shard nor the average load
    lower = max(sum(p.loads) / 8, max(o.max_shard_perf for o in p.options))
    assert p.critical_path >= lower * (1 - 1e-9)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_column_kinds_without_ranks_fit_any_world_size(world):
    """A hand-given column_wise / table_column_wise table without ranks or column_sizes: two
    column shards on two ranks, or one full-width shard on a one-rank job (sharding.force)."""
    cfg = config_from_dict(
        {
            "model": {"embedding_dim": 16, "dense_arch_layer_sizes": [32, 16],
                      "tables": [{"name": "a", "num_embeddings": 50}, {"name": "b", "num_embeddings": 50}]},
            "data": {"path": "/nonexistent", "batch_size": 512},
            "sharding": {"tables": {"a": {"sharding_type": "column_wise"}, "b": {"sharding_type": "table_column_wise"}}},
        }
    )
    plan = plan_for_config(cfg, world, world, None)
    for name in ("a", "b"):
        shards = plan.plan[name].shards
        assert len(shards) == min(2, world) and len({s.rank for s in shards}) == len(shards)
        assert sum(s.sizes[1] for s in shards) == 16
    plan.validate(resolve_tables(cfg, None), world)
