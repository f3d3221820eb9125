"""Issue 14 item 1: every CLI path given an empty split, an empty file or an empty directory ends
in one `error: ...` line naming it (exit code 2), never a traceback."""

import pytest
from typer.testing import CliRunner

from dlrmctl.cli import app
from tests.conftest import one_error_line

runner = CliRunner()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run on synthetic data without a test split (test_ratio 0)."""
    from dlrmctl.data.synthetic import generate_synthetic

    root = tmp_path_factory.mktemp("empty")
    data = root / "data"
    generate_synthetic(data, rows=1500, seed=0, val_ratio=0.2, test_ratio=0.0, num_embeddings=[30] * 26)
    r = runner.invoke(app, ["train", "configs/demo.yaml", "--set", f"data.path={data}", "--set",
                            f"train.run_dir={root / 'runs'}", "--set", "name=t", "--set", "train.max_steps=2",
                            "--set", "data.batch_size=256", "--set", "train.progress=false", "--set",
                            "model.compute_kernel=dense"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return root, data, root / "runs" / "t"


def test_evaluate_on_an_empty_split_names_the_split(trained):
    _, data, run = trained
    out = one_error_line(["evaluate", run, "--split", "test"], "split 'test' has 0 rows", data / "meta.json")
    assert "val " in out  # what the directory has instead
    one_error_line(["evaluate", run, "--split", "nosuch"], "split 'nosuch': no such split")


def test_training_on_an_empty_train_or_validation_split_names_it(trained, tmp_path):
    _, data, _ = trained
    base = ["train", "configs/demo.yaml", "--set", f"data.path={data}", "--set", f"train.run_dir={tmp_path}"]
    one_error_line(base + ["--set", "data.val_split=test"], "data.val_split 'test' has 0 rows")
    one_error_line(base + ["--set", "data.train_split=test"], "data.train_split 'test' has 0 rows")
    # the same checks before any rank of a --nproc run starts
    one_error_line(base + ["--set", "data.val_split=test", "--nproc", "2"], "data.val_split 'test' has 0 rows")
    assert not any(tmp_path.iterdir())  # nothing written


def test_empty_config_file_and_empty_data_meta(tmp_path):
    (tmp_path / "empty.yaml").write_text("")
    one_error_line(["train", tmp_path / "empty.yaml"], tmp_path / "empty.yaml", "empty")
    d = tmp_path / "d"
    d.mkdir()
    (d / "meta.json").write_text("")
    one_error_line(["train", "configs/demo.yaml", "--set", f"data.path={d}", "--set", f"train.run_dir={tmp_path / 'r'}"],
                   d / "meta.json", "empty")


def test_empty_directories(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    one_error_line(["train", "configs/demo.yaml", "--set", f"data.path={empty}", "--set", f"train.run_dir={tmp_path / 'r'}"],
                   empty, "no meta.json")
    one_error_line(["evaluate", empty], empty, "not a dlrmctl run directory")
    one_error_line(["export", empty, "--int8"], empty)
    one_error_line(["report", empty], empty, "metrics.jsonl")
    one_error_line(["checkpoint", "reshard", empty, "--nproc", "1"], empty, "not a dlrmctl run directory")
    one_error_line(["predict", empty, "--input", empty], empty)
    one_error_line(["preprocess", "criteo", "--input", empty, "--out", tmp_path / "o1"], empty, "no input files")
    one_error_line(["preprocess", "movielens", "--input", empty, "--out", tmp_path / "o2"], empty)
    one_error_line(["plan", "configs/demo.yaml", "--gpus", "2", "--set", f"data.path={empty}",
                    "--out", tmp_path / "plan.yaml"], empty)


def test_empty_files(trained, tmp_path):
    _, _, run = trained
    (tmp_path / "empty.tsv").write_text("")
    one_error_line(["preprocess", "criteo", "--input", tmp_path / "empty.tsv", "--out", tmp_path / "o"],
                   tmp_path / "empty.tsv", "empty file: no lines to preprocess")
    assert not (tmp_path / "o").exists()
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.jsonl").write_text("")
    one_error_line(["report", tmp_path / "r"], tmp_path / "r" / "metrics.jsonl", "empty")


def test_predict_on_an_empty_file(trained, tmp_path):
    from dlrmctl import HAS_FBGEMM

    if not HAS_FBGEMM:
        pytest.skip("export needs fbgemm_gpu")
    _, _, run = trained
    r = runner.invoke(app, ["export", str(run), "--fp32", "--out", str(tmp_path / "m")], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    (tmp_path / "empty.tsv").write_text("\n")
    one_error_line(["predict", tmp_path / "m", "--input", tmp_path / "empty.tsv"], tmp_path / "empty.tsv",
                   "empty file")
    # the exported model on an empty split of its data
    _, data, _ = trained
    one_error_line(["evaluate", tmp_path / "m", "--data", data, "--split", "test"], "split 'test' has 0 rows")


def test_a_bad_topology_file_fails_before_any_rank_starts(trained, tmp_path):
    """sharding.topology_file is read by the trainer's planner on rank 0 after the launch: the
    launcher checks it first (one error line naming the file and the key), for --nproc and for
    sharding.force, and writes nothing."""
    _, data, _ = trained
    base = ["train", "configs/demo.yaml", "--set", f"data.path={data}", "--set", f"train.run_dir={tmp_path / 'r'}"]
    bad = tmp_path / "topo.yaml"
    bad.write_text("compute_device: cpu\nsource: x\nddr_gb: 8\nddr_bw_gbps: 10\nintra_host_bw_gbps: 1\n"
                   "inter_host_bw_gbps: 1\nhbm_gb: 0\nhbm_bw_gbps: 0\ndefault_gpus_per_host: null\n"
                   "output_dist_bw_gbps: 0\n")
    one_error_line(base + ["--set", f"sharding.topology_file={bad}", "--nproc", "2"], bad, "output_dist_bw_gbps")
    one_error_line(base + ["--set", f"sharding.topology_file={tmp_path / 'missing.yaml'}", "--set",
                           "sharding.force=true"], tmp_path / "missing.yaml")
    # no topology file: the device preset (and its hbm_gb / ddr_gb) the planner would build
    one_error_line(base + ["--set", "sharding.device=tpu9", "--nproc", "2"], "sharding.device", "tpu9")
    assert not (tmp_path / "r").exists()
