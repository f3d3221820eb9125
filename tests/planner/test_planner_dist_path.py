"""The calibrated input / output dist rates of the perf model (``Topology.input_dist_bw``,
``Topology.output_dist_bw``) and their calibration.

What is checked: each sharding type is charged its own input bytes at ``input_dist_bw``
(all of them, the rank's own included: the whole input dist handles them) and its pooled
output bytes that leave the rank at ``min(output_dist_bw, comm_bw)``, forward and backward;
data_parallel is charged neither (its gradient sync keeps the link bandwidth); without the
figures the wire model is unchanged; topology files round-trip the keys, files without them
load with the wire model, bad values are refused naming the file and the key; the 2-rank
calibration writes both figures, with their spread, and the file loads back.
"""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from dlrmctl.distributed.types import ComputeKernel as CK
from dlrmctl.distributed.types import ShardingType as ST
from dlrmctl.planner.perf import estimate_shard, input_dist_seconds, shard_comm_bytes
from dlrmctl.planner.types import GB, PlanError, TableSpec, Topology, load_topology_file, save_topology_file

B, W = 4096, 4
TABLE = TableSpec("t", 100_000, 64, [4.0, 1.0])  # two features: B*F lengths, B*P ids


def _topo(**kw) -> Topology:
    return Topology(world_size=W, local_world_size=W, compute_device="cpu", hbm_cap=0, ddr_cap=int(8e9),
                    hbm_mem_bw=0.0, ddr_mem_bw=20e9, intra_host_bw=1e9, inter_host_bw=1e9, llc_bytes=0, **kw)


SHARDS = [  # (sharding type, shard rows, cols, row shards)
    (ST.TABLE_WISE, 100_000, 64, 1),
    (ST.COLUMN_WISE, 100_000, 32, 1),
    (ST.TABLE_COLUMN_WISE, 100_000, 16, 1),
    (ST.ROW_WISE, 25_000, 64, W),
    (ST.TABLE_ROW_WISE, 25_000, 64, W),
]


def _uncalibrated_and_calibrated(st, rows, cols, n, **rates):
    """(comm bytes, uncalibrated estimate, calibrated estimate tuple) of one shard."""
    cb = shard_comm_bytes(TABLE, st, cols, n, B, W)
    p0, *_ = estimate_shard(_topo(), TABLE, st, CK.FUSED, rows, cols, n, B)
    return cb, p0, estimate_shard(_topo(**rates), TABLE, st, CK.FUSED, rows, cols, n, B)


@pytest.mark.parametrize("st,rows,cols,n", SHARDS)
def test_each_sharding_type_pays_its_input_bytes_at_the_input_dist_rate(st, rows, cols, n):
    base, cal = _topo(), _topo(input_dist_bw=0.25e9)
    cb, p0, (p1, _, inp, out) = _uncalibrated_and_calibrated(st, rows, cols, n, input_dist_bw=0.25e9)
    assert inp == int(cb.input) and cb.input > 0
    wire = (W - 1) / W * cb.input / 1e9
    # calibrated: all input bytes (the rank's own too) at the input-dist rate instead of the leaving ones on the wire
    assert p1.fwd_comms - p0.fwd_comms == pytest.approx(cb.input / 0.25e9 - wire)
    assert input_dist_seconds(cal, cb.input) == pytest.approx(cb.input / 0.25e9)
    assert input_dist_seconds(base, cb.input) == pytest.approx(wire)
    # nothing else moves
    assert (p1.fwd_compute, p1.bwd_compute, p1.bwd_comms) == (p0.fwd_compute, p0.bwd_compute, p0.bwd_comms)


@pytest.mark.parametrize("st,rows,cols,n", SHARDS)
def test_each_sharding_type_pays_its_output_bytes_at_the_output_dist_rate_both_ways(st, rows, cols, n):
    cb, p0, (p1, *_) = _uncalibrated_and_calibrated(st, rows, cols, n, output_dist_bw=0.5e9)
    leaving = (W - 1) / W * cb.output
    assert cb.output == B * TABLE.output_rows_per_sample * cols * 4  # row shards send full-width partial sums
    assert p1.bwd_comms == pytest.approx(leaving / 0.5e9)
    assert p0.bwd_comms == pytest.approx(leaving / 1e9)
    assert p1.fwd_comms - p0.fwd_comms == pytest.approx(leaving / 0.5e9 - leaving / 1e9)
    # a calibrated rate above the link's is capped by the link (several hosts: the slower inter-host link)
    fast = _topo(output_dist_bw=5e9)
    assert fast.output_bw == 1e9
    p2, *_ = estimate_shard(fast, TABLE, st, CK.FUSED, rows, cols, n, B)
    assert p2.bwd_comms == pytest.approx(p0.bwd_comms)


