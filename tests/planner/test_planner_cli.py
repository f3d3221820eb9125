"""``dlrmctl plan`` end to end through typer's CliRunner: plan.yaml + report written and loadable."""

from __future__ import annotations

import pytest
import typer
import yaml
from typer.testing import CliRunner

from dlrmctl import cli
from dlrmctl.commands import plan as plan_cmd
from dlrmctl.config import load_config, resolve_tables
from dlrmctl.distributed.types import ShardingPlan

CONFIG = {
    "name": "plan-cli",
    "data": {"path": "/nonexistent/data", "batch_size": 4096},
    "model": {
        "embedding_dim": 16,
        "dense_arch_layer_sizes": [64, 16],
        "tables": [
            {"name": "user", "num_embeddings": 3_000_000},
            {"name": "item", "num_embeddings": 200_000},
            {"name": "cat", "num_embeddings": 40},
            {"name": "pinned", "num_embeddings": 5_000},
        ],
    },
    "sharding": {"constraints": {"pinned": {"ranks": [1], "sharding_types": ["table_wise"]}}},
}


def _plan(args):
    """``dlrmctl plan ARGS`` through the command line's group (which reports every error)."""
    return CliRunner().invoke(cli.app, ["plan", *args])


def write_config(tmp_path, cfg=CONFIG):
    p = tmp_path / "exp.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def test_plan_command_writes_a_plan_that_loads_and_validates(tmp_path):
    cfg_path = write_config(tmp_path)
    out = tmp_path / "out" / "plan.yaml"
    r = _plan([str(cfg_path), "--gpus", "4", "--hosts", "2", "--device", "cpu",
                                          "--ddr-gb", "8", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "Rank | HBM (GB) | DDR (GB) | Perf (ms) | Input (MB) | Output (MB) | Shards" in r.output
    # the train command it suggests asks for the plan's ranks: --nproc is per node
    assert f"train with it: dlrmctl train {cfg_path} --nproc 2 --nnodes 2 --plan {out}" in r.output, r.output
    plan = ShardingPlan.load(out)
    assert (plan.world_size, plan.local_world_size) == (4, 2)
    cfg = load_config(cfg_path)
    plan.validate(resolve_tables(cfg, None), 4)
    assert {s.rank for s in plan.plan["pinned"].shards} == {1}
    report = (out.parent / "plan_report.txt").read_text()
    assert "Estimated embedding step time" in report and "Runner-up" in report
    # a second plan in the same directory gets its own report; the first one's stays
    r = _plan([str(cfg_path), "--gpus", "2", "--device", "cpu", "--out",
                                          str(out.parent / "two.yaml")])
    assert r.exit_code == 0, r.output
    assert (out.parent / "plan_report.txt").read_text() == report
    assert "Estimated embedding step time" in (out.parent / "two_report.txt").read_text()


def test_plan_command_applies_set_overrides_batch_size_and_gpu_presets(tmp_path):
    cfg_path = write_config(tmp_path)
    out = tmp_path / "plan.yaml"
    r = _plan([str(cfg_path), "--gpus", "8", "--device", "h100", "--batch-size", "65536", "--out", str(out),
         "--set", "model.embedding_dim=32", "--set", "model.dense_arch_layer_sizes=[64,32]"],
    )
    assert r.exit_code == 0, r.output
    assert "global batch 65536" in r.output and "device h100" in r.output
    plan = ShardingPlan.load(out)
    assert plan.world_size == 8
    user = plan.plan["user"]
    assert user.shards is None or sum(s.sizes[1] for s in user.shards if s.offsets[0] == 0) == 32


def test_plan_command_reports_infeasible_tables_and_exits_2(tmp_path):
    cfg = {**CONFIG, "model": {**CONFIG["model"], "tables": CONFIG["model"]["tables"] + [
        {"name": "huge", "num_embeddings": 274_352_000, "embedding_dim": 16}]}}
    cfg["model"]["embedding_dim"] = 16
    cfg_path = write_config(tmp_path, cfg)
    out = tmp_path / "plan.yaml"
    r = _plan([str(cfg_path), "--gpus", "2", "--device", "cpu", "--ddr-gb", "4",
                                          "--out", str(out)])
    assert r.exit_code == 2
    assert "table 'huge'" in r.output and "what would make it fit" in r.output
    assert not out.exists()


def test_plan_command_says_to_preprocess_when_tables_come_from_missing_data(tmp_path):
    cfg_path = write_config(tmp_path, {"data": {"path": str(tmp_path / "nodata")}})
    r = _plan([str(cfg_path), "--gpus", "2", "--out", str(tmp_path / "p.yaml")])
    assert r.exit_code == 2
    assert "dlrmctl preprocess" in r.output


def test_plan_command_rejects_inconsistent_host_counts(tmp_path):
    cfg_path = write_config(tmp_path)
    r = _plan([str(cfg_path), "--gpus", "4", "--hosts", "3"])
    assert r.exit_code == 2 and "--hosts 3 must divide --gpus 4" in r.output


def test_register_adds_plan_to_the_main_app(tmp_path):
    main = typer.Typer()

    @main.command()
    def version() -> None:
        """(another verb, so that `plan` is a subcommand)"""

    plan_cmd.register(main)
    cfg_path = write_config(tmp_path)
    out = tmp_path / "plan.yaml"
    r = CliRunner().invoke(main, ["plan", str(cfg_path), "--gpus", "2", "--device", "cpu", "--ddr-gb", "8",
                                  "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert ShardingPlan.load(out).world_size == 2


def test_plan_does_not_overwrite_without_force_and_prints_paths_one_way(tmp_path, monkeypatch):
    cfg_path = write_config(tmp_path)
    monkeypatch.chdir(tmp_path)
    args = [str(cfg_path), "--gpus", "2", "--device", "cpu", "--ddr-gb", "8"]
    r = _plan(args)
    assert r.exit_code == 0, r.output
    # by default beside the run (train.run_dir/<name>_plan.yaml), both paths relative to the cwd
    assert r.output.strip().splitlines()[-1] == ("wrote runs/plan-cli_plan.yaml and runs/plan-cli_plan_report.txt; "
                                                 "train with it: dlrmctl train exp.yaml --nproc 2 --plan "
                                                 "runs/plan-cli_plan.yaml")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp.yaml", "runs"]  # nothing in the working directory
    plan = tmp_path / "runs" / "plan-cli_plan.yaml"
    before = plan.read_text()
    r = _plan(args + ["--batch-size", "64"])
    assert r.exit_code == 2 and "plan-cli_plan.yaml: exists; pass --force" in r.output
    assert plan.read_text() == before
    r = _plan(args + ["--batch-size", "64", "--ddr-gb", "9", "--force"])
    assert r.exit_code == 0 and plan.is_file()  # a plan dlrmctl wrote is replaced
    # --force replaces only a plan / topology file dlrmctl wrote: never the config it reads, or a user's file
    plan.write_text("# my notes\n")
    r = _plan(args + ["--batch-size", "64", "--force"])
    assert r.exit_code == 2 and "is not a plan or topology file dlrmctl wrote" in r.output, r.output
    assert plan.read_text() == "# my notes\n"
    cfg_text = cfg_path.read_text()
    r = _plan(args + ["--out", str(cfg_path), "--force"])
    assert r.exit_code == 2 and "is an input of this command" in r.output, r.output
    assert cfg_path.read_text() == cfg_text


def test_plan_names_its_preset_loudly_and_reports_latency_and_why(tmp_path):
    cfg_path = write_config(tmp_path)
    r = _plan([str(cfg_path), "--gpus", "8", "--out", str(tmp_path / "p.yaml")])
    # --gpus without --device on a config whose sharding.device is cpu: refused in one line asking for --device
    # (it planned 8 CPU processes with a warning before)
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert "error: --gpus 8 without --device" in r.output and "--device a100" in r.output
    assert "--device cpu for CPU processes" in r.output and not (tmp_path / "p.yaml").exists()
    r = _plan([str(cfg_path), "--gpus", "8", "--device", "cpu",
                                          "--out", str(tmp_path / "p.yaml")])
    assert r.exit_code == 0 and "Preset: cpu (--device)" in r.output, r.output
    r = _plan([str(cfg_path), "--gpus", "8", "--set", "sharding.device=h100",
                                          "--out", str(tmp_path / "s.yaml")])
    assert r.exit_code == 0 and "Preset: h100 (sharding.device in " in r.output and "warning" not in r.output
    r = _plan([str(cfg_path), "--gpus", "8", "--device", "a100",
                                          "--out", str(tmp_path / "q.yaml")])
    assert r.exit_code == 0, r.output
    assert "Preset: a100 (--device)" in r.output and "warning" not in r.output
    assert r.output.splitlines()[0] == "Preset: a100 (--device)" and r.output.count("per rank HBM 80 GB") == 1, r.output
    step = next(line for line in r.output.splitlines() if line.startswith("Estimated embedding step time"))
    total, bw, lat = (float(x) for x in __import__("re").findall(r"([\d.]+) ms", step)[:1]
                      + __import__("re").findall(r"slowest rank\): ([\d.e-]+) ms", step)
                      + __import__("re").findall(r"latency ([\d.e-]+) ms", step))
    assert lat > 0 and total == pytest.approx(bw + lat, rel=2e-2, abs=2e-3)
    assert "kernel launches" in step and "collectives" in step
    why = next(line for line in r.output.splitlines() if line.startswith("Why this plan: "))
    assert "balance max/mean" in why and "headroom" in why and "runner-up" in why and " ms vs " in why


# ------------------------------------------------------------------ topology files, --calibrate
def _calibrated_preset():
    from dlrmctl.planner.types import DevicePreset

    return DevicePreset(
        compute_device="cpu", hbm_gb=0.0, ddr_gb=8.0, hbm_bw_gbps=0.0, ddr_bw_gbps=12.5, intra_host_bw_gbps=0.5,
        inter_host_bw_gbps=0.5, default_gpus_per_host=None, source="test", kernel_launch_us=1.5,
        collective_us=150.0, inter_host_collective_us=150.0, lookup_fixed_us=2500.0, fused_efficiency=1.2,
        dense_efficiency=1.5, bwd_compute_multiplier=12.0, dense_bwd_compute_multiplier=90.0,
        fused_bwd_id_ns=14.5,
    )


def test_calibrate_writes_a_topology_file_that_plan_and_the_config_key_load(tmp_path, monkeypatch):
    from dlrmctl.planner import calibrate as cal
    from dlrmctl.planner.planner import plan_for_config
    from dlrmctl.planner.types import Topology, load_topology_file

    # the measurements themselves are exercised by the command below in real use (30-40 s); here the
    # plumbing: file written atomically, loaded by --topology and sharding.topology_file
    monkeypatch.setattr(cal, "calibrate", lambda log: (_calibrated_preset(), {"ddr_copy_gbps": 12.5}))
    monkeypatch.chdir(tmp_path)
    topo_path = tmp_path / "topo.yaml"
    r = _plan(["--calibrate", "--out", str(topo_path)])
    assert r.exit_code == 0, r.output
    assert "wrote topo.yaml" in r.output
    assert load_topology_file(topo_path) == _calibrated_preset()
    assert [p.name for p in tmp_path.iterdir()] == ["topo.yaml"]  # no temp file left behind
    r = _plan(["--calibrate", "--out", str(topo_path)])
    assert r.exit_code == 2 and "exists; pass --force" in r.output
    r = _plan(["--calibrate", "--gpus", "2"])
    assert r.exit_code == 2 and "takes no config, --gpus" in r.output

    t = Topology.from_preset(load_topology_file(topo_path), 2, name="topo.yaml")
    assert (t.ddr_mem_bw, t.intra_host_bw, t.collective_s, t.kernel_launch_s, t.lookup_fixed_s) == (
        12.5e9, 0.5e9, pytest.approx(150e-6), pytest.approx(1.5e-6), pytest.approx(2500e-6))
    assert t.kernel_efficiency == {"fused": 1.2, "dense": 1.5} and t.bwd_compute_multiplier == 12.0
    assert t.dense_bwd_compute_multiplier == 90.0 and t.ddr_cap == int(8e9)
    assert t.fused_bwd_id_s == pytest.approx(14.5e-9)

    cfg_path = write_config(tmp_path)
    r = _plan([str(cfg_path), "--gpus", "2", "--topology", str(topo_path),
                                          "--out", str(tmp_path / "plan.yaml")])
    assert r.exit_code == 0, r.output
    # the file is named once per line, as a topology (not as a device): "topology topo.yaml (calibrated cpu)"
    # ("calibrated" only for a file --calibrate wrote: its source says so; this one's is "test")
    assert r.output.splitlines()[0] in (f"Topology (--topology): {topo_path}", "Topology (--topology): topo.yaml")
    assert "Sharding plan: 4 table(s) on 2 ranks = 1 host(s) x 2, topology topo.yaml (cpu);" in r.output
    # the hardware is described once (the report's first line), its source named once (the first line)
    assert "device topo.yaml" not in r.output and "Preset:" not in r.output and r.output.count("topo.yaml (") == 1
    assert r.output.count("; per rank ") == 1
    assert "collective 150 us" in r.output
    assert "2 sharding group(s) x 2.5e+03 us" in r.output or "sharding group(s) x 2.5e+03 us" in r.output
    r = _plan([str(cfg_path), "--gpus", "2", "--topology", str(topo_path),
                                          "--device", "h100", "--out", str(tmp_path / "p2.yaml")])
    assert r.exit_code == 2 and "--device and --topology" in r.output

    cfg = load_config(cfg_path, [f"sharding.topology_file={topo_path}"])
    plan = plan_for_config(cfg, 2)
    plan.validate(resolve_tables(cfg), 2)


def test_a_bad_topology_file_names_the_file_and_the_key(tmp_path):
    from dlrmctl.planner.types import PlanError, load_topology_file, save_topology_file

    p = tmp_path / "t.yaml"
    save_topology_file(p, _calibrated_preset())
    good = yaml.safe_load(p.read_text())
    for change, msg in [({"ddr_bw_gbps": "fast"}, "ddr_bw_gbps must be a finite number > 0"),
                        ({"colective_us": 1.0}, "unknown key(s) ['colective_us']"),
                        ({"compute_device": "tpu"}, "compute_device must be cuda or cpu")]:
        p.write_text(yaml.safe_dump({**good, **change}))
        with pytest.raises(PlanError, match="topology file .*t.yaml:\\d+: " + msg.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
            load_topology_file(p)
    p.write_text(yaml.safe_dump({k: v for k, v in good.items() if k != "intra_host_bw_gbps"}))
    with pytest.raises(PlanError, match=r"missing key\(s\) \['intra_host_bw_gbps'\]"):
        load_topology_file(p)


def test_a_topology_value_out_of_range_is_refused_before_planning(tmp_path):
    """NaN / inf anywhere, a zero bandwidth or kernel efficiency (the planner divides by them), a
    fractional or zero default_gpus_per_host: a PlanError naming the key, never a
    ZeroDivisionError / TypeError inside the planner or a plan ranked on NaN costs."""
    from dlrmctl.planner.types import PlanError, load_topology_file, save_topology_file

    p = tmp_path / "t.yaml"
    save_topology_file(p, _calibrated_preset())
    good = yaml.safe_load(p.read_text())
    bad = [("ddr_bw_gbps", float("nan")), ("collective_us", float("inf")), ("intra_host_bw_gbps", 0),
           ("inter_host_bw_gbps", 0.0), ("ddr_bw_gbps", 0), ("fused_efficiency", 0), ("dense_efficiency", -1.0),
           ("hbm_gb", float("nan")), ("default_gpus_per_host", 1.5), ("default_gpus_per_host", 0),
           ("default_gpus_per_host", True), ("source", 3)]
    for key, value in bad:
        p.write_text(yaml.safe_dump({**good, key: value}))
        with pytest.raises(PlanError, match=f"t.yaml:\\d+: {key} must be"):
            load_topology_file(p)
    # zero device bandwidth is how a CPU preset says "no HBM"; on cuda it is a divisor
    p.write_text(yaml.safe_dump({**good, "hbm_bw_gbps": 0.0}))
    assert load_topology_file(p).hbm_bw_gbps == 0.0
    p.write_text(yaml.safe_dump({**good, "compute_device": "cuda", "hbm_bw_gbps": 0.0}))
    with pytest.raises(PlanError, match="hbm_bw_gbps must be a finite number > 0"):
        load_topology_file(p)
    p.write_text(yaml.safe_dump({**good, "default_gpus_per_host": 4}))
    assert load_topology_file(p).default_gpus_per_host == 4


def test_an_out_or_report_path_that_is_a_directory_fails_before_any_work(tmp_path, monkeypatch):
    """`plan --calibrate --out DIR` (even with --force) must not measure for a minute and then die in
    os.replace; `plan --out DIR` / `--report DIR` must not die after planning.  Nothing is written."""
    from dlrmctl.planner import calibrate as cal

    measured = []
    monkeypatch.setattr(cal, "calibrate", lambda log: measured.append(1) or (_calibrated_preset(), {}))
    d = tmp_path / "dir"
    d.mkdir()
    for extra in ([], ["--force"]):
        r = _plan(["--calibrate", "--out", str(d), *extra])
        assert r.exit_code == 2 and "is a directory" in r.output, r.output
    assert measured == [] and list(d.iterdir()) == []
    # a --out in a directory that does not exist yet: made (before measuring), as plan --out does
    r = _plan(["--calibrate", "--out", str(tmp_path / "new" / "sub" / "t.yaml")])
    assert r.exit_code == 0 and (tmp_path / "new" / "sub" / "t.yaml").exists(), r.output
    measured.clear()
    cfg_path = write_config(tmp_path)
    for args in (["--out", str(d), "--force"], ["--out", str(tmp_path / "p.yaml"), "--report", str(d)]):
        r = _plan([str(cfg_path), "--gpus", "2", "--device", "cpu", *args])
        assert r.exit_code == 2 and "is a directory" in r.output, r.output
    assert list(d.iterdir()) == [] and not (tmp_path / "p.yaml").exists()
    assert not [p.name for p in tmp_path.rglob("*") if ".tmp" in p.name]


def test_a_report_in_a_directory_that_does_not_exist_yet_is_written_there(tmp_path):
    """--report new/sub/r.txt was a FileNotFoundError traceback after the plan had been written."""
    cfg_path = write_config(tmp_path)
    rep = tmp_path / "new" / "sub" / "r.txt"
    r = _plan([str(cfg_path), "--gpus", "2", "--device", "cpu", "--out",
                                          str(tmp_path / "p.yaml"), "--report", str(rep)])
    assert r.exit_code == 0, r.output
    assert "Estimated embedding step time" in rep.read_text()


@pytest.mark.parametrize("interaction", ["dot", "dcn"])
def test_plan_with_embedding_dim_auto_counts_the_real_dense_model(tmp_path, interaction):
    """`embedding_dim: auto` made the planner's dense-parameter count do ``'auto' + int`` (TypeError in
    `dlrmctl plan` and in every multi-rank `train` without a full plan).  The count now uses the
    interaction width and adds the per-table projections: it equals the built model's dense parameters."""
    from dlrmctl.config import read_data_meta
    from dlrmctl.data.synthetic import generate_synthetic
    from dlrmctl.planner.planner import count_dense_params, plan_for_config
    from dlrmctl.train.factory import build_model

    data = tmp_path / "d"
    generate_synthetic(data, rows=400, seed=1, num_embeddings=[5, 300, 40000] + [60] * 23)
    cfg = load_config(write_config(tmp_path, {
        "name": "auto", "data": {"path": str(data)},
        "model": {"embedding_dim": "auto", "embedding_dim_factor": 2.0, "dense_arch_layer_sizes": [32, 16],
                  "over_arch_layer_sizes": [16, 1], "interaction": interaction, "dcn_num_layers": 1,
                  "dcn_low_rank_dim": 8}}))
    meta = read_data_meta(cfg)
    tables = resolve_tables(cfg, meta)
    assert len({t.embedding_dim for t in tables}) > 1 and max(t.embedding_dim for t in tables) <= 16
    model = build_model(cfg, tables, len(meta["dense_features"]))
    emb = {id(p) for p in model.sparse_arch.parameters()}
    dense = sum(p.numel() for p in model.parameters() if id(p) not in emb)
    key_dims = [t.embedding_dim for t in tables for _ in t.feature_names]
    assert count_dense_params(cfg, len(key_dims), len(meta["dense_features"]), key_dims) == dense
    plan = plan_for_config(cfg, 2, meta=meta)
    plan.validate(tables, 2)
    r = _plan([str(tmp_path / "exp.yaml"), "--gpus", "2", "--device", "cpu",
                                          "--out", str(tmp_path / "p.yaml")])
    assert r.exit_code == 0, r.output


def test_a_calibrated_topology_is_named_as_one_and_a_missing_file_is_one_line(tmp_path, monkeypatch):
    """``--topology FILE`` (or sharding.topology_file): the console names ``topology FILE (calibrated cpu)``
    once per line, never ``device FILE``; a missing or unreadable file is one line with the OS error (the key
    list only for a file read with the wrong content)."""
    import dataclasses

    from dlrmctl.planner.types import save_topology_file

    monkeypatch.chdir(tmp_path)
    save_topology_file(tmp_path / "cal.yaml", dataclasses.replace(
        _calibrated_preset(), source="dlrmctl plan --calibrate on host at 2026-12-01T00:00:00 (CPU, gloo)"))
    cfg_path = write_config(tmp_path)
    r = _plan([str(cfg_path), "--gpus", "2", "--set", "sharding.topology_file=cal.yaml"])
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[0] == "Topology (sharding.topology_file in exp.yaml): cal.yaml"
    assert "on 2 ranks = 1 host(s) x 2, topology cal.yaml (calibrated cpu); per rank" in r.output
    assert r.output.count("; per rank ") == 1
    assert "on 2 ranks = 1 host(s) x 2, topology cal.yaml (calibrated cpu);" in (tmp_path / "runs" / "plan-cli_plan_report.txt").read_text()
    assert "device cal.yaml" not in r.output
    for missing in (tmp_path / "nope.yaml", tmp_path):  # no such file; a directory
        r = _plan([str(cfg_path), "--gpus", "2", "--topology", str(missing),
                                              "--out", "p2.yaml"])
        assert r.exit_code == 2
        lines = r.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {missing}: cannot read topology file: "), r.output
        assert lines[0].endswith(("No such file or directory", "Is a directory")) and "compute_device" not in lines[0]
    (tmp_path / "list.yaml").write_text("- 1\n")
    r = _plan([str(cfg_path), "--gpus", "2", "--topology", "list.yaml", "--out", "p2.yaml"])
    assert r.exit_code == 2 and "expected a mapping at the top level of the topology file (keys compute_device, " \
        in r.output


def test_the_report_says_how_many_proposals_were_scored_and_how_many_re_estimated(tmp_path):
    """The search scores N proposals; the best RERANK and the single-type plans outside them are
    re-estimated placement-aware: the line gives both counts, never "N (K of the best ...)"."""
    from types import SimpleNamespace

    from dlrmctl.planner.planner import RERANK
    from dlrmctl.planner.report import proposals_line

    def line(n, re, single):
        return proposals_line(SimpleNamespace(proposals_evaluated=n, reranked=re, reranked_single=single))

    assert line(40, RERANK + 2, 2) == (
        f"Proposals evaluated: 40 scored by the search; the best {RERANK} and the 2 single-type plan(s) outside "
        f"them ({RERANK + 2}) re-estimated with the cache hit rates of their placed shards (as evaluate_plan does)")
    assert f"; the best {RERANK} (every feasible single-type plan among them) re-estimated" in line(27, RERANK, 0)
    assert "; all 5 re-estimated" in line(5, 5, 0)
    cfg_path = write_config(tmp_path)
    r = _plan([str(cfg_path), "--gpus", "2", "--device", "h100",
                                          "--out", str(tmp_path / "plan.yaml")])
    assert r.exit_code == 0, r.output
    got = next(ln for ln in r.output.splitlines() if ln.startswith("Proposals evaluated:"))
    n = int(got.split()[2])
    assert n > RERANK and got.startswith(f"Proposals evaluated: {n} scored by the search; the best {RERANK}")
    assert "of the best and the single-type ones" not in r.output


def test_the_calibration_labels_the_measured_and_the_all_dram_fused_backward():
    """The console's fused-backward line shows the file's raw medians as measured and the all-DRAM ones
    (x dram_factor) as such, so 0.916 in the file and 1.00 on the console do not look contradictory."""
    from dlrmctl.planner.calibrate import fused_backward_line

    msg = fused_backward_line(0.916e-3, 0.5e-3, 1.0917, 13.2e-9, 1.41, 44.5e-9)
    assert "measured 0.916 / 0.500 ms (the file's fused_bwd_ms / fused_bwd_dim16_ms)" in msg
    assert "all-DRAM 1.000 / 0.546 ms (x 1.092: the table's own cache hits taken out; fitted)" in msg
    assert msg.endswith("= 13.20 ns per id + 44.50 ns per bag (2048 bags) + 1.41 x the bytes' forward")


def test_the_report_never_replaces_a_plan_or_another_file_without_force(tmp_path):
    """`--out a_report.txt` then `--out a.yaml` would write a.yaml's report over the first plan:
    refused, with --force too (a report replaces only an earlier report)."""

    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "model": {"embedding_dim": 16, "dense_arch_layer_sizes": [32, 16],
                  "tables": [{"name": "t0", "num_embeddings": 1000}, {"name": "t1", "num_embeddings": 500}]},
        "data": {"path": str(tmp_path / "none"), "batch_size": 512}}))
    run = lambda *a: _plan([str(cfg_path), "--gpus", "2", "--device", "cpu", *map(str, a)])
    r = run("--out", tmp_path / "a_report.txt")
    assert r.exit_code == 0, r.output
    first = (tmp_path / "a_report.txt").read_text()
    r = run("--out", tmp_path / "a.yaml")
    assert r.exit_code == 2 and "not a plan report" in r.output
    assert (tmp_path / "a_report.txt").read_text() == first and not (tmp_path / "a.yaml").exists()
    r = run("--out", tmp_path / "a.yaml", "--force")  # --force replaces only a report of ours, not a plan
    assert r.exit_code == 2 and "not a plan report" in r.output
    assert (tmp_path / "a_report.txt").read_text() == first and not (tmp_path / "a.yaml").exists()
    # a report replaces an earlier report of the same plan name
    assert run("--out", tmp_path / "b.yaml").exit_code == 0 and run("--out", tmp_path / "b.yaml", "--force").exit_code == 0
    r = run("--out", tmp_path / "c.yaml2", "--report", tmp_path / "c.yaml2")
    assert r.exit_code == 2 and "plan file itself" in r.output


def test_a_report_symlink_to_the_plan_file_is_refused(tmp_path):
    """A --report that is a symlink (dangling: the plan does not exist yet) or goes through a
    symlinked directory to the --out file is the plan file itself: the report would overwrite it."""

    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "model": {"embedding_dim": 16, "dense_arch_layer_sizes": [32, 16],
                  "tables": [{"name": "t0", "num_embeddings": 1000}]},
        "data": {"path": str(tmp_path / "none"), "batch_size": 512}}))
    run = lambda *a: _plan([str(cfg_path), "--gpus", "2", "--device", "cpu", *map(str, a)])
    (tmp_path / "link.txt").symlink_to(tmp_path / "p.yaml")
    r = run("--out", tmp_path / "p.yaml", "--report", tmp_path / "link.txt")
    assert r.exit_code == 2 and "plan file itself" in r.output and not (tmp_path / "p.yaml").exists()
    (tmp_path / "d").mkdir()
    (tmp_path / "d2").symlink_to(tmp_path / "d")
    r = run("--out", tmp_path / "d" / "q.yaml", "--report", tmp_path / "d2" / "q.yaml", "--force")
    assert r.exit_code == 2 and "plan file itself" in r.output


