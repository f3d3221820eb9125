"""Ordinary mistakes in the input are one ``error: ...`` line on stderr naming the thing, exit code 2,
never a traceback (issue 23, group E): numeric options of every command, configs (bounds, duplicate
keys, binary files), plan/topology/metrics/LATEST files, the device, memory."""

from __future__ import annotations

import math

import pytest
import yaml
from typer.testing import CliRunner

from dlrmctl.cli import app
from tests.conftest import one_error_line, tiny_synthetic

runner = CliRunner()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_synthetic(tmp_path_factory, "input_checks", rows=600)


def small_config(tmp_path, data, **over):
    cfg = {"name": "chk", "data": {"path": str(data), "batch_size": 64},
           "model": {"embedding_dim": 8, "dense_arch_layer_sizes": [16, 8], "over_arch_layer_sizes": [8, 1]},
           "train": {"max_steps": 2, "progress": False, "run_dir": str(tmp_path / "runs")}}
    for k, v in over.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


# ------------------------------------------------------------------ plan
@pytest.mark.parametrize("option,value", [("--gpus", "0"), ("--gpus", "-3"), ("--hosts", "0"),
                                          ("--gpus-per-host", "-2"), ("--hbm-gb", "-1"), ("--hbm-gb", "nan"),
                                          ("--hbm-gb", "inf"), ("--ddr-gb", "0"), ("--ddr-gb", "-inf"),
                                          ("--batch-size", "0"), ("--batch-size", "-1"),
                                          ("--batch-size", str(10**9))])
def test_plan_refuses_a_numeric_option_that_is_not_positive_and_finite(tmp_path, data, option, value):
    """--hbm-gb -1 (and --ddr-gb, --gpus 0, NaN / inf) were accepted and planned for."""
    cfg = small_config(tmp_path, data)
    args = ["plan", cfg, "--device", "h100", "--out", tmp_path / "p.yaml"]
    if option != "--gpus":
        args += ["--gpus", "2"]
    out = one_error_line(args + [option, value], option, "must be a finite number > 0")
    assert value.lstrip("-") in out.lower() or value == str(10**9)
    assert not (tmp_path / "p.yaml").exists()


def test_plan_with_gpus_but_no_device_asks_for_one_when_the_config_plans_cpu(tmp_path, data):
    """`plan CONFIG --gpus 8` (no --device) planned 8 CPU processes and, failing, advised more cpu ranks."""
    cfg = small_config(tmp_path, data)
    one_error_line(["plan", cfg, "--gpus", "8", "--out", tmp_path / "p.yaml"], "--gpus 8 without --device",
                   "sharding.device 'cpu'", "--device a100 | h100 | h200", "--device cpu")
    r = runner.invoke(app, ["plan", str(cfg), "--gpus", "8", "--device", "cpu", "--out", str(tmp_path / "p.yaml")])
    assert r.exit_code == 0, r.output


def test_a_plan_that_does_not_fit_is_short_and_names_the_defaulted_device(tmp_path, data):
    """The failure for many tables that cannot be placed was a full explanation per table (39 lines for
    DLRMv2); now the largest is explained and the rest listed on one line, and a device that came from
    the config is named with the --device hint."""
    tables = [{"name": f"big{i}", "num_embeddings": 4_000_000_000 + i, "feature_names": [f"C{i + 1}"]}
              for i in range(6)]
    cfg = small_config(tmp_path, data, model={"tables": tables}, sharding={"device": "a100"})
    r = runner.invoke(app, ["plan", str(cfg), "--gpus", "2", "--out", str(tmp_path / "p.yaml")])
    out = r.output.strip()
    assert r.exit_code == 2 and "Traceback" not in out and out.startswith("error: table 'big5'"), out
    assert out.count("what would make it fit") == 1 and "5 more table(s) cannot be placed" in out, out
    assert "'big0'" in out and len(out.splitlines()) <= 12, out
    assert "planned for the 'a100' preset of sharding.device in " in out and "--device a100 | h100 | h200" in out
    assert not (tmp_path / "p.yaml").exists()
    r = runner.invoke(app, ["plan", str(cfg), "--gpus", "2", "--device", "a100", "--out", str(tmp_path / "p.yaml")])
    assert r.exit_code == 2 and "planned for" not in r.output  # --device given: no hint


