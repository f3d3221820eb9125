"""``preprocess`` says so when it writes no val / test split (the ratios default to 0)."""

from typer.testing import CliRunner

from dlrmctl.cli import app

SCHEMA = "label: click\ncategorical:\n  - {name: u, vocab: {min_count: 1}}\n"


def _run(tmp_path, *extra):
    if (tmp_path / "log.csv").exists():
        return _invoke(tmp_path, extra)
    (tmp_path / "s.yaml").write_text(SCHEMA)
    (tmp_path / "log.csv").write_text("click,u\n" + "".join(f"{i % 2},u{i % 7}\n" for i in range(400)))
    return _invoke(tmp_path, extra)


def _invoke(tmp_path, extra):
    return CliRunner().invoke(app, ["preprocess", "logs", "--schema", str(tmp_path / "s.yaml"), "--input",
                                    str(tmp_path / "log.csv"), "--out", str(tmp_path / "out"), "--quiet", *extra],
                              catch_exceptions=False)


def test_no_val_or_test_split_is_a_warning_saying_how_to_get_them(tmp_path):
    r = _run(tmp_path)
    assert r.exit_code == 0, r.output
    warn = [ln for ln in r.output.splitlines() if ln.startswith("warning:")]
    assert warn == [f"warning: {tmp_path / 'out'} has no val or test split (0 rows, the default --val-ratio and "
                    "--test-ratio are 0): `train` evaluates on the val split and keeps its best checkpoint by it; "
                    "preprocess again with --val-ratio 0.1 and --test-ratio 0.1 (fractions of the rows) to get them"]
    again = _run(tmp_path)  # already complete: still said
    assert any(ln.startswith("warning:") for ln in again.output.splitlines()), again.output


def test_only_the_empty_split_is_named_and_none_when_both_exist(tmp_path):
    r = _run(tmp_path, "--val-ratio", "0.2")
    assert r.exit_code == 0, r.output
    assert [ln for ln in r.output.splitlines() if ln.startswith("warning:")] == [
        f"warning: {tmp_path / 'out'} has no test split (0 rows): preprocess again with --test-ratio 0.1 "
        "(fractions of the rows) to get one"]
    r = _run(tmp_path, "--val-ratio", "0.2", "--test-ratio", "0.2", "--force")
    assert r.exit_code == 0 and "warning:" not in r.output, r.output


def test_the_warning_names_only_the_ratio_options_the_verb_has_and_their_own_defaults(tmp_path):
    # a synthetic-drift day has no test split by design (the next day is its test) and no --test-ratio
    r = CliRunner().invoke(app, ["preprocess", "synthetic-drift", "--out", str(tmp_path / "day0"), "--day", "0",
                                 "--rows", "2000"], catch_exceptions=False)
    assert r.exit_code == 0 and "warning:" not in r.output, r.output
    # synthetic's ratios default to 0.1: asked for 0, the warning does not say the defaults are 0
    r = CliRunner().invoke(app, ["preprocess", "synthetic", "--out", str(tmp_path / "syn"), "--rows", "2000",
                                 "--val-ratio", "0", "--test-ratio", "0"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert [ln for ln in r.output.splitlines() if ln.startswith("warning:")] == [
        f"warning: {tmp_path / 'syn'} has no val or test split (0 rows): `train` evaluates on the val split and "
        "keeps its best checkpoint by it; preprocess again with --val-ratio 0.1 and --test-ratio 0.1 (fractions of "
        "the rows) to get them"], r.output
