"""dlrmctl.commands.options: a number option's range is checked where it is declared, in the
order declared; a comma-separated integer option parses once for every verb that has it."""

from __future__ import annotations

from typing import Annotated, Optional

import pytest
import typer
from typer.testing import CliRunner

from dlrmctl.commands.options import check_numbers, int_list_option, number_option
from dlrmctl.config import INT_LIMITS
from dlrmctl.errors import CommandError


def _command(
    a: Annotated[int, number_option("--a", help="a count", what="things", maximum=10)] = 1,
    hi: Annotated[float, number_option("--hi", help="upper", what="ms", positive=False)] = 5.0,
    lo: Annotated[float, number_option("--lo", help="lower", what="ms (at most --hi)", at_most="hi",
                                       positive=False)] = 0.0,
    batch: Annotated[Optional[int], number_option("--batch", help="rows", what="rows",
                                                  int_limit="eval_batch_size")] = None,
    plain: int = 0,
) -> None:
    check_numbers(_command, locals())


@pytest.mark.parametrize("kw,message", [
    ({"a": 0}, "--a must be a finite number > 0 and <= 10 (things), got 0"),
    ({"a": 11, "lo": 9.0}, "--a must be"),  # the first declared is the one named
    ({"lo": 6.0}, "--lo must be a finite number >= 0 and <= 5 (ms (at most --hi)), got 6.0"),
    ({"hi": float("nan")}, "--hi must be a finite number >= 0 (ms), got nan"),
    ({"batch": INT_LIMITS["eval_batch_size"][0] + 1}, f"<= {INT_LIMITS['eval_batch_size'][0]:,} (rows)"),
])
def test_a_number_out_of_its_declared_range_is_one_error_naming_the_option(kw, message):
    with pytest.raises(CommandError) as e:
        _command(**kw)
    assert message in str(e.value) and e.value.exit_code == 2


def test_numbers_in_range_and_unset_ones_pass():
    _command(a=10, hi=3.0, lo=3.0, batch=None, plain=-5)


def test_an_integer_list_option_gives_n_integers_or_a_usage_error_naming_it():
    app = typer.Typer()
    got = []

    @app.command()
    def cmd(sizes: Annotated[Optional[str], int_list_option("--sizes", n=3, help="sizes")] = None) -> None:
        got.append(sizes)

    runner = CliRunner()
    for args, want in ((["--sizes", "4"], [4, 4, 4]), (["--sizes", "1,2,3"], [1, 2, 3]), ([], None)):
        assert runner.invoke(app, args).exit_code == 0
        assert got.pop() == want
    for value, message in (("1,2", "expected 1 or 3 comma-separated integers, got 2"), ("0", "values must be >= 1"),
                           ("x", "expected integers separated by commas, got 'x'")):
        r = runner.invoke(app, ["--sizes", value])
        assert r.exit_code == 2 and "--sizes" in r.output and message in r.output, r.output
    assert not got