def test_topology_file_errors_name_file_and_line(tmp_path, data, monkeypatch):
    from dlrmctl.planner.types import DEVICE_PRESETS

    import dataclasses

    # an earlier plan in the working directory (the README's workflow leaves one): the inputs' errors
    # come first, not "plan.yaml exists" (the run ended on that line before the bad input was named)
    config = small_config(tmp_path, data)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.yaml").write_text("plan: {}\n")

    d = dataclasses.asdict(DEVICE_PRESETS["h100"])
    d["hbm_gb"] = -1.0
    topo = tmp_path / "topo.yaml"
    topo.write_text(yaml.safe_dump(d, sort_keys=False))
    line = next(i for i, s in enumerate(topo.read_text().splitlines(), 1) if s.startswith("hbm_gb:"))
    one_error_line(["plan", config, "--gpus", "2", "--topology", topo],
                   f"topo.yaml:{line}: hbm_gb must be a finite number >= 0")
    one_error_line(["plan", config, "--gpus", "2", "--device", "h101"], "h101")
    topo.write_text(topo.read_text() + "hbm_gb: 80\n")
    one_error_line(["plan", config, "--gpus", "2", "--topology", topo],
                   "topo.yaml:", "duplicate key 'hbm_gb' in topology file", f"first given on line {line}")


# ------------------------------------------------------------------ YAML files
def test_a_duplicate_key_in_a_config_names_file_line_and_key(tmp_path, data):
    """A key given twice silently took the last value."""
    cfg = tmp_path / "dup.yaml"
    cfg.write_text(f"name: dup\ndata:\n  path: {data}\n  batch_size: 64\n  batch_size: 128\n")
    for verb in (["plan", cfg, "--gpus", "2", "--device", "cpu"], ["train", cfg]):
        one_error_line(verb, "dup.yaml:5: duplicate key 'batch_size' in config", "first given on line 4")
    one_error_line(["train", small_config(tmp_path, data), "--set", "model.tables=[{name: a, name: b}]"],
                   "--set model.tables", "duplicate key 'name'")


def test_a_duplicate_key_in_a_plan_file_names_file_line_and_key(tmp_path, data):
    plan = tmp_path / "plan.yaml"
    plan.write_text("world_size: 2\nworld_size: 4\ntables: {}\n")
    one_error_line(["train", small_config(tmp_path, data), "--nproc", "2", "--plan", plan],
                   "plan.yaml:2: duplicate key 'world_size' in plan")