def test_data_parallel_keeps_the_link_bandwidth_for_its_gradient_sync():
    small = TableSpec("s", 1000, 64, [1.0])  # densified all-reduce
    big = TableSpec("b", 1_000_000, 64, [1.0])  # all-gathered rows
    for t in (small, big):
        p0, *_ = estimate_shard(_topo(), t, ST.DATA_PARALLEL, CK.DENSE, t.num_embeddings, 64, 1, B)
        p1, *_ = estimate_shard(_topo(input_dist_bw=0.1e9, output_dist_bw=0.1e9), t, ST.DATA_PARALLEL, CK.DENSE,
                                t.num_embeddings, 64, 1, B)
        assert p0 == p1 and p1.fwd_comms == 0.0 and p1.bwd_comms > 0


@pytest.mark.parametrize("name", ["input_dist_bw", "output_dist_bw"])
def test_a_negative_rate_is_refused_naming_the_field(name):
    with pytest.raises(PlanError, match=f"{name} must be a finite number >= 0"):
        _topo(**{name: -1.0})
    with pytest.raises(PlanError, match=f"{name} must be a finite number >= 0"):
        _topo(**{name: float("inf")})


FILE = {"compute_device": "cpu", "hbm_gb": 0.0, "ddr_gb": None, "hbm_bw_gbps": 0.0, "ddr_bw_gbps": 17.5,
        "intra_host_bw_gbps": 0.9, "inter_host_bw_gbps": 0.9, "default_gpus_per_host": None, "source": "test"}


def test_topology_files_round_trip_the_rates_and_older_files_keep_the_wire_model(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(FILE))
    t = Topology.from_preset(load_topology_file(path), 2)
    assert (t.input_dist_bw, t.output_dist_bw, t.output_bw) == (0.0, 0.0, 0.9 * GB)
    p = dataclasses.replace(load_topology_file(path), input_dist_bw_gbps=1.6, output_dist_bw_gbps=0.55)
    save_topology_file(tmp_path / "new.yaml", p, {"output_dist_gbps": 0.55, "spread": {"output_dist_gbps": [0.5, 0.6]}})
    back = load_topology_file(tmp_path / "new.yaml")
    assert back == p
    t = Topology.from_preset(back, 2)
    assert t.input_dist_bw == pytest.approx(1.6 * GB) and t.output_bw == pytest.approx(0.55 * GB)
    assert Topology.from_preset("h100", 8).output_dist_bw == 0.0  # presets: the link bandwidth


@pytest.mark.parametrize("key,value", [("input_dist_bw_gbps", 0.0), ("output_dist_bw_gbps", -0.5),
                                       ("output_dist_bw_gbps", "fast")])
def test_bad_rates_in_a_file_are_refused_naming_the_file_and_key(tmp_path, key, value):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(dict(FILE, **{key: value})))
    with pytest.raises(PlanError, match=f"topology file {path}:\\d+: {key} must be a finite number > 0"):
        load_topology_file(path)


@pytest.mark.parametrize("key,value", [("input_dist_bw_gbps", 1.0e300), ("output_dist_bw_gbps", 1.0e-320),
                                       ("intra_host_bw_gbps", 1.0e-300), ("ddr_gb", 1.0e300)])
def test_rates_that_would_overflow_or_underflow_in_the_planner_are_refused(tmp_path, key, value):
    """Finite but absurd values (the planner scales GB/s to bytes/s and divides by them: 1e300
    GB/s overflows to inf, 1e-320 divides to inf) are refused at load, naming file, key and range."""
    path = tmp_path / "absurd.yaml"
    path.write_text(yaml.safe_dump(dict(FILE, **{key: value})))
    with pytest.raises(PlanError, match=f"topology file {path}:\\d+: {key} must be between"):
        load_topology_file(path)


