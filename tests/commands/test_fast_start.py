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
    (tmp_path / "mine").mkdir()
    for args, what in (([str(run), "--int8"], f"{run / 'export-int8'} already exists; pass --force"),
                       ([str(run), "--fp16", "--out", str(tmp_path / "mine")], f"{tmp_path / 'mine'} already exists")):
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
