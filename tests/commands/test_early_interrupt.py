"""A Ctrl-C from the first instant of a command: while ``dlrmctl.cli`` is still being imported
(Typer, every verb's registration) it is the same one ``error: interrupted (SIGINT) ...`` line and
exit code 130 as once the verb runs, never a traceback of the imports (``dlrmctl.entry``, the
console script and ``python -m dlrmctl``)."""

import builtins
import sys

import pytest


def test_an_interrupt_while_the_command_line_is_imported_is_one_line(monkeypatch, capsys):
    from dlrmctl import entry

    real_import = builtins.__import__

    def interrupted(name, *args, **kwargs):  # the Ctrl-C lands in the import of the command line
        if name == "dlrmctl.cli":
            raise KeyboardInterrupt
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", interrupted)
    monkeypatch.setattr(sys, "argv", ["dlrmctl", "preprocess", "synthetic", "--out", "data/x"])
    with pytest.raises(SystemExit) as e:
        entry.main()
    assert e.value.code == 130
    err = capsys.readouterr().err
    assert err.splitlines() == [err.strip()] and err.startswith(
        "error: interrupted (SIGINT): `dlrmctl preprocess synthetic` (--out data/x) stopped; "), err