def test_a_calibrated_input_dist_is_never_charged_below_the_wire():
    """The input-dist rate is calibrated on one host: on a link slower than it (a second host at
    0.01 GB/s) the input bytes still take their wire time."""
    cb = shard_comm_bytes(TABLE, ST.TABLE_WISE, 64, 1, B, W)
    slow = _topo(input_dist_bw=1.5e9)
    slow = dataclasses.replace(slow, intra_host_bw=0.01e9, inter_host_bw=0.01e9)
    wire = (W - 1) / W * cb.input / 0.01e9
    assert input_dist_seconds(slow, cb.input) == pytest.approx(wire)
    assert input_dist_seconds(_topo(input_dist_bw=1.5e9), cb.input) == pytest.approx(
        max(cb.input / 1.5e9, (W - 1) / W * cb.input / 1e9))


def test_the_two_rank_calibration_measures_both_paths():
    """``measure_comm`` on 2 real gloo ranks: the input dist of the big batch costs more than the
    two-sample one, the pooled all-to-all path is timed, and the byte counts are those of the
    calibration's shapes."""
    from dlrmctl.planner import calibrate as cal

    got = cal.measure_comm(2, max_s=60.0)
    assert got["idist_big_s"].median > got["idist_small_s"].median > 0
    # table_wise, 2 tables on 2 ranks: each rank's table receives every source's lengths + ids (int32)
    assert got["idist_bytes"].median == 2 * (cal.BATCH + cal.BATCH * cal.IDIST_POOL) * 4
    assert got["pooled_bytes"].median == (4 << 20) // 2  # half of each rank's 4 MiB leaves it
    assert got["pooled_a2a_s"].median > 0


# ---------------------------------------------------------------------------- enumerator / evaluate_plan
def test_a_dense_option_faster_on_a_calibrated_machine_is_kept():
    """The fused kernel's efficiency is higher, but its per-id cost makes it slower here: the dense
    option survives enumeration (``prune_dominated`` decides by the shards' times, not the efficiencies)."""
    from dlrmctl.planner.enumerator import enumerate_options

    topo = _topo(kernel_efficiency={"fused": 1.0, "dense": 0.5}, fused_fwd_id_s=2e-6, fused_bwd_id_s=2e-6)
    opts, _ = enumerate_options(TableSpec("t", 10_000, 64, [2.0]), topo, B, int(8e9))
    by = {(o.sharding_type, o.compute_kernel): o for o in opts if o.sharding_type == ST.TABLE_WISE}
    assert (ST.TABLE_WISE, CK.DENSE) in by
    assert by[(ST.TABLE_WISE, CK.DENSE)].shards[0].time < by[(ST.TABLE_WISE, CK.FUSED)].shards[0].time
    # where fused is faster on every shard and no larger, the dense option is still pruned
    plain = _topo(kernel_efficiency={"fused": 1.0, "dense": 0.5})
    opts, _ = enumerate_options(TableSpec("t", 10_000, 64, [2.0]), plain, B, int(8e9))
    assert all(o.compute_kernel == CK.FUSED for o in opts if o.sharding_type == ST.TABLE_WISE)


def test_evaluate_plan_applies_the_placed_cache_hits_without_rebuilding(monkeypatch):
    """``evaluate_plan`` on a cache-aware topology charges every shard what ``build_option`` charges it
    at that shard's hit fraction (``cache_hit_fractions`` of the placement)."""
    from dlrmctl.distributed.model_parallel import plan_from_types
    from dlrmctl.modules.embedding_configs import EmbeddingBagConfig
    from dlrmctl.planner.enumerator import build_option
    from dlrmctl.planner.perf import cache_hit_fractions
    from dlrmctl.planner.planner import evaluate_plan

    topo = dataclasses.replace(_topo(), world_size=2, local_world_size=2, llc_bytes=2 << 20,
                               cache_speedup={"fused": 3.0, "dense": 2.0})
    rows = [4000, 200_000, 50_000]
    specs = [TableSpec(f"t{i}", n, 64, [3.0]) for i, n in enumerate(rows)]
    cfgs = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=n, embedding_dim=64) for i, n in enumerate(rows)]
    plan = plan_from_types(cfgs, {"t0": "data_parallel", "t1": "row_wise", "t2": "column_wise"}, 2, 2)
    from dlrmctl.planner import planner as planner_mod

    built = []
    monkeypatch.setattr(planner_mod, "build_option", lambda *a, **k: built.append(a[1].name) or build_option(*a, **k))
    part = evaluate_plan(plan, specs, topo, B)
    monkeypatch.undo()
    assert sorted(built) == ["t0", "t1", "t2"]  # each placed option built once, its hits applied in place
    hits = cache_hit_fractions(topo, part.options, part.ranks, B)
    assert any(0 < h < 1 for hs in hits for h in hs)
    for o, rk, h in zip(part.options, part.ranks, hits):
        cols = [s.size[1] for s in o.shards] if o.sharding_type == ST.COLUMN_WISE else None
        ref = build_option(topo, o.table, o.sharding_type, o.compute_kernel, B,
                           None if o.sharding_type == ST.DATA_PARALLEL else rk, cols, hit=h)
        assert [s.perf for s in o.shards] == [s.perf for s in ref.shards]
        assert [s.time for s in o.shards] == [s.time for s in ref.shards]
        assert [s.storage for s in o.shards] == [s.storage for s in ref.shards]


