"""Issue 14 item 8: `dlrmctl --help`, every verb's --help and configuration errors answer without
importing torch (or fbgemm_gpu); cli.py holds only the app and its registrations."""

import ast
import subprocess
import sys

import pytest

from tests.conftest import REPO

_PROBE = r"""
import sys
sys.argv = ["dlrmctl"] + sys.argv[1:]
from dlrmctl.cli import main
try:
    main()
except SystemExit as e:
    code = e.code
else:
    code = 0
heavy = sorted(m for m in ("torch", "fbgemm_gpu", "pyarrow", "torchx") if m in sys.modules)
print("EXIT", code, "HEAVY", ",".join(heavy) or "-", file=sys.stderr)
"""


def _run(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _PROBE, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", [
    ["--help"],
    ["train", "--help"], ["evaluate", "--help"], ["plan", "--help"], ["export", "--help"], ["predict", "--help"],
    ["report", "--help"], ["launch", "--help"], ["sweep", "--help"], ["checkpoint", "reshard", "--help"],
    ["checkpoint", "inspect", "--help"],
    ["preprocess", "criteo", "--help"], ["preprocess", "movielens", "--help"],
])
def test_help_does_not_import_torch(args):
    p = _run(*args)
    assert "EXIT 0 HEAVY -" in p.stderr, p.stderr[-2000:]


