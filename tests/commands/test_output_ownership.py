"""``--force`` replaces only a regular file or directory that dlrmctl wrote, of the same kind, and
never the command's own input: a symbolic link, a FIFO (as a device would be), a run's
``config.yaml``, the user's YAML config or CSV, files a user added inside an export or dataset,
or a directory of other files used as a sweep are refused with one line and left as they were.
Temporaries of killed runs are reclaimed; a legal name whose temporary would exceed NAME_MAX
still writes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import yaml

from dlrmctl import outputs
from tests.conftest import one_error_line, tiny_synthetic


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_synthetic(tmp_path_factory, "own", rows=400)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_predict_force_never_replaces_a_link_a_fifo_a_config_or_a_users_file(tmp_path):
    """Checked before the model is loaded: the model directory need not even exist."""
    model, inp = tmp_path / "m", tmp_path / "in.tsv"
    inp.write_text("1\t2\n")
    cfg = tmp_path / "exp.yaml"
    cfg.write_text("name: x\n")
    mine = tmp_path / "mine.csv"
    mine.write_text("a,b\n1,2\n")
    link = tmp_path / "link.csv"
    link.symlink_to(mine)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    outputs.write_marker(run, "run")
    (run / "config.yaml").write_text("name: r\n")
    for target, why in ((link, "symbolic link"), (fifo, "FIFO"), (cfg, "is not a scores CSV"),
                        (mine, "is not a scores CSV"), (run / "config.yaml", "inside a dlrmctl run"),
                        (tmp_path, "directory")):
        one_error_line(["predict", model, "--input", inp, "--output", target, "--force"], str(target), why)
    one_error_line(["predict", model, "--input", inp, "--output", inp, "--force"], "input")
    assert mine.read_text() == "a,b\n1,2\n" and cfg.read_text() == "name: x\n" and link.is_symlink()
    assert (run / "config.yaml").read_text() == "name: r\n"
    # a scores CSV of ours: refused without --force, and the message offers --force only then
    scores = tmp_path / "scores.csv"
    scores.write_text("row,score\n1,0.5\n")
    line = one_error_line(["predict", model, "--input", inp, "--output", scores], "exists; pass --force")
    assert "scores CSV dlrmctl wrote" in line
    assert "--force" not in one_error_line(["predict", model, "--input", inp, "--output", mine]).split("; ")[0]


def test_plan_never_replaces_the_config_it_plans(tmp_path, data):
    cfg = tmp_path / "c.yaml"
    text = yaml.safe_dump({"name": "p", "data": {"path": str(data)}})
    cfg.write_text(text)
    plan = tmp_path / "plan.yaml"
    one_error_line(["plan", cfg, "--gpus", 2, "--device", "h100", "--report", cfg, "--force", "--out", plan],
                   "--report", str(cfg), "input")
    one_error_line(["plan", cfg, "--gpus", 2, "--device", "h100", "--out", cfg, "--force"], "--out", str(cfg))
    link = tmp_path / "l.yaml"
    link.symlink_to(tmp_path / "elsewhere.yaml")
    one_error_line(["plan", cfg, "--gpus", 2, "--device", "h100", "--out", link, "--force"], "symbolic link")
    assert cfg.read_text() == text and not plan.exists()


def test_preprocess_force_refuses_a_dataset_holding_files_it_did_not_write(tmp_path):
    from typer.testing import CliRunner

    from dlrmctl.cli import app

    out = tmp_path / "d"
    r = CliRunner().invoke(app, ["preprocess", "synthetic", "--rows", "300", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "meta.json" in json.loads((out / ".dlrmctl").read_text())["entries"]
    (out / "notes.txt").write_text("mine")
    one_error_line(["preprocess", "synthetic", "--rows", "300", "--out", out, "--force"],
                   str(out), "notes.txt", "did not write")
    assert (out / "notes.txt").read_text() == "mine"
    os.remove(out / "notes.txt")
    r = CliRunner().invoke(app, ["preprocess", "synthetic", "--rows", "300", "--out", str(out), "--force"])
    assert r.exit_code == 0, r.output


def test_an_export_holding_a_users_file_is_not_replaced(tmp_path):
    e = tmp_path / "e"
    e.mkdir()
    (e / "manifest.json").write_text("{}")
    outputs.finish_marker(e, "export")
    outputs.check_replaceable(e, "export", "--force", "--out another directory")  # ours, as written: replaceable
    (e / "my_eval.ipynb").write_text("{}")
    with pytest.raises(outputs.OutputError, match="my_eval.ipynb, which dlrmctl did not write"):
        outputs.check_replaceable(e, "export", "--force", "--out another directory")


def test_sweep_refuses_a_directory_dlrmctl_did_not_make(tmp_path, data):
    runs = tmp_path / "runs"
    d = runs / "mine"
    (d / "logs").mkdir(parents=True)
    (d / "sweep.csv").write_text("my,own,table\n")
    args = ["sweep", "configs/demo.yaml", "--set", f"data.path={data}", "--set", f"train.run_dir={runs}",
            "--grid", "model.dropout=0", "--name", "mine"]
    one_error_line(args, str(d), "sweep.csv", "did not write")
    assert (d / "sweep.csv").read_text() == "my,own,table\n" and not (d / ".dlrmctl").exists()


def test_a_killed_writers_temporary_is_reclaimed_and_a_live_ones_kept(tmp_path):
    out = tmp_path / "scores.csv"
    dead = outputs.temp_file(out).with_name(outputs.temp_file(out).name.rsplit("-", 1)[0] + f"-{_dead_pid()}")
    dead.write_text("row,score\n")
    live = outputs.temp_file(out).with_name(outputs.temp_file(out).name.rsplit("-", 1)[0] + f"-{os.getppid()}")
    live.write_text("row,score\n")
    other_host = tmp_path / f".scores.csv.tmp-zzzzzz-{_dead_pid()}"
    other_host.write_text("x")
    with outputs.atomic_file(out) as f:
        f.write("row,score\n")
    assert out.read_text() == "row,score\n"
    assert not dead.exists() and live.exists() and other_host.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, live.name, other_host.name])


def test_a_legal_long_name_gets_a_temporary_within_name_max(tmp_path):
    out = tmp_path / ("s" * 250 + ".csv")
    with outputs.atomic_file(out) as f:
        f.write("row,score\n")
    assert out.read_text() == "row,score\n"
    d = outputs.make_temp_dir(tmp_path / ("d" * 254), "export")
    assert d.is_dir() and len(d.name) <= 255
    assert outputs.read_marker(d)["host"] == socket.gethostname()


def test_predict_refuses_a_device_as_input_before_loading_anything(tmp_path):
    one_error_line(["predict", tmp_path / "m", "--input", "/dev/zero"], "/dev/zero", "not a regular file")


def test_preprocess_takes_a_lock_on_its_output(tmp_path):
    """Three identical preprocesses into one new directory failed two of them with raw errno lines;
    a --force racing a plain run left the other's dataset while both reported success."""
    out = tmp_path / "d"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from dlrmctl import outputs; "
                               f"outputs.lock_output({str(out)!r}); print('locked', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        one_error_line(["preprocess", "synthetic", "--rows", "300", "--out", out], str(out),
                       f"in use by a running dlrmctl (pid {holder.pid})")
        assert not out.exists()
    finally:
        holder.kill()
        holder.wait()
    from typer.testing import CliRunner

    from dlrmctl.cli import app

    r = CliRunner().invoke(app, ["preprocess", "synthetic", "--rows", "300", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # the lock file went with the lock


def test_a_directory_with_a_foreign_meta_json_is_described_as_it_is(tmp_path):
    """The refusal said "no .dlrmctl marker, no meta.json" of a directory that had a meta.json."""
    d = tmp_path / "other"
    d.mkdir()
    (d / "meta.json").write_text('{"model": "someone else\'s"}')
    (d / "weights.bin").write_bytes(b"\0")
    line = one_error_line(["preprocess", "synthetic", "--out", d, "--rows", 100],
                          f"{d}: exists and is not a dlrmctl dataset", "meta.json (not a meta.json dlrmctl wrote)",
                          "weights.bin", "no .dlrmctl marker")
    assert "no meta.json" not in line
    assert sorted(os.listdir(d)) == ["meta.json", "weights.bin"]
