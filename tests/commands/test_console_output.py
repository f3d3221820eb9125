"""Issue 14 items 3, 7, 9: progress (a bar on a terminal with messages above it, periodic lines
otherwise, with step, samples/s and the latest loss read with its step), epochs numbered from 1
everywhere, and the last progress line printed before the epoch summary."""

import json
import re

import pytest
from typer.testing import CliRunner

from dlrmctl import console
from dlrmctl.cli import app


def test_progress_lines_without_a_terminal(capsys, monkeypatch):
    now = [0.0]
    monkeypatch.setattr(console.time, "perf_counter", lambda: now[0])
    p = console.Progress(10, "epoch 1/2", "step", every_s=3.0, bar=False)
    for i in range(10):
        now[0] = i + 1.0  # each step takes a (fake) second
        p.update(1, **{"samples/s": "1,000", "loss": f"0.{50 - i} (step {i + 1})"})
    p.close()
    lines = capsys.readouterr().out.strip().splitlines()
    # one line every 3 (fake) seconds, then the last one on close
    assert len(lines) == 4, lines
    assert re.fullmatch(r"epoch 1/2: step 3/10 \(30%\)  1,000 samples/s  loss 0\.48 \(step 3\)  3s elapsed, ~7s left",
                        lines[0]), lines[0]
    assert lines[-1].startswith("epoch 1/2: step 10/10 (100%)") and "left" not in lines[-1]


def test_messages_go_above_an_open_bar(monkeypatch):
    import tqdm

    written = []
    monkeypatch.setattr(tqdm.tqdm, "write", classmethod(lambda cls, s, file=None, **k: written.append(s)))
    p = console.Progress(5, "epoch 1/1", bar=True)
    console.echo("[eval] step 5 val: AUC 0.7")
    p.close()
    console.echo("after")  # no bar open: a plain print
    assert written == ["[eval] step 5 val: AUC 0.7"]


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    from dlrmctl.data.synthetic import generate_synthetic

    d = tmp_path_factory.mktemp("syn")
    generate_synthetic(d, rows=3000, seed=0, num_embeddings=[40] * 26)
    return d