def test_config_errors_do_not_import_torch(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  embedding_dim: abc\n")
    for args in (["train", str(bad)], ["train", str(tmp_path / "missing.yaml")],
                 ["train", "configs/demo.yaml", "--set", "train.epochs=0"]):
        p = _run(*args)
        assert "EXIT 2 HEAVY -" in p.stderr, (args, p.stderr[-2000:])
        assert p.stderr.startswith("error: ") and "Traceback" not in p.stderr, p.stderr


def test_importtime_of_help_has_no_torch():
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "dlrmctl.cli", "--help"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0
    mods = {line.split("|")[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
    assert "dlrmctl.commands._common" in mods and "torch" not in mods and "fbgemm_gpu" not in mods


def test_cli_module_is_only_the_app_and_registrations():
    tree = ast.parse((REPO / "dlrmctl" / "cli.py").read_text())
    funcs = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    # + the one place a verb's failure becomes what the user sees (one line; dlrmctl.errors decides what is whose)
    assert funcs <= {"_register", "main", "report_failure"}, funcs
    for mod in ("train", "evaluate"):
        assert (REPO / "dlrmctl" / "commands" / f"{mod}.py").is_file()


def test_version_names_dlrmctl_torch_and_fbgemm_without_importing_them():
    """Issue 23: `dlrmctl --version` prints dlrmctl's version and the libraries' from their metadata
    (torch, fbgemm_gpu and torchx are not imported); exit 0, one line, no traceback."""
    from importlib import metadata

    import dlrmctl

    p = _run("--version")
    assert "EXIT 0 HEAVY -" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1, p.stdout
    assert lines[0].startswith(f"dlrmctl {dlrmctl.__version__} (python "), lines[0]
    assert f"torch {metadata.version('torch')}" in lines[0], lines[0]
    assert "fbgemm_gpu " in lines[0] and "torchx " in lines[0], lines[0]


# ------------------------------------------- errors that need no model answer before torch is imported
def test_serve_on_a_busy_port_fails_in_one_line_before_torch(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        p = _run("serve", str(tmp_path / "no_model_needed"), "--port", str(port))
    assert "EXIT 2 HEAVY -" in p.stderr, p.stderr[-2000:]
    assert p.stderr.startswith(f"error: cannot listen on 127.0.0.1:{port}: ") and "--port" in p.stderr, p.stderr


def test_export_to_an_existing_directory_fails_in_one_line_before_torch(tmp_path):
    run = tmp_path / "run"
    (run / "export-int8").mkdir(parents=True)
    (run / "config.yaml").write_text("name: run\n")  # a run directory (a missing one: test_run_dir_checks)
    (tmp_path / "mine").mkdir()
    for args, what in (([str(run), "--int8"], f"{run / 'export-int8'} already exists; pass --force"),
                       ([str(run)], f"{run / 'export-int8'} already exists; pass --force"),  # int8: the default
                       ([str(run), "--fp16", "--out", str(tmp_path / "mine")], f"{tmp_path / 'mine'} already exists"),
                       ([str(run), "--int8", "--fp32"], "choose one of --int8 (the default), --int4, --fp16, --fp32; "
                                                        "got --int8, --fp32")):
        p = _run("export", *args)
        assert "EXIT 2 HEAVY -" in p.stderr, (args, p.stderr[-2000:])
        assert p.stderr.startswith("error: ") and what in p.stderr, p.stderr


def test_plan_for_an_unknown_device_or_missing_data_fails_in_one_line_before_torch(tmp_path_factory, tmp_path):
    from tests.conftest import tiny_synthetic

    data = tiny_synthetic(tmp_path_factory, "plan_fast", rows=200)
    p = _run("plan", "configs/demo.yaml", "--gpus", "2", "--device", "h800", "--set", f"data.path={data}",
             "--out", str(tmp_path / "plan.yaml"))
    assert "EXIT 2 HEAVY -" in p.stderr, p.stderr[-2000:]
    assert p.stderr.startswith("error: ") and "h800" in p.stderr, p.stderr
    p = _run("plan", "configs/demo.yaml", "--gpus", "2", "--set", f"data.path={tmp_path / 'none'}")
    assert "EXIT 2 HEAVY -" in p.stderr and "meta.json" in p.stderr, p.stderr[-2000:]
    assert "relative to" not in p.stderr
    # a relative data.path: the error names the directory it was resolved against
    p = _run("plan", str(REPO / "configs" / "demo.yaml"), "--gpus", "2", "--set", "data.path=data/nowhere", cwd=tmp_path)
    assert "EXIT 2 HEAVY -" in p.stderr, p.stderr[-2000:]
    assert f"data/nowhere/meta.json (relative to the working directory {tmp_path})" in p.stderr, p.stderr


def test_launch_dry_run_reads_and_validates_the_config_like_train(tmp_path):
    """`launch ... --dry-run` submits nothing, but a config that does not exist or does not
    validate is the same one error line as `train` gives (exit 2), before torch."""
    for config, sets, what in (("configs/no_such.yaml", [], "configs/no_such.yaml: cannot read config"),
                               ("configs/demo.yaml", ["--set", "train.max_step=3"],
                                "train.max_step: unknown key (did you mean 'max_steps'?)")):
        for verb in (["launch", config, "--scheduler", "slurm", "--dry-run"], ["train", config]):
            p = _run(*verb, *sets)
            assert "EXIT 2 HEAVY" in p.stderr and "torch," not in p.stderr and "HEAVY torch\n" not in p.stderr, p.stderr
            assert p.stderr.startswith("error: ") and what in p.stderr and "Traceback" not in p.stderr, (verb, p.stderr)


def test_an_unknown_config_key_suggests_the_near_one_and_only_a_near_one():
    from dlrmctl.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match=r"data\.batchsize: unknown key \(did you mean 'batch_size'\?\); expected one of"):
        config_from_dict({"name": "x", "data": {"batchsize": 4}})
    with pytest.raises(ConfigError, match=r"train\.zzzz: unknown key; expected one of"):
        config_from_dict({"name": "x", "train": {"zzzz": 4}})


def _commands(group, prefix=()):
    for name, cmd in getattr(group, "commands", {}).items():
        yield (*prefix, name), cmd
        yield from _commands(cmd, (*prefix, name))  # a group's verbs


def test_every_option_of_every_verb_has_help_text_and_no_raw_rst_markup():
    """--help is read in a terminal: each option says what it does, and the help texts carry no
    reStructuredText double backticks (they print as they are)."""
    import typer

    from dlrmctl.cli import app

    root = typer.main.get_command(app)
    seen = 0
    for path, cmd in _commands(root):
        assert "``" not in (cmd.help or ""), (path, cmd.help)
        for p in cmd.params:
            if p.param_type_name == "option" and p.name != "help":  # (typer's own click: duck-typed)
                seen += 1
                assert (p.help or "").strip(), (path, p.opts)
                assert "``" not in p.help, (path, p.opts, p.help)
    assert seen > 50


def _fake_export(d, preprocessing):
    """An export directory holding only its manifest: the input checks must answer without loading
    (or even finding) the model."""
    import json

    d.mkdir()
    (d / "manifest.json").write_text(json.dumps({"format_version": 1, "preprocessing": preprocessing}))
    return d


def test_predict_on_an_input_of_the_wrong_kind_fails_in_one_line_before_torch(tmp_path):
    """A directory, an empty file, a Parquet or gzip file given as raw TSV, rows with another field
    count: one error line naming the file (and line), before torch is imported or the model loaded."""
    import gzip

    model = _fake_export(tmp_path / "m", {"dataset": "criteo"})
    good_row = "\t".join(["1"] + ["2"] * 13 + ["68fd1e64"] * 26) + "\n"
    files = {
        "parquet.tsv": b"PAR1" + bytes(range(256)) * 4 + b"PAR1",
        "gzipped.tsv": gzip.compress(good_row.encode()),
        "nul.tsv": b"1\t2\x00\x00\x00\n",
        "latin1.tsv": "1\t\xe9t\xe9\n".encode("latin-1"),
        "short.tsv": ("1\t2\t3\n" + good_row).encode(),
        "csv.tsv": good_row.replace("\t", ",").encode(),
        "blank.tsv": b"\n\n  \n",
        "empty.tsv": b"",
    }
    for name, body in files.items():
        (tmp_path / name).write_bytes(body)
    (tmp_path / "adir").mkdir()
    cases = [("parquet.tsv", ":1: a Parquet file, not raw Criteo rows"),
             ("gzipped.tsv", ":1: gzip-compressed data"),
             ("nul.tsv", ":1: binary data (NUL bytes)"),
             ("latin1.tsv", ":1: binary data (not UTF-8 text)"),
             ("short.tsv", ":1: expected 40 or 39 tab-separated fields (label, 13 dense, 26 categorical; the label "
                           "may be left out), got 3"),
             ("csv.tsv", ":1: expected 40 or 39 tab-separated fields (label, 13 dense, 26 categorical; the label "
                         "may be left out), got 1 (the line is comma-separated; Criteo rows are tab-separated)"),
             ("blank.tsv", ": empty file: no lines to score"), ("empty.tsv", ": empty file: no lines to score"),
             ("adir", ": is a directory"), ("missing.tsv", ": no such file")]
    for name, what in cases:
        p = _run("predict", str(model), "--input", str(tmp_path / name))
        assert "EXIT 2 HEAVY -" in p.stderr, (name, p.stderr[-2000:])
        lines = p.stderr.splitlines()
        assert len(lines) == 2 and lines[0].startswith(f"error: {tmp_path / name}{what}"), (name, p.stderr)
    # no model at all: named before the input is read
    p = _run("predict", str(tmp_path / "nomodel"), "--input", str(tmp_path / "short.tsv"))
    assert "EXIT 2 HEAVY -" in p.stderr and f"{tmp_path / 'nomodel' / 'manifest.json'}: not found" in p.stderr, p.stderr


def test_predict_checks_a_schema_datasets_format_and_columns_before_torch(tmp_path):
    """A schema (logs) model: text given where Parquet is read, a header without a column the model
    reads, a headerless row of the wrong width (naming the first missing column), a JSON line that
    is not an object — each one line before torch; a good first line passes on to the model load."""
    schema = {"name": "clicks", "format": None, "header": True, "label": {"column": "click"},
              "dense": [{"name": "price"}], "categorical": [{"name": "site"}, {"name": "app"}], "ignore": ["id"]}
    model = _fake_export(tmp_path / "m", {"dataset": "logs", "meta": {"schema": schema}})
    headerless = dict(schema, header=False, format="csv", columns=["click", "price", "site", "app"])
    bare = _fake_export(tmp_path / "bare", {"dataset": "logs", "meta": {"schema": headerless,
                                                                      "input_columns": headerless["columns"]}})
    (tmp_path / "rows.parquet").write_text("click,price,site,app\n1,2,a,b\n")
    (tmp_path / "nosite.csv").write_text("click,price,app\n1,2,b\n")
    (tmp_path / "extra.csv").write_text("click,price,site,app,color\n1,2,a,b,red\n")
    joined = dict(schema, join=[{"path": "apps.csv", "key": "app", "columns": ["genre"]}],
                  categorical=[*schema["categorical"], {"name": "genre"}])
    with_join = _fake_export(tmp_path / "j", {"dataset": "logs", "meta": {"schema": joined}})
    (tmp_path / "genre.csv").write_text("click,price,site,app,genre\n1,2,a,b,g\n")
    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    (tmp_path / "nosite.jsonl").write_text('{"price": 2, "app": "b"}\n')
    (tmp_path / "two.csv").write_text("1,2\n")
    (tmp_path / "criteo.csv").write_text("\t".join(["0"] + ["5"] * 13 + ["68fd1e64"] * 26) + "\n")
    (tmp_path / "noheader.csv").write_text("1,2.5,a,b\n")
    (tmp_path / "headeronly.csv").write_text("click,price,site,app\n\n")
    (tmp_path / "hugefield.csv").write_text("a," + "x" * 200_000 + "\n")  # over the csv module's field limit
    cases = [(model, "rows.parquet", ": not a Parquet file (it starts as text)"),
             (model, "nosite.csv", ":1: column 'site' the model reads is not in the file (its columns: click, price, "
                                   "app; expected price, site, app)"),
             (model, "extra.csv", ":1: column 'color' of the file is not named by the model's schema"),
             (model, "criteo.csv", ":1: the first line is not a header of the model's columns (no column of its "
                                   "schema among the line's 1 field(s); it looks tab-separated, the model's schema "
                                   "reads ','-separated CSV); expected a header naming price, site, app"),
             (model, "noheader.csv", ":1: the first line is not a header of the model's columns (no column of its "
                                     "schema among the line's 4 field(s); the file has no header line, or is not "
                                     "this model's log)"),
             (model, "headeronly.csv", ": a header line and no rows after it: no lines to score"),
             (model, "hugefield.csv", ":1: the first line does not split into fields (field larger than field "
                                      "limit"),
             (with_join, "genre.csv", ":1: column 'genre' comes from the model's side table join[0] (apps.csv, by "
                                      "its key 'app'): raw rows must not carry it"),
             (model, "list.jsonl", ":1: expected a JSON object per line, got a list"),
             (model, "nosite.jsonl", ":1: column 'site' the model reads is not in the file"),
             (bare, "two.csv", ":1: expected 4 CSV fields (click, price, site, app) or 3 without the label 'click', "
                               "got 2 (the first missing: 'site')")]
    for m, name, what in cases:
        p = _run("predict", str(m), "--input", str(tmp_path / name))
        assert "EXIT 2 HEAVY -" in p.stderr, (name, p.stderr[-2000:])
        assert p.stderr.startswith(f"error: {tmp_path / name}{what}"), (name, p.stderr)
    (tmp_path / "good.csv").write_text("\ufeffclick,price,site,app\n1,2,a,b\n")  # (a BOM is not part of 'click')
    p = _run("predict", str(model), "--input", str(tmp_path / "good.csv"))
    assert "HEAVY -" not in p.stderr and "manifest" in p.stderr, p.stderr[-2000:]  # passed on to load_exported


@pytest.mark.parametrize("columns", ["80", "200"])
def test_every_verbs_help_reads_cleanly_at_any_width(columns):
    """`--help` of every verb, rendered at 80 and 200 columns: no `<bool>` after a flag, no raw
    backticks, each group's command summaries whole and capitalised (never cut with "..."), no option name cut short (`--multi-hot-distribu…`), arguments in the usage
    line as CONFIG / [CONFIG] (never `{config}`), and every option of the verb named with its text;
    no Python type as a metavar (`--set <list[str]>`, `--nproc <int range>`, `CONFIG <str>`: a
    metavar says what to write, `KEY=VALUE`, `N`, `PATH`), and a short `[default: 1; x>=1]` never
    cut across two lines."""
    import re

    import typer
    from typer.testing import CliRunner

    from dlrmctl.cli import app

    root = typer.main.get_command(app)
    paths = [()] + [path for path, _ in _commands(root)]
    assert len(paths) > 20
    for path in paths:
        r = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": columns, "TERMINAL_WIDTH": columns})
        out = r.output
        assert r.exit_code == 0, (path, out)
        assert "<bool>" not in out and "`" not in out, (path, out)  # a `code` span is printed as 'code'
        summaries = out.partition("\nCommands:\n")[2].splitlines()
        for line in summaries:  # each command's summary whole (never cut with "..."), capitalised
            assert not line.rstrip().endswith(("...", "…")), (path, line)
            words = line.split(None, 1)
            assert len(words) == 2 and words[1][0].isupper(), (path, line)
        assert not re.search(r"<(str|int|float|path|list|bool|file|datetime)\b[^>]*>", out), (path, out)
        for tail in re.findall(r"\[default: [^\]]*\]", out):
            assert "\n" not in tail or len(" ".join(tail.split())) > 40, (path, tail)
        assert "\u00a0" not in out and "\u2011" not in out, (path, out)  # the wrap's stand-ins are gone
        assert not re.search(r"-[\w-]*(…|\.\.\.)(\s|$)", out), (path, out)
        usage = out.split("\n\n", 1)[0]
        assert "{" not in usage and re.match(r"Usage: \S+.* \[OPTIONS\]", usage), (path, usage)
        cmd = root
        for name in path:
            cmd = cmd.commands[name]
        for p in cmd.params:
            if p.param_type_name == "argument":
                assert re.search(rf"(^| )\[?{p.name.upper()}\]?( |$)", usage.replace("\n", " ")), (path, usage)
            elif p.param_type_name == "option":
                for opt in p.opts:  # listed whole, each at the start of its entry with its text after it
                    line = next((ln for ln in out.splitlines() if re.match(rf"\s+(-\w, )?{re.escape(opt)}\b", ln)), None)
                    assert line is not None, (path, opt, out)
    # a flag's entry has no type; -v/--verbose has its text; value options and arguments say what to write
    out = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": columns}).output
    assert re.search(r"^\s+-v, --verbose\s+dlrmctl's debug log lines", out, re.M), out
    for entry in ("--set KEY=VALUE ", "--nproc N ", "--plan PATH ", "--init-from RUN ", "[default: 1; x>=1]"):
        assert entry in out, (entry, out)
    assert re.search(r"^\s+CONFIG\s+experiment YAML", out, re.M), out
