"""dlrmctl.errors: one UserError base; OS conditions and wrapped interrupts found and worded once."""

import errno

import pytest

from dlrmctl import errors


def test_every_user_facing_error_is_a_user_error_and_keeps_its_base():
    from dlrmctl._fbgemm import FbgemmTorchMismatchError
    from dlrmctl.config import ConfigError
    from dlrmctl.data.columnar import DataError
    from dlrmctl.data.fingerprint import DataMismatchError
    from dlrmctl.distributed.types import PlanError
    from dlrmctl.inference.export import ExportError
    from dlrmctl.inference.quantize import QuantizationError
    from dlrmctl.run_lock import RunInUseError
    from dlrmctl.sparse.validation import EmbeddingIdError
    from dlrmctl.train.checkpoint import CheckpointError
    from dlrmctl.train.run_dir import TrainError

    for cls, base in ((ConfigError, ValueError), (PlanError, ValueError), (errors.OutputError, RuntimeError), (errors.CommandError, Exception),
                      (CheckpointError, RuntimeError), (TrainError, RuntimeError), (DataError, ValueError),
                      (DataMismatchError, ValueError), (EmbeddingIdError, ValueError), (RunInUseError, RuntimeError),
                      (ExportError, RuntimeError), (QuantizationError, ValueError),
                      (FbgemmTorchMismatchError, ImportError)):
        assert issubclass(cls, errors.UserError) and issubclass(cls, base), cls


def _dcp_wrapped(inner: BaseException) -> BaseException:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException("write", {0: (inner, [])})


def test_an_interrupt_or_a_full_disk_wrapped_by_dcp_is_found():
    assert errors.interrupt_of(_dcp_wrapped(KeyboardInterrupt())) is not None
    assert errors.interrupt_of(_dcp_wrapped(RuntimeError("unexpected pos 704 vs 598"))) is None
    msg = errors.user_error_message(_dcp_wrapped(OSError(errno.ENOSPC, "No space left on device", "/x/y")))
    assert msg.startswith("/x/y: no space left on device;"), msg
    try:  # explicit wrapping (raise ... from) too
        try:
            raise OSError(errno.EROFS, "Read-only file system", "/ro/f")
        except OSError as e:
            raise RuntimeError("wrapped") from e
    except RuntimeError as e:
        assert "read-only file system" in errors.user_error_message(e)
    try:  # not a bug raised while handling an OSError
        try:
            raise FileNotFoundError(errno.ENOENT, "No such file", "/nope")
        except OSError:
            raise AttributeError("a bug")
    except AttributeError as e:
        assert errors.user_error_message(e) is None


@pytest.mark.parametrize("e, words", [
    (OSError(errno.ENOTDIR, "Not a directory", "/a/f/x"), "is a file, expected a directory"),
    (OSError(errno.EDQUOT, "Disk quota exceeded", "/q"), "disk quota exceeded"),
    (OSError("IOError: [errno 28] No space left on device"), "no space left on device"),  # pyarrow: no errno
])
def test_os_conditions_are_one_line_naming_the_condition(e, words):
    assert words in errors.os_error_message(e)


def test_other_errors_are_not_user_errors():
    assert errors.user_error_message(RuntimeError("a bug")) is None
    assert errors.user_error_message(OSError(errno.EIO, "I/O error")) is None


def test_the_cli_reports_an_os_condition_and_an_interrupt_as_one_line(capsys):
    from dlrmctl.cli import report_failure

    assert report_failure(OSError(errno.ENOSPC, "No space left on device", "out/x")) == 2
    assert capsys.readouterr().err.startswith("error: out/x: no space left on device")
    assert report_failure(_dcp_wrapped(KeyboardInterrupt()), "dlrmctl export", "m.pt2") == 130
    err = capsys.readouterr().err
    assert err.startswith("error: interrupted (SIGINT): `dlrmctl export` (--out m.pt2) stopped;") and err.count("\n") == 1
    assert "run the same command again" in err
    assert report_failure(errors.Interrupted(15)) == 143
    assert capsys.readouterr().err.startswith("error: interrupted (SIGTERM): the command stopped;")
    assert report_failure(ValueError("a bug")) is None


def test_one_class_per_kind_of_error_under_its_former_names_too():
    from dlrmctl.distributed.types import PlanError
    from dlrmctl.planner.types import PlannerError

    assert PlannerError is PlanError and errors.OutputPathError is errors.OutputError


def test_a_command_error_is_one_line_with_its_exit_code_also_while_handling_an_interrupt(capsys):
    from dlrmctl.cli import report_failure

    assert report_failure(errors.CommandError("--jobs must be > 0, got 0")) == errors.EXIT_USER
    try:
        try:
            raise errors.Interrupted(15)
        except errors.Interrupted:
            raise errors.CommandError("interrupted (SIGTERM): the work stopped", 143)
    except errors.CommandError as c:
        assert report_failure(c) == 143
    assert capsys.readouterr().err.splitlines() == ["error: --jobs must be > 0, got 0",
                                                    "error: interrupted (SIGTERM): the work stopped"]


def test_an_interrupt_before_a_verb_handles_it_is_one_error_line_naming_the_command_and_its_out(tmp_path,
                                                                                              monkeypatch):
    """A Ctrl-C during a verb's imports or checks (before its own interrupt handling) is the same
    ``error: interrupted (SIGINT): ...`` line as any other, naming the sub-command and --out."""
    from typer.testing import CliRunner

    import dlrmctl.data.logs
    from dlrmctl.cli import app

    def ctrl_c(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(dlrmctl.data.logs, "load_schema", ctrl_c)
    out = tmp_path / "d"
    r = CliRunner().invoke(app, ["preprocess", "logs", "--schema", str(tmp_path / "s.yaml"), "--input",
                                 str(tmp_path / "x.csv"), "--out", str(out)])
    assert r.exit_code == 130, r.output
    lines = [x for x in r.output.splitlines() if "interrupted" in x]
    assert lines == [f"error: interrupted (SIGINT): `dlrmctl preprocess logs` (--out {out}) stopped; an output is "
                     "put in place or marked complete only when finished, so nothing half-written is taken for "
                     "done: run the same command again unless it had printed its result"], r.output
    assert not out.exists()


@pytest.mark.parametrize("argv,command", [(["export", "runs/r"], "dlrmctl export"),
                                          (["checkpoint", "reshard", "runs/r"], "dlrmctl checkpoint reshard"),
                                          (["preprocess", "criteo", "-i", "x"], "dlrmctl preprocess criteo")])
def test_an_interrupt_while_typer_builds_the_command_line_is_the_same_one_line(monkeypatch, capsys, argv, command):
    """A Ctrl-C in the first fraction of a second (Typer reading the verbs' signatures, before any
    verb runs) ended with a traceback.  A verb with sub-verbs is named with its sub-verb."""
    import dlrmctl.cli as cli

    def ctrl_c():
        raise KeyboardInterrupt

    from dlrmctl import entry

    registered = {g.name for g in cli.app.registered_groups if g.name}
    assert registered == entry.SUB_GROUPS == {"preprocess", "checkpoint", "jobs"}  # registered = named early
    monkeypatch.delenv("DLRMCTL_LAUNCHER", raising=False)
    monkeypatch.setattr(cli, "app", ctrl_c)
    monkeypatch.setattr("sys.argv", ["dlrmctl", *argv, "--out", "m.pt2"])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 130
    assert capsys.readouterr().err.startswith(f"error: interrupted (SIGINT): `{command}` (--out m.pt2) stopped;")