def test_epochs_are_numbered_from_1_everywhere(small_data, tmp_path):
    args = ["train", "configs/demo.yaml", "--set", f"data.path={small_data}", "--set", f"train.run_dir={tmp_path}",
            "--set", "name=ep", "--set", "train.epochs=2", "--set", "data.batch_size=600", "--set", "train.log_every=2",
            "--set", "train.progress_every_s=0", "--set", "model.compute_kernel=dense", "--set", "train.eval_every=3"]
    r = CliRunner().invoke(app, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    out = r.output.splitlines()
    train_rows = json.load(open(small_data / "meta.json"))["splits"]["train"]["rows"]
    steps = -(-train_rows // 600)
    # console: "epoch e/E" for progress and summary, "[epoch e]" for the end-of-epoch evaluation
    summary = [i for i, line in enumerate(out) if re.match(r"epoch \d/2: \d+ steps", line)]
    assert [out[i].split(":")[0] for i in summary] == ["epoch 1/2", "epoch 2/2"]
    for i, e in zip(summary, (1, 2)):
        # the epoch's last progress line comes right before its summary (one stream, in order)
        assert out[i - 1].startswith(f"epoch {e}/2: step {e * steps}/{e * steps} (100%)"), out[i - 1]
        assert re.search(rf"loss \d\.\d{{4}} \(step {e * steps}\)", out[i - 1]), out[i - 1]
        assert out[i + 1].startswith(f"[epoch {e}] step {e * steps} val:"), out[i + 1]
    assert "epoch 0" not in r.output
    # metrics.jsonl: a step's records carry the epoch it belongs to, numbered the same way
    recs = [json.loads(x) for x in open(tmp_path / "ep" / "metrics.jsonl")]
    for rec in recs:
        assert rec["epoch"] == (rec["step"] - 1) // steps + 1, rec
    assert {rec["epoch"] for rec in recs if rec["kind"] == "eval"} == {1, 2}
    rep = CliRunner().invoke(app, ["report", str(tmp_path / "ep"), "--no-plots"], catch_exceptions=False)
    assert f"| {steps} | 1 |" in rep.output and f"| {2 * steps} | 2 |" in rep.output


def test_export_says_each_step_with_its_elapsed_seconds_before_its_summary(small_data, tmp_path, capsys):
    """`export` is never silent for the minutes tracing and --aot's compile take: a line per step,
    ``[export] <seconds> s <step>``, in order, the seconds never decreasing, then the summary."""
    run = ["train", "configs/demo.yaml", "--set", f"data.path={small_data}", "--set", f"train.run_dir={tmp_path}",
           "--set", "name=x", "--set", "train.max_steps=2", "--set", "data.batch_size=600",
           "--set", "train.progress=false", "--set", "model.compute_kernel=dense"]
    r = CliRunner().invoke(app, run, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["export", str(tmp_path / "x"), "--fp32", "--out", str(tmp_path / "m")],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    staged = [m for m in (re.fullmatch(r"\[export\] (\d+\.\d) s (.+)", line) for line in lines) if m]
    steps = [f"exporting {tmp_path / 'x'}, checkpoint best, fp32 embeddings, to "
             f"{tmp_path / 'm'}", f"checking the files export reads from {small_data} (SHA-256)",
             f"reading the checkpoint {tmp_path / 'x' / 'checkpoints'}", "reading and quantizing 26 tables to fp32",
             "tracing the program", "writing model.pt2",
             "parity report: latency, then the artifact against the float model",
             "latency at batch 1", "latency at batch 64", "latency at batch 4,096", "done"]
    assert len(staged) == len(steps) and all(m[2].startswith(w) for m, w in zip(staged, steps)), lines
    secs = [float(m[1]) for m in staged]
    assert secs == sorted(secs), secs
    assert lines.index(staged[-1][0]) + 1 == next(i for i, line in enumerate(lines) if line.startswith("exported "))
    # evaluate: what it evaluates, on which split of which data, then each step, then the metrics
    r = CliRunner().invoke(app, ["evaluate", str(tmp_path / "x"), "--split", "test"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    staged = [m[1] for m in (re.fullmatch(r"\[evaluate\] \d+\.\d s (.+)", line) for line in lines) if m]
    rows = json.load(open(small_data / "meta.json"))["splits"]["test"]["rows"]
    steps = [f"evaluating {tmp_path / 'x'}, checkpoint best, on split 'test' of "
             f"{small_data}", f"reading the checkpoint {tmp_path / 'x' / 'checkpoints'}",
             f"scoring {rows:,} rows of split 'test' in 1 batch(es)"]
    assert len(staged) == len(steps) and all(m.startswith(w) for m, w in zip(staged, steps)), lines
    assert lines[len(steps)] == f"{tmp_path / 'x'} [test], checkpoint best (step 2)", lines
    r = CliRunner().invoke(app, ["evaluate", str(tmp_path / "x"), "--json"], catch_exceptions=False)
    assert json.loads(r.stdout)["auc"] > 0, r.output  # --json: the metrics alone on stdout
    capsys.readouterr()
    console.stage("not shown")  # outside a verb's stages (a library call): nothing
    assert capsys.readouterr().out == ""


_FIRST_LINE = r"""
import os, sys
from dlrmctl import console

def first(msg, err=False):  # the verb's first line, and whether torch was imported before it
    print("torch" in sys.modules, msg, flush=True)
    os._exit(0)

console.echo = first
sys.argv = ["dlrmctl"] + sys.argv[1:]
from dlrmctl.cli import main
main()
"""


def test_evaluate_and_export_say_what_they_do_before_torch_is_imported(tmp_path):
    """`evaluate` printed nothing for 20-50 s and `export` its first line after ~12 s: both name
    what they do first, before the seconds of `import torch` and the checkpoint read; the default
    checkpoint is named from the run's markers (best / last when it kept no best)."""
    import subprocess
    import sys

    from tests.conftest import REPO

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(f"name: run\ndata:\n  path: {tmp_path / 'data'}\n")
    for argv, line in ((["evaluate", run, "--split", "test"],
                        f"[evaluate] 0.0 s evaluating {run}, checkpoint best (last when the run kept no best), on "
                        f"split 'test' of {tmp_path / 'data'}"),
                       (["export", run, "--int4", "--checkpoint", "last"],
                        f"[export] 0.0 s exporting {run}, checkpoint last, int4 embeddings, to {run / 'export-int4'}")):
        p = subprocess.run([sys.executable, "-c", _FIRST_LINE, *map(str, argv)], cwd=REPO, capture_output=True,
                           text=True, timeout=120)
        assert p.stdout == f"False {line}\n", (argv, p.stdout, p.stderr[-2000:])
    # a run that kept no best (train.keep_best: none: LATEST alone) is evaluated at its last checkpoint, and says so
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "LATEST").write_text("step_00000002\n")
    for argv, line in ((["evaluate", run], f"[evaluate] 0.0 s evaluating {run}, checkpoint last (the run kept no "
                                           f"best), on split 'val' of {tmp_path / 'data'}"),
                       (["export", run, "--int4"], f"[export] 0.0 s exporting {run}, checkpoint last (the run kept "
                                                   f"no best), int4 embeddings, to {run / 'export-int4'}")):
        p = subprocess.run([sys.executable, "-c", _FIRST_LINE, *map(str, argv)], cwd=REPO, capture_output=True,
                           text=True, timeout=120)
        assert p.stdout == f"False {line}\n", (argv, p.stdout, p.stderr[-2000:])
