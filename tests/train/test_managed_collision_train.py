"""Training with managed-collision tables on raw Criteo ids: evictions happen, the remapper state is
in the checkpoint, and a run interrupted and resumed equals one that was not (losses, remappers,
tables), with the fused and the dense kernel."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from dlrmctl.cli import app
from tests.helpers.raw_ids import write_zipf_criteo_lines

runner = CliRunner()


def invoke(*args):
    r = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.output


@pytest.fixture(scope="module")
def raw_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("mc")
    write_zipf_criteo_lines(d / "t.tsv", 1200, 1.2, seed=0)
    invoke("preprocess", "criteo", "-i", d / "t.tsv", "-o", d / "data", "--raw-ids", "--val-ratio", "0.1", "-q")
    return d


def _train(raw_data, runs, steps, kernel, *extra):
    return invoke("train", os.path.join(os.path.dirname(__file__), "..", "..", "configs", "demo.yaml"),
                  "--set", f"data.path={raw_data / 'data'}", "--set", f"train.run_dir={runs}", "--set", "name=mc",
                  "--set", "data.batch_size=32", "--set", "model.embedding_dim=8",
                  "--set", "model.dense_arch_layer_sizes=[16, 8]", "--set", "model.over_arch_layer_sizes=[8, 1]",
                  "--set", "model.managed_collision.size=64", "--set", "model.managed_collision.eviction=lfu",
                  "--set", f"model.compute_kernel={kernel}", "--set", "train.log_every=1",
                  "--set", "train.checkpoint_every=4", "--set", "train.eval_every=0", "--set", "train.progress=false",
                  "--set", f"train.max_steps={steps}", *extra)


def _mc_state(run):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    p = os.path.join(run, "checkpoints", sorted(x for x in os.listdir(os.path.join(run, "checkpoints"))
                                                if x.startswith("step_"))[-1])
    md = FileSystemReader(p).read_metadata()
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
          if (k.startswith("mc/") or k.startswith("emb")) and hasattr(m, "size")}
    dcp.load(sd, checkpoint_id=p)
    return sd


def _losses(run):
    return {r["step"]: r["loss"] for r in map(json.loads, open(os.path.join(run, "metrics.jsonl"))) if r["kind"] == "train"}


@pytest.mark.parametrize("kernel", ["fused", "dense"])
def test_resume_mid_run_equals_an_uninterrupted_run_with_evictions(raw_data, tmp_path, kernel):
    from dlrmctl import HAS_FBGEMM

    if kernel == "fused" and not HAS_FBGEMM:
        pytest.skip("fbgemm_gpu is not installed")
    _train(raw_data, tmp_path / "a", 16, kernel)
    _train(raw_data, tmp_path / "b", 8, kernel)
    _train(raw_data, tmp_path / "b", 16, kernel, "--resume")
    a, b = _mc_state(tmp_path / "a" / "mc"), _mc_state(tmp_path / "b" / "mc")
    mc = [k for k in a if k.startswith("mc/")]
    assert mc and set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert _losses(tmp_path / "a" / "mc") == _losses(tmp_path / "b" / "mc")
    # 1,200 Zipf rows: many more distinct ids than 64 rows, so rows were evicted and re-used
    held = a["mc/t_C1.row_ids"][:64]
    assert int((held != (1 << 63) - 1).sum()) == 64 and int(a["mc/t_C1.step"]) == 16


def test_evaluate_and_the_exported_program_score_raw_ids_as_the_trained_model(raw_data, tmp_path):
    """The run's remappers are reloaded by `evaluate` (same AUC as training's last evaluation) and
    frozen into the .pt2 program: raw ids, held or never seen (-> the default row), score as the
    trained model does (1e-6)."""
    from dlrmctl.sparse.jagged_tensor import KeyedJaggedTensor
    from dlrmctl.train.reload import load_trained_model

    _train(raw_data, tmp_path, 12, "dense", "--set", "train.eval_every=12")
    run = tmp_path / "mc"
    last = [json.loads(x) for x in open(run / "metrics.jsonl") if '"eval"' in x][-1]
    out = invoke("evaluate", run, "--split", "val")
    assert f"{last['auc']:.6f}" in out
    invoke("export", run, "--fp32", "--out", tmp_path / "exp")
    manifest = json.loads((tmp_path / "exp" / "manifest.json").read_text())
    assert {t["ids"] for t in manifest["tables"]} == {"raw"}  # serve takes raw ids as tensors for these
    program = torch.export.load(str(tmp_path / "exp" / "model.pt2")).module()
    cfg, model, meta = load_trained_model(str(run))
    feats = [f["name"] for f in meta["sparse_features"]]
    mc = model.sparse_arch.managed_collision
    held = mc.remappers["t_C1"].sorted_ids[: mc.remappers["t_C1"].held()]
    B = 6
    rng = np.random.default_rng(3)
    ids = torch.from_numpy(rng.choice(held.numpy(), (len(feats), B)))
    ids[:, :2] = torch.tensor([123456789, 987654321])  # never seen: the default row
    dense = torch.from_numpy(rng.random((B, 13)).astype(np.float32))
    lengths = torch.ones(len(feats) * B, dtype=torch.int64)
    kjt = KeyedJaggedTensor(feats, ids.reshape(-1), lengths=lengths)
    with torch.no_grad():
        want = model(dense, kjt).reshape(-1)
        _, got = program(dense, ids.reshape(-1), lengths)
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    assert mc.remappers["t_C1"](torch.tensor([123456789])).item() == 64  # the default row


def _raw_id_batch(model, feats, B=6):
    """Raw ids the remapper holds plus two never seen (-> the default row), and dense inputs."""
    mc = model.sparse_arch.managed_collision
    held = mc.remappers["t_C1"].sorted_ids[: mc.remappers["t_C1"].held()]
    rng = np.random.default_rng(3)
    ids = torch.from_numpy(rng.choice(held.numpy(), (len(feats), B)))
    ids[:, :2] = torch.tensor([123456789, 987654321])
    dense = torch.from_numpy(rng.random((B, 13)).astype(np.float32))
    return dense, ids.reshape(-1), torch.ones(len(feats) * B, dtype=torch.int64)


def _predict_scores(model_dir, lines, out, *extra):
    invoke("predict", model_dir, "--input", lines, "--output", out, *extra)
    return np.array([float(r.split(",")[-1]) for r in out.read_text().splitlines()[1:]])


def test_torchscript_artifact_scores_raw_ids_as_the_pt2_program_and_the_trained_model(raw_data, tmp_path):
    """`export --torchscript` of a managed-collision model carries the program's remap step: raw
    ids, held or never seen (-> the default row), score as the trained model and the .pt2 program
    (1e-6 at fp32), through the module and through `predict --artifact torchscript`."""
    from dlrmctl import HAS_FBGEMM
    from dlrmctl.inference.export import load_exported
    from dlrmctl.sparse.jagged_tensor import KeyedJaggedTensor
    from dlrmctl.train.reload import load_trained_model

    if not HAS_FBGEMM:
        pytest.skip("--torchscript needs fbgemm_gpu")
    _train(raw_data, tmp_path, 12, "dense")
    run = tmp_path / "mc"
    invoke("export", run, "--fp32", "--out", tmp_path / "pt2")
    invoke("export", run, "--fp32", "--torchscript", "--out", tmp_path / "ts")
    manifest = json.loads((tmp_path / "ts" / "manifest.json").read_text())
    assert manifest["artifact"] == "torchscript" and {t["ids"] for t in manifest["tables"]} == {"raw"}
    _, model, meta = load_trained_model(str(run))
    feats = [f["name"] for f in meta["sparse_features"]]
    dense, values, lengths = _raw_id_batch(model, feats)
    with torch.no_grad():
        want = model(dense, KeyedJaggedTensor(feats, values, lengths=lengths)).reshape(-1)
    ts, pt2 = load_exported(tmp_path / "ts"), load_exported(tmp_path / "pt2")
    assert ts.artifact == "torchscript" and isinstance(ts.module, torch.jit.ScriptModule)
    got_ts, got_pt2 = ts.logits(dense, values, lengths), pt2.logits(dense, values, lengths)
    assert torch.allclose(got_ts, want, atol=1e-6, rtol=0) and torch.allclose(got_pt2, want, atol=1e-6, rtol=0)
    unseen = torch.full((len(feats),), 123456789, dtype=torch.int64)  # never seen: each table's default row
    assert ts.module.remap(unseen, torch.ones(len(feats), dtype=torch.int64), 1).tolist() == [64] * len(feats)
    # raw Criteo lines (hashed as --raw-ids did), many of them never seen by the 64-row remapper
    lines = tmp_path / "lines.tsv"
    lines.write_text("".join((raw_data / "t.tsv").read_text().splitlines(keepends=True)[:200]))
    s_ts = _predict_scores(tmp_path / "ts", lines, tmp_path / "ts.csv")
    s_pt2 = _predict_scores(tmp_path / "pt2", lines, tmp_path / "pt2.csv")
    assert len(s_ts) == 200 and np.allclose(s_ts, s_pt2, atol=1e-6, rtol=0)


@pytest.mark.slow  # one AOTInductor compile (tens of CPU-seconds)
def test_aot_package_scores_raw_ids_as_the_trained_model(raw_data, tmp_path):
    """`export --aot` compiles the .pt2 program with its remap step: the AOTInductor package
    scores raw ids, held or never seen, as the trained model (1e-6 at fp32)."""
    from dlrmctl.inference.export import load_exported
    from dlrmctl.sparse.jagged_tensor import KeyedJaggedTensor
    from dlrmctl.train.reload import load_trained_model

    _train(raw_data, tmp_path, 12, "dense")
    run = tmp_path / "mc"
    invoke("export", run, "--fp32", "--aot", "--out", tmp_path / "aot")
    _, model, meta = load_trained_model(str(run))
    feats = [f["name"] for f in meta["sparse_features"]]
    dense, values, lengths = _raw_id_batch(model, feats)
    with torch.no_grad():
        want = model(dense, KeyedJaggedTensor(feats, values, lengths=lengths)).reshape(-1)
    aoti = load_exported(tmp_path / "aot")
    assert aoti.runner == "aoti"
    assert torch.allclose(aoti.logits(dense, values, lengths), want, atol=1e-6, rtol=0)


def test_init_from_starts_a_new_run_at_step_0_with_the_source_weights_optimizer_state_and_remappers(raw_data, tmp_path):
    from dlrmctl.config import load_config
    from dlrmctl.distributed.env import RunEnv
    from dlrmctl.train.checkpoint import local_embedding_shards, managed_collision_state
    from dlrmctl.train.init_from import resolve_init_from
    from dlrmctl.train.run_dir import prepare_run_dir
    from dlrmctl.train.trainer import Trainer

    _train(raw_data, tmp_path / "a", 8, "dense")
    src = resolve_init_from(str(tmp_path / "a" / "mc"))
    assert src.endswith("step_00000008")
    cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "demo.yaml"), [
        f"data.path={raw_data / 'data'}", f"train.run_dir={tmp_path / 'b'}", "name=day1", "data.batch_size=32",
        "model.embedding_dim=8", "model.dense_arch_layer_sizes=[16, 8]", "model.over_arch_layer_sizes=[8, 1]",
        "model.managed_collision.size=64", "model.compute_kernel=dense", "train.progress=false"])
    run_dir = prepare_run_dir(cfg, resume=False, overwrite=False)
    t = Trainer(cfg, RunEnv(), run_dir, init_from=src)
    a = _mc_state(tmp_path / "a" / "mc")
    assert t.step == 0 and t._batches_done == 0
    for k, v in managed_collision_state(t.model).items():
        assert torch.equal(v, a[k]), k
    for name, _, _, w, states in local_embedding_shards(t.model, t.optimizers.embedding_dense):
        assert torch.equal(w.detach(), a[f"emb/{name}/weight"]), name
        assert states and all(s.abs().sum() > 0 for s in states)  # Adagrad sums came along
    rec = json.loads(open(os.path.join(run_dir, "init_from.json")).read())
    assert rec["step"] == 8 and rec["run"] == "mc" and rec["checkpoint"] == os.path.abspath(src)


def test_init_from_a_run_whose_tables_differ_is_one_line_naming_the_table(raw_data, tmp_path):
    _train(raw_data, tmp_path / "a", 4, "dense")
    r = runner.invoke(app, ["train", os.path.join(os.path.dirname(__file__), "..", "..", "configs", "demo.yaml"),
                            "--set", f"data.path={raw_data / 'data'}", "--set", f"train.run_dir={tmp_path / 'b'}",
                            "--set", "model.managed_collision.size=128", "--set", "data.batch_size=32",
                            "--set", "model.embedding_dim=8", "--set", "model.dense_arch_layer_sizes=[16, 8]",
                            "--set", "model.over_arch_layer_sizes=[8, 1]", "--set", "model.compute_kernel=dense",
                            "--init-from", str(tmp_path / "a" / "mc")])
    assert r.exit_code == 2, r.output
    assert "error: --init-from:" in r.output and "table 't_C1' was saved as 65 x 8" in r.output
    r = runner.invoke(app, ["train", "configs/demo.yaml", "--init-from", str(tmp_path), "--resume"])
    assert r.exit_code == 2 and "--init-from starts a new run and --resume continues one" in r.output
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "manifest.json").write_text("{}")  # an export: no optimizer state, no step
    r = runner.invoke(app, ["train", "configs/demo.yaml", "--init-from", str(tmp_path / "export")])
    assert r.exit_code == 2 and "an exported model (manifest.json), not a checkpoint" in r.output, r.output


def test_remapping_adds_no_host_sync_per_step(tmp_path):
    """The same single-process run on the same rows, raw ids through managed-collision tables vs
    modulo index ids in plain tables: the same host reads per step (none added by the remap)."""
    from dlrmctl.config import config_from_dict
    from dlrmctl.data.drifting import DriftOptions, generate_drifting_day
    from dlrmctl.distributed.env import RunEnv
    from dlrmctl.train.trainer import Trainer
    from tests.train.test_host_sync import SyncCounter

    def syncs_per_step(tr, counter):  # host reads from the start of each step to the next (no eval, no saves)
        marks, step = [], tr.run_step
        tr.run_step = lambda *a, **kw: (marks.append(counter.total), step(*a, **kw))[1]
        with counter:
            counter.active = True
            tr.train()
            marks.append(counter.total)
        return [b - a for a, b in zip(marks, marks[1:])]

    per = {}
    for kind, modulo in (("raw", None), ("mod", 300)):
        data = tmp_path / kind
        generate_drifting_day(data, 0, DriftOptions(rows=3000, features=3, signal=2, alive=200, modulo=modulo))
        cfg = config_from_dict({
            "name": kind, "data": {"path": str(data), "batch_size": 64},
            "model": {"embedding_dim": 8, "dense_arch_layer_sizes": [16, 8], "over_arch_layer_sizes": [8, 1],
                      "managed_collision": {"size": 300}},
            "train": {"max_steps": 12, "log_every": 6, "run_dir": str(tmp_path / "runs"), "progress": False,
                      "eval_every": 0, "checkpoint_every": 0}})
        run = tmp_path / "runs" / kind
        run.mkdir(parents=True)
        tr = Trainer(cfg, RunEnv(), str(run))
        assert (tr.model.sparse_arch.managed_collision is not None) == (kind == "raw")
        counter = SyncCounter("cpu")
        per[kind] = (syncs_per_step(tr, counter), counter.calls)
    assert per["raw"][0] == per["mod"][0], per
