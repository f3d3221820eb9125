"""``dlrmctl sweep CONFIG --grid key=v1,v2 ...``: train every point of a grid, rank them on validation.

Each point is one ``dlrmctl train CONFIG --set key=value ...`` in its own process (a fresh
interpreter: no state leaks between points) with its own run directory
``<train.run_dir>/<name>/<point>`` (``<name>``: ``--name``, default ``<config name>_sweep``); its
console output goes to ``<train.run_dir>/<name>/logs/<point>.log``.
The points run one after another, or ``--jobs N`` at a time (each then gets
the idle CPUs // N OpenMP threads (:func:`dlrmctl.procs.intra_op_threads`) unless
``OMP_NUM_THREADS`` is set; N is capped at the number of points, and at what this machine runs,
:func:`dlrmctl.procs.check_local_fanout`).  Every point's process ends with the sweep.  ``--name`` is one directory name.  The keys the sweep sets for every point
(``name``, ``train.run_dir``, ``train.progress``) and ``train.keep_best`` (the ranking metric) cannot
be gridded (:data:`RESERVED_KEYS`).

The summary reads each run's ``summary.json`` (its best validation evaluation, the one
``train.keep_best`` keeps) and is written as ``sweep.csv`` and ``sweep.md`` next to the
points, sorted best first by the ``keep_best`` metric (``auc`` descending, ``ne``
ascending).  Nothing here reads the test split: choose on val, then run
``dlrmctl evaluate <point> --split test`` once for the chosen point.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import time
import signal
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Annotated, Any, List, Optional

import typer

from dlrmctl import outputs
from dlrmctl.commands._common import echo, fail, show_path
from dlrmctl.commands.options import check_numbers, number_option
from dlrmctl.errors import interruptible
from dlrmctl.fileio import write_text_atomic

#: metrics of the best validation evaluation copied into the summary, in column order
SUMMARY_METRICS = ("auc", "logloss", "ne", "calibration")

#: keys a grid may not vary, and why: the sweep sets the first three for every point itself
#: (a grid over them would give identical points), and ranks all points on one metric
RESERVED_KEYS = {
    "name": "the sweep names each point's run itself (p<index>-...); use --name for the sweep's directory",
    "train.run_dir": "the sweep puts every point under <train.run_dir>/<sweep name>; set it once with --set",
    "train.progress": "the sweep turns progress off for every point (their output goes to logs/)",
    "train.keep_best": "the points are ranked on one metric (the config's train.keep_best); set it once with --set",
}


def split_values(text: str) -> list[str]:
    """``"1,2,[64, 32]"`` -> ``["1", "2", "[64, 32]"]``: commas inside ``[]`` / ``{}`` do not split.

    Raises:
        ValueError: unbalanced brackets or an empty value.
    """
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced brackets in {text!r}")
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ValueError(f"unbalanced brackets in {text!r}")
    out.append("".join(cur).strip())
    if any(v == "" for v in out):
        raise ValueError(f"empty value in {text!r}")
    return out


def parse_grid(grid: list[str]) -> list[tuple[str, list[str]]]:
    """``["model.dropout=0,0.1", ...]`` -> ``[("model.dropout", ["0", "0.1"]), ...]``.

    Raises:
        ValueError: no ``=``, an empty key, a key given twice, a key of :data:`RESERVED_KEYS`, a value
            given twice for one key, or bad values (names the entry).
    """
    out: list[tuple[str, list[str]]] = []
    for g in grid:
        key, eq, vals = g.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"--grid {g!r}: expected KEY=V1,V2,..., e.g. model.dropout=0,0.1")
        if key in (k for k, _ in out):
            raise ValueError(f"--grid {key}: given twice")
        if key in RESERVED_KEYS:
            raise ValueError(f"--grid {key}: {RESERVED_KEYS[key]}")
        try:
            values = split_values(vals)
        except ValueError as e:
            raise ValueError(f"--grid {key}: {e}") from None
        twice = sorted({v for v in values if values.count(v) > 1})
        if twice:
            raise ValueError(f"--grid {key}: value(s) {twice} given twice (the points would be the same run)")
        out.append((key, values))
    return out


def point_name(index: int, assignment: list[tuple[str, str]]) -> str:
    """Directory name of a grid point: ``p<index>-<last key part>=<value>-...`` (characters other
    than letters, digits, ``.``, ``=``, ``_`` and ``-`` become ``_``; at most 120 characters)."""
    parts = [f"{k.split('.')[-1]}={v}" for k, v in assignment]
    slug = re.sub(r"[^A-Za-z0-9.=_-]+", "_", "-".join(parts))
    return f"p{index:03d}-{slug}"[:120]


def grid_points(grid: list[tuple[str, list[str]]]) -> list[tuple[str, list[tuple[str, str]]]]:
    """Cartesian product of the grid, first key slowest: ``[(point name, [(key, value), ...]), ...]``."""
    keys = [k for k, _ in grid]
    points = []
    for i, values in enumerate(itertools.product(*(v for _, v in grid))):
        a = list(zip(keys, values))
        points.append((point_name(i, a), a))
    return points


def read_point(run_dir: str) -> dict | None:
    """The best validation evaluation of a finished run (``summary.json``), or None if absent."""
    p = os.path.join(run_dir, "summary.json")
    try:
        with open(p) as f:
            s = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    best = s.get("best") or {}
    return {**{m: best.get(m) for m in SUMMARY_METRICS}, "best_step": best.get("step"), "steps": s.get("steps"),
            "early_stopped": bool(s.get("early_stopped", False)), "train_seconds": s.get("train_seconds")}


def rank_rows(rows: list[dict], metric: str) -> list[dict]:
    """Rows sorted best first on ``metric`` (``auc``: highest; ``ne`` / ``logloss``: lowest);
    rows without the metric (failed points) or with a NaN one (an undefined score, e.g. a validation
    split of one class) last, in grid order: NaN compares false both ways and would scramble the sort."""
    def ranked(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v

    ok = [r for r in rows if ranked(r.get(metric))]
    bad = [r for r in rows if not ranked(r.get(metric))]
    ok.sort(key=lambda r: -r[metric] if metric == "auc" else r[metric])
    return ok + bad


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 1000 else f"{v:.1f}"
    return "" if v is None else str(v)


class PointProcesses:
    """The live ``train`` processes of a sweep's points: started by :meth:`run` (a worker thread
    each), all stopped by :meth:`stop` (SIGINT, then SIGKILL after ``grace_s``)."""

    def __init__(self, grace_s: float = 30.0) -> None:
        self.grace_s = grace_s
        self._procs: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self._stopped = False

    def run(self, cmd: list[str], log: Any, env: dict) -> int:
        """Run one point's ``cmd`` (stdout and stderr to ``log``) to its end; its exit code (130
        when :meth:`stop` came first)."""
        with self._lock:
            if self._stopped:
                return 130
            # its own process group: a Ctrl-C at the terminal reaches the sweep alone, which stops
            # each point once (a second SIGINT would cut a trainer's clean-up short)
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, process_group=0)
            self._procs.add(p)
        try:
            return p.wait()
        finally:
            with self._lock:
                self._procs.discard(p)

    def stop(self) -> None:
        """SIGINT to every live point (each trainer stops as on Ctrl-C), SIGKILL to those still
        running ``grace_s`` seconds later; no new point starts."""
        with self._lock:
            self._stopped = True
            procs = list(self._procs)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        deadline = time.monotonic() + self.grace_s
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def write_summary(sweep_dir: str, rows: list[dict], keys: list[str], metric: str) -> tuple[str, str]:
    """``sweep.csv`` and ``sweep.md`` in ``sweep_dir`` (each written to a temp file and renamed).

    Columns: rank, point, one per grid key, ``val_<metric>`` for :data:`SUMMARY_METRICS`,
    best_step, steps, early_stopped, train_seconds, status.  Returns the markdown table.
    """
    cols = ["rank", "point", *keys, *(f"val_{m}" for m in SUMMARY_METRICS), "best_step", "steps", "early_stopped",
            "train_seconds", "status"]
    table = [[i + 1, r["point"], *(r["values"][k] for k in keys), *(r.get(m) for m in SUMMARY_METRICS),
              r.get("best_step"), r.get("steps"), r.get("early_stopped"), r.get("train_seconds"), r["status"]]
             for i, r in enumerate(rows)]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(cols)
    w.writerows([[("" if v is None else v) for v in row] for row in table])
    md = [f"Sorted by val {metric} ({'highest' if metric == 'auc' else 'lowest'} first); test split not used.", "",
          "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in table]
    md_text = "\n".join(md) + "\n"
    for name, text in (("sweep.csv", buf.getvalue()), ("sweep.md", md_text)):
        write_text_atomic(os.path.join(sweep_dir, name), text)
    return os.path.join(sweep_dir, "sweep.csv"), md_text


def sweep(
    config: str = typer.Argument(..., help="experiment YAML (configs/*.yaml)"),
    grid: List[str] = typer.Option(..., "--grid", help="KEY=V1,V2,...: values of one config key (repeatable; "
                                                         "the grid is their product), e.g. --grid model.dropout=0,0.1"),
    set_: List[str] = typer.Option([], "--set", help="override a config key for every point"),
    jobs: Annotated[int, number_option("--jobs", min=1, help="points trained at once", what="points trained at once",
                                       maximum=1024)] = 1,
    name: Optional[str] = typer.Option(None, "--name", help="sweep directory under train.run_dir (default: "
                                                             "<config name>_sweep, apart from the config's own run)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace the points' existing run directories"),
) -> None:
    """Train every point of a --grid of config values; rank the points on validation (never test)."""
    from dlrmctl.config import ConfigError, load_config

    check_numbers(sweep, locals())
    from dlrmctl.procs import LAUNCHER_ENV, check_local_fanout, intra_op_threads, process_token

    if name is not None and (not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name):
        fail(f"--name: must be one directory name (the sweep is train.run_dir/<name>), got {name!r}")
    try:
        parsed = parse_grid(grid)
    except ValueError as e:
        fail(str(e))
    base = load_config(config, set_)
    metric = base.train.keep_best if base.train.keep_best != "none" else "auc"
    sweep_name = name or f"{base.name}_sweep"
    sweep_dir = os.path.join(base.train.run_dir, sweep_name)
    points = grid_points(parsed)
    runs = []
    for pname, assignment in points:
        overrides = [*set_, *(f"{k}={v}" for k, v in assignment), f"name={pname}", f"train.run_dir={sweep_dir}",
                     "train.progress=false"]
        try:  # every point's config is checked before the first one trains
            load_config(config, overrides)
        except ConfigError as e:
            fail(f"grid point {pname}: {e}")
        run_dir = os.path.join(sweep_dir, pname)
        if os.path.exists(run_dir) and not overwrite:
            fail(f"{show_path(run_dir)} exists: pass --overwrite to train the sweep again, or --name for a new one")
        runs.append((pname, assignment, overrides, run_dir))
    # a sweep writes sweep.csv, sweep.md and logs/ only into a new directory or a sweep of its own
    outputs.check_adoptable(sweep_dir, "sweep", "--name a new sweep (a directory under train.run_dir)")
    jobs = min(jobs, len(runs))  # no idle workers: the threads per point come from the points run at once
    check_local_fanout(jobs, f"--jobs {jobs}")  # each point is a process of this machine
    os.makedirs(os.path.join(sweep_dir, "logs"), exist_ok=True)
    if outputs.read_marker(sweep_dir) is None:
        outputs.write_marker(sweep_dir, "sweep")
    env = dict(os.environ)
    env[LAUNCHER_ENV] = process_token()  # every point's process ends with this one, even a SIGKILLed one
    if jobs > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(intra_op_threads(jobs)[0])
    echo(f"sweep {sweep_name}: {len(runs)} point(s) of {' x '.join(f'{k} ({len(v)})' for k, v in parsed)}, "
         f"{jobs} at a time; run directories in {show_path(sweep_dir)}")

    def run_point(item) -> dict:
        pname, assignment, overrides, run_dir = item
        cmd = [sys.executable, "-m", "dlrmctl.cli", "train", config, *(a for o in overrides for a in ("--set", o))]
        if overwrite:
            cmd.append("--overwrite")
        log_path = os.path.join(sweep_dir, "logs", f"{pname}.log")
        t0 = time.perf_counter()
        if stopping:  # interrupted before this point started
            return {"point": pname, "values": dict(assignment), "status": "not run (interrupted)"}
        with open(log_path, "w") as logf:
            rc = points.run(cmd, logf, env)
        res = read_point(run_dir) if rc == 0 else None
        status = "ok" if res is not None else f"failed (exit {rc}, see {show_path(log_path)})"
        row = {"point": pname, "values": dict(assignment), "status": status, **(res or {})}
        shown = f"val {metric} {row[metric]:.4f}" if res is not None and row.get(metric) is not None else status
        echo(f"  {pname}: {shown} ({time.perf_counter() - t0:.1f}s)")
        return row

    points = PointProcesses()
    stopping: list[int] = []
    # a SIGINT or SIGTERM to this process alone (not only Ctrl-C to the whole group) stops every
    # point (SIGINT: each trainer stops and cleans up as on Ctrl-C; SIGKILL after a grace period)
    # and then the sweep, with one `error: interrupted (SIG...): ...` line (dlrmctl.cli)
    ex = ThreadPoolExecutor(max_workers=jobs)
    try:
        with interruptible():
            futures = [ex.submit(run_point, r) for r in runs]
            while not all(f.done() for f in futures):
                wait(futures, timeout=0.5)
            rows = [f.result() for f in futures]
    except KeyboardInterrupt:
        stopping.append(1)
        points.stop()
        ex.shutdown(wait=True, cancel_futures=True)
        raise
    ex.shutdown(wait=True)
    ranked = rank_rows(rows, metric)
    csv_path, md = write_summary(sweep_dir, ranked, [k for k, _ in parsed], metric)
    echo(md.rstrip("\n"))
    if ranked[0]["status"] == "ok":
        echo(f"wrote {show_path(csv_path)} and sweep.md; evaluate the chosen point once on test: "
             f"dlrmctl evaluate {shlex.quote(show_path(os.path.join(sweep_dir, ranked[0]['point'])))} --split test")
    else:
        echo(f"wrote {show_path(csv_path)} and sweep.md")
    failed = [r["point"] for r in rows if r["status"] != "ok"]
    if failed:
        fail(f"{len(failed)} of {len(rows)} point(s) failed: {', '.join(failed)}", code=1)


def register(app: typer.Typer) -> None:
    """Add ``sweep`` to the main ``dlrmctl`` app."""
    app.command("sweep", short_help="Train every point of a --grid; rank them on validation")(sweep)