@pytest.mark.parametrize("content", [b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", b"name: x\n\x00\x01\x02\x03"])
def test_a_binary_config_file_is_one_line_naming_it(tmp_path, content):
    cfg = tmp_path / "model.bin"
    cfg.write_bytes(content)
    # a dry run of launch reads and validates the config as train does
    for verb in (["train", cfg], ["plan", cfg, "--gpus", "2", "--device", "cpu"], ["launch", cfg, "--dry-run"]):
        one_error_line(verb, "model.bin:", "a config is a YAML text file")


# ------------------------------------------------------------------ config bounds
@pytest.mark.parametrize("key,value,limit", [
    ("data.batch_size", 10**23, "16,777,216"), ("data.eval_batch_size", 2**40, "16,777,216"),
    ("model.embedding_dim", 10**6, "16,384"), ("model.dense_arch_layer_sizes", f"[{10**9}, 8]", "65,536"),
    ("train.max_steps", 10**20, "9,223,372,036,854,775,807"), ("data.prefetch", 10**7, "1,024"),
])
def test_an_integer_config_key_beyond_its_bound_is_refused_naming_key_and_limit(tmp_path, data, key, value, limit):
    """batch_size 10**23 was accepted (and overflowed int64 later)."""
    one_error_line(["train", small_config(tmp_path, data), "--set", f"{key}={value}"], key, limit, "beyond the limit")


def test_a_non_finite_float_key_is_refused(tmp_path, data):
    one_error_line(["train", small_config(tmp_path, data), "--set", "train.progress_every_s=.inf"],
                   "train.progress_every_s: must be a finite number")
    one_error_line(["plan", small_config(tmp_path, data), "--gpus", "2", "--device", "h100", "--set",
                    "sharding.hbm_gb=-1"], "sharding.hbm_gb: must be > 0")


# ------------------------------------------------------------------ train
def test_train_device_cuda_without_cuda_is_one_line(tmp_path, data):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    one_error_line(["train", small_config(tmp_path, data), "--set", "train.device=cuda"], "train.device=cuda",
                   f"torch {torch.__version__}", "train.device=cpu")


def test_a_table_larger_than_memory_in_one_process_is_refused_before_allocating(tmp_path, data):
    """num_embeddings 10**12 in single-process train: plan explained it, train was a traceback from the allocator."""
    tables = [{"name": "huge", "num_embeddings": 10**12, "feature_names": ["C1"]}]
    cfg = small_config(tmp_path, data, model={"tables": tables}, train={"device": "cpu"})
    out = one_error_line(["train", cfg], "'huge'", "1,000,000,000,000 rows", "--nproc")
    assert "host memory" in out and "GiB" in out


# ------------------------------------------------------------------ evaluate, launch, report, LATEST
@pytest.mark.parametrize("value", ["0", "-1", str(10**9)])
def test_evaluate_refuses_a_batch_size_that_is_not_positive(tmp_path, value):
    """--batch-size 0 silently used the default; -1 reached the loader."""
    one_error_line(["evaluate", tmp_path, "--batch-size", value], "--batch-size", "must be a finite number > 0")


def test_a_binary_latest_file_is_one_line_naming_it(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")
    (run / "checkpoints" / "LATEST").write_bytes(b"\xff\xd8\xff\xe0\x00\x10JFIF")
    one_error_line(["evaluate", run], "LATEST", "expected one line naming a checkpoint", "binary data")
    (run / "config.yaml").write_bytes(b"\xff\xfe\x00n")  # the run's recorded config, binary
    one_error_line(["evaluate", run], "config.yaml:1: not UTF-8 text")


def test_launch_with_an_unknown_scheduler_lists_the_schedulers(tmp_path):
    one_error_line(["launch", "configs/demo.yaml", "--scheduler", "bogus", "--dry-run"], "--scheduler 'bogus'",
                   "local_cwd", "slurm", "kubernetes")
    one_error_line(["launch", "configs/demo.yaml", "--nnodes", "0", "--dry-run"], "--nnodes")
    one_error_line(["launch", "configs/demo.yaml", "--gpus-per-proc", "-1", "--dry-run"], "--gpus-per-proc")
    one_error_line(["launch", "configs/demo.yaml", "--scheduler-arg", "queue", "--dry-run", "--gpus-per-proc", "0"],
                   "--scheduler-arg 'queue'", "KEY=VALUE")


@pytest.mark.parametrize("lines,where,what", [
    ('{"step": 1, "loss": 0.5}\n[1, 2]\n', ":2:", "expected a JSON object"),
    ('{"kind": "eval", "step": "x", "auc": 0.7}\n', ":1:", "'step' must be an integer"),
    ('{"step": 1, "loss": "low"}\n', ":1:", "'loss' must be a number"),
    ('{"step": 1}\n{"step": 2\n', ":2:", "not JSON"),
])
def test_report_names_the_metrics_file_and_line(tmp_path, lines, where, what):
    (tmp_path / "metrics.jsonl").write_text(lines)
    one_error_line(["report", tmp_path, "--no-plots"], f"metrics.jsonl{where}", what)


def test_sweep_jobs_must_be_positive(tmp_path):
    one_error_line(["sweep", "configs/demo.yaml", "--grid", "model.dropout=0", "--jobs", "0"], "--jobs")


def test_merge_keys_are_not_duplicates():
    from dlrmctl.yaml_file import load_yaml_text

    assert load_yaml_text("a: &x {b: 1}\nc:\n  <<: *x\n  d: 2\n") == {"a": {"b": 1}, "c": {"b": 1, "d": 2}}
    assert math.isinf(load_yaml_text("v: .inf")["v"])