@pytest.mark.parametrize("train_device", ["cuda", "auto"])
def test_plan_of_a_cuda_trained_config_is_the_plan_train_makes_on_the_visible_gpu(tmp_path, monkeypatch, train_device):
    """A fake H200 (torch.cuda reports one): ``plan`` without --device plans for the GPU ``train`` will run
    on, as train does (its preset, its memory), says so in its first line, and writes the plan train's
    ``resolve_plan`` makes on that device."""
    import types

    import torch

    from dlrmctl.distributed.env import RunEnv
    from dlrmctl.train.plan import resolve_plan

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: types.SimpleNamespace(total_memory=141e9))
    cfg_path = write_config(tmp_path, {**CONFIG, "train": {"device": train_device}})
    out = tmp_path / "p.yaml"
    r = _plan([str(cfg_path), "--gpus", "4", "--out", str(out)])
    assert r.exit_code == 0, r.output
    first = r.output.splitlines()[0]
    assert first.startswith("Preset: h200 (the visible GPU NVIDIA H200, which train.device "
                            f"{train_device} in ") and "141.0 GB" in first, first
    cfg = load_config(cfg_path)
    trained = resolve_plan(cfg, resolve_tables(cfg, None), RunEnv(0, 4, 4, torch.device("cuda")), None)
    assert ShardingPlan.load(out).to_dict() == trained.to_dict()