# ---------------------------------------------------------------------------- table_row_wise across hosts
def _two_hosts(**kw) -> Topology:
    """2 hosts x 4 ranks, the link between hosts 10x slower than inside one."""
    return dataclasses.replace(_topo(**kw), world_size=8, local_world_size=4, intra_host_bw=10e9, inter_host_bw=1e9)


def test_table_row_wise_across_hosts_sends_one_lth_of_the_flat_bytes_between_hosts():
    from dlrmctl.planner.perf import twrw_hierarchical

    W8, L = 8, 4
    flat = shard_comm_bytes(TABLE, ST.ROW_WISE, 64, W8, B, W8, L)  # row_wise: a flat all-to-all over both hosts
    twrw = shard_comm_bytes(TABLE, ST.TABLE_ROW_WISE, 64, L, B, W8, L)
    assert twrw.output == flat.output == B * TABLE.output_rows_per_sample * 64 * 4  # partial sums of every sample
    assert flat.output_inter_host == pytest.approx(flat.output * (W8 - L) / W8)
    assert twrw.output_inter_host == pytest.approx(flat.output_inter_host / L)
    # one host, or hosts of one rank: nothing crosses / the flat scheme
    assert shard_comm_bytes(TABLE, ST.TABLE_ROW_WISE, 64, 4, B, 4, 4).output_inter_host == 0.0
    one = shard_comm_bytes(TABLE, ST.TABLE_ROW_WISE, 64, 1, B, W8, 1)
    assert one.output_inter_host == pytest.approx(one.output * (W8 - 1) / W8)
    assert twrw_hierarchical(8, 4) and not twrw_hierarchical(4, 4) and not twrw_hierarchical(8, 1)


@pytest.mark.parametrize("cal", [0.0, 2e9])
def test_table_row_wise_across_hosts_is_charged_the_two_level_output_dist(cal):
    topo = _two_hosts(output_dist_bw=cal)
    L = 4
    cb = shard_comm_bytes(TABLE, ST.TABLE_ROW_WISE, 64, L, B, 8, L)
    p, *_ = estimate_shard(topo, TABLE, ST.TABLE_ROW_WISE, CK.FUSED, 25_000, 64, L, B)
    cap = cal or float("inf")
    want = (L - 1) / L * cb.output / min(cap, 10e9) + cb.output_inter_host / min(cap, 1e9)
    assert p.bwd_comms == pytest.approx(want)
    # the flat scheme over the slow link would have cost far more
    assert p.bwd_comms < 7 / 8 * cb.output / topo.output_bw


def test_step_latency_counts_the_two_level_collectives_of_table_row_wise_across_hosts():
    from types import SimpleNamespace

    from dlrmctl.planner.perf import step_latency

    def placed(topo, types):
        """Options as ``step_latency`` reads them (type, kernel, table) and their shards' ranks."""
        opts = [SimpleNamespace(sharding_type=st, compute_kernel=CK.FUSED, table=TABLE) for st in types]
        return opts, [list(range(topo.local_world_size if st == ST.TABLE_ROW_WISE else 1)) for st in types]

    two, one = _two_hosts(), dataclasses.replace(_topo(), world_size=4, local_world_size=4)
    for topo, types, want in [
        (two, [ST.TABLE_ROW_WISE], 2 + 4),  # input dist + the two levels, forward and backward
        (two, [ST.TABLE_ROW_WISE, ST.TABLE_WISE], 2 + 4 + 2),  # + the pooled all-to-all of table_wise
        (one, [ST.TABLE_ROW_WISE], 2 + 2),  # one host: the shared pooled all-to-all
    ]:
        assert step_latency(topo, *placed(topo, types))[2] == want