def test_plan_of_a_cuda_trained_config_asks_for_device_when_no_gpu_is_visible(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg_path = write_config(tmp_path, {**CONFIG, "train": {"device": "cuda"}})
    r = _plan([str(cfg_path), "--gpus", "4", "--out", str(tmp_path / "p.yaml")])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert "trains on CUDA (train.device cuda), but no GPU is visible" in r.output and "--device a100 | h100" in r.output


def test_without_fbgemm_plan_costs_and_names_the_dense_kernel_train_runs(tmp_path, monkeypatch):
    """fbgemm_gpu unimportable (faked) on a fake H200: ``plan`` decides the kernel as the embedding
    modules do (``fused_kernel_available``), so it plans, costs and reports the dense kernel for
    every table -- the plan ``train`` makes in the same environment -- and says why."""
    import types

    import torch

    from dlrmctl import _fbgemm
    from dlrmctl.distributed.env import RunEnv
    from dlrmctl.distributed.types import ComputeKernel
    from dlrmctl.train.trainer import resolve_plan

    monkeypatch.setattr(_fbgemm, "HAS_FBGEMM", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: types.SimpleNamespace(total_memory=141e9))
    cfg_path = write_config(tmp_path, {**CONFIG, "train": {"device": "cuda"}})
    out = tmp_path / "p.yaml"
    r = _plan([str(cfg_path), "--gpus", "4", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert plan_cmd.NO_FBGEMM_LINE in r.output
    report = (tmp_path / "p_report.txt").read_text()
    assert report.startswith("Sharding plan:") and report.splitlines()[1] == plan_cmd.NO_FBGEMM_LINE
    plan = ShardingPlan.load(out)
    assert {ps.compute_kernel for ps in plan.plan.values()} == {ComputeKernel.DENSE}
    assert "fused" not in report.split(plan_cmd.NO_FBGEMM_LINE, 1)[1]
    cfg = load_config(cfg_path)
    trained = resolve_plan(cfg, resolve_tables(cfg, None), RunEnv(0, 4, 4, torch.device("cuda")), None)
    assert plan.to_dict() == trained.to_dict()
    monkeypatch.setattr(_fbgemm, "HAS_FBGEMM", True)  # with FBGEMM the same command plans the fused kernel
    r = _plan([str(cfg_path), "--gpus", "4", "--out", str(out), "--force"])
    assert r.exit_code == 0 and plan_cmd.NO_FBGEMM_LINE not in r.output, r.output
    assert ComputeKernel.FUSED in {ps.compute_kernel for ps in ShardingPlan.load(out).plan.values()}
