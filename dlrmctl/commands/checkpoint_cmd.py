"""``dlrmctl checkpoint``: inspect and reshard run-directory checkpoints.

``dlrmctl checkpoint inspect RUN [--checkpoint best|last|STEP|NAME] [--verify]`` lists RUN's
checkpoints (step, time saved, size, saving world size and plan, the validation metrics recorded
at that step, which one ``LATEST`` / ``BEST`` names, integrity), or describes the chosen one.  It
reads only meta.json files, metrics.jsonl and file sizes (``--verify``: also every checksum
block of the data files).

``dlrmctl checkpoint reshard RUN --nproc N [--plan plan.yaml] [--out DIR] [--checkpoint best|last|STEP]``
rewrites RUN's newest (or the chosen) checkpoint for N ranks: N gloo processes on this machine
each read only their target shards' slices (DCP reads the overlapping parts of
the saved chunks) and write them, so no process ever holds more than its share
(``--nproc 1``: one process, every table whole — that is what 1 process needs).

The target plan is ``--plan`` (written by ``dlrmctl plan``), else the planner's
plan for RUN's config on N ranks (none for N = 1); managed-collision tables are laid out as
training shards them, row_wise by zone (:mod:`dlrmctl.distributed.sharded_mc`; their ``mc/``
remapper entries are the same at any world size and are copied), and a reshard to N ranks that
cannot shard them (``buckets`` not a multiple of N) is refused before any rank starts.  Output: ``--out DIR`` (a new
run directory: config, data meta, plan.yaml and the checkpoint), else a new
checkpoint ``step_XXXXXXXX_wsN`` in RUN that becomes its ``LATEST``.

Every checkpoint already loads into any world size or plan (``dlrmctl train
--resume --nproc N`` works directly); resharding offline makes the files match
the new layout, so each rank of the resumed job reads one file.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Optional

import typer

from dlrmctl.commands._common import fail, require_run_dir

app = typer.Typer(help="Inspect and reshard checkpoints", no_args_is_help=True)


def _reshard_rank(env, src: str, out_run: str, plan_dict: dict | None, name: str, publish_latest: bool) -> str:
    """One rank of ``reshard`` (:func:`~dlrmctl.distributed.local_ranks.run_local_ranks`)."""
    from dlrmctl.distributed.types import ShardingPlan
    from dlrmctl.train.checkpoint import reshard_rank

    plan = None if plan_dict is None else ShardingPlan.from_dict(plan_dict)
    return reshard_rank(src, out_run, env.rank, env.world_size, plan, name=name, publish_latest=publish_latest)


def reshard(run_dir: str, nproc: int, plan_path: str | None = None, out: str | None = None,
            checkpoint: str | None = "last") -> str:
    """Reshard a checkpoint of ``run_dir`` (``checkpoint``: ``last``, ``best`` or a step) for ``nproc``
    ranks; returns the new checkpoint directory.

    Raises:
        CheckpointError / PlanError: no checkpoint, or a plan that does not fit the tables; the
            chosen checkpoint was pruned by the run while it was read (after one re-resolve of
            best / last, see :func:`dlrmctl.train.checkpoint.read_checkpoint`).
    """
    from dlrmctl.train import checkpoint as ckpt

    # read_checkpoint: a source the run prunes (keep_last) meanwhile is re-resolved / named as pruned
    return ckpt.read_checkpoint(run_dir, checkpoint or "last",
                                lambda src, _label: _reshard_from(run_dir, src, nproc, plan_path, out))


def _reshard_from(run_dir: str, src: str, nproc: int, plan_path: str | None, out: str | None) -> str:
    """:func:`reshard` of the resolved checkpoint directory ``src``."""
    from dlrmctl.distributed.types import ShardingPlan
    from dlrmctl.train import checkpoint as ckpt

    meta = ckpt.load_checkpoint_meta(src)
    tables = [SimpleNamespace(name=n, num_embeddings=r, embedding_dim=d) for n, (r, d) in meta["tables"].items()]
    plan = None
    cfg = dmeta = None
    cpath = os.path.join(run_dir, "config.yaml")
    if nproc > 1 and (not plan_path or os.path.isfile(cpath)):  # the run's config: planner, managed collision
        from dlrmctl.config import check_managed_collision_sharding, config_from_dict, managed_collision_tables
        from dlrmctl.yaml_file import read_yaml

        cfg = config_from_dict(read_yaml(cpath, ckpt.CheckpointError, "run's recorded config"), source=cpath)
        with open(os.path.join(run_dir, "data_meta.json")) as f:
            dmeta = json.load(f)
        check_managed_collision_sharding(cfg, dmeta, nproc, trained=True)  # before any rank starts
    if plan_path:
        plan = ShardingPlan.load(plan_path)
    elif nproc > 1:
        from dlrmctl.planner.planner import plan_for_config

        plan = plan_for_config(cfg, nproc, None, dmeta)
    if plan is not None and cfg is not None:
        managed = [t for t in tables if t.name in managed_collision_tables(cfg, dmeta)]
        if managed:  # as training lays them out: row_wise by zone (dlrmctl.distributed.sharded_mc)
            from dlrmctl.distributed.sharded_mc import managed_collision_plan

            plan = managed_collision_plan(plan, managed, cfg.model.compute_kernel)
    if plan is not None:
        plan.validate(tables, nproc, where=plan_path or "plan")
    step = int(meta["step"])
    if out:
        out_run, name = out, f"step_{step:08d}"
        ckpt.copy_run_files(run_dir, out_run)
        from dlrmctl import outputs

        if outputs.read_marker(out_run) is None:  # a run directory dlrmctl made (--overwrite may replace it)
            outputs.write_marker(out_run, "run")
        if plan is not None:
            plan.save(os.path.join(out_run, "plan.yaml"))
    else:
        out_run, name = run_dir, f"step_{step:08d}_ws{nproc}"
    # in the same run, a reshard of an older checkpoint (e.g. --checkpoint best) is written beside
    # the newer ones without moving LATEST backwards (`--resume --checkpoint <step>` picks it)
    latest = ckpt.latest_checkpoint(run_dir) if not out else None
    publish = bool(out) or latest is None or step >= int(ckpt.load_checkpoint_meta(latest)["step"])
    if nproc == 1:
        path = ckpt.reshard_rank(src, out_run, 0, 1, plan, name=name, publish_latest=publish)
    else:
        from dlrmctl.distributed.local_ranks import LocalRanksError, run_local_ranks

        pd = None if plan is None else plan.to_dict()
        try:
            path = run_local_ranks(_reshard_rank, nproc, (src, out_run, pd, name, publish), what="reshard")[0]
        except LocalRanksError as e:
            raise ckpt.CheckpointError(str(e)) from None
    _carry_best(run_dir, src, out, path)
    return path


def _carry_best(run_dir: str, src: str, out: str | None, path: str) -> None:
    """A reshard ``--out`` of the run's best checkpoint is the new run's ``BEST`` too (its
    meta.json carries the evaluation that made it the best), so ``evaluate`` / ``export`` of the
    new run, and training resumed there, keep using it.  In place, ``BEST`` already names the
    source checkpoint, which every world size reads."""
    from dlrmctl.train import checkpoint as ckpt

    if not out:
        return
    try:  # a BEST naming a pruned / missing checkpoint: nothing to carry (the reshard itself is done)
        best = ckpt.best_checkpoint(run_dir)
    except ckpt.CheckpointError:
        return
    if best is None:
        return
    # the source, or the in-place reshard copy of the best (step_S_wsN, which `--checkpoint S` / `last`
    # may select) that records the best checkpoint as its source
    seen, cur = 0, src
    while cur and seen < 8:
        if os.path.realpath(cur) == os.path.realpath(best):
            ckpt.mark_best(out, path)
            return
        try:
            cur = (ckpt.load_checkpoint_meta(cur).get("resharded_from") or {}).get("checkpoint")
        except ckpt.CheckpointError:
            return
        seen += 1


def _plan_text(meta: dict) -> str:
    """``"table_wise 20, row_wise 6"`` (tables per sharding type) from meta.json's plan; ``"none"``
    without one (every table whole in each process)."""
    from collections import Counter

    plan = meta.get("plan")
    if not isinstance(plan, dict) or not isinstance(plan.get("tables"), dict):
        return "none"
    kinds = Counter(str((t or {}).get("sharding_type", "?")) for t in plan["tables"].values())
    return ", ".join(f"{k} {n}" for k, n in kinds.most_common())


def _recorded_evals(run_dir: str) -> dict[int, dict]:
    """The last evaluation record per step in ``run_dir/metrics.jsonl`` (``{}`` when there is none;
    unreadable lines are skipped: this is a listing, the file is the trainer's log)."""
    out: dict[int, dict] = {}
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                if isinstance(r, dict) and r.get("kind") == "eval" and isinstance(r.get("step"), int):
                    out[r["step"]] = r
    except OSError:
        pass
    return out


def _fmt_bytes(n: int) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= k:
            return f"{n / k:,.1f} {unit}"
    return f"{n} B"


def checkpoint_rows(run_dir: str, verify: bool = False, only: str | None = None) -> list[dict]:
    """One dict per checkpoint directory of ``run_dir`` (``only``: that directory), oldest first:
    ``name, path, step`` (None when meta.json is unreadable), ``saved`` (meta.json's mtime, local
    time text), ``bytes`` (recorded sizes of its files), ``world_size``, ``plan`` (text),
    ``markers`` (``["LATEST", "BEST"]`` subset), ``eval`` (metrics recorded at its step: meta.json's
    ``eval``, else the run's metrics.jsonl; None), ``ok`` / ``integrity`` (:func:`check_integrity`),
    and ``meta`` (meta.json, None when unreadable).  Reads no data file unless ``verify``."""
    import glob
    import time

    from dlrmctl.train import checkpoint as ckpt

    root = ckpt.checkpoint_root(run_dir)
    marks: dict[str, list[str]] = {}
    for marker in (ckpt.LATEST, ckpt.BEST):
        try:
            with open(os.path.join(root, marker)) as f:
                marks.setdefault(f.read().strip(), []).append(marker)
        except OSError:
            pass
    evals = _recorded_evals(run_dir)
    dirs = [only] if only else sorted(d for d in glob.glob(os.path.join(root, "step_*")) if os.path.isdir(d))
    rows = []
    for d in dirs:
        name = os.path.basename(os.path.normpath(d))
        ok, integrity = ckpt.check_integrity(d, verify=verify)
        try:
            meta = ckpt.load_checkpoint_meta(d)
        except ckpt.CheckpointError:
            meta = None
        mp = os.path.join(d, "meta.json")
        saved = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(os.path.getmtime(mp))) if os.path.exists(mp) else "-"
        step = None if meta is None else int(meta["step"])
        ev = None if meta is None else meta.get("eval")
        if not isinstance(ev, dict) or ev.get("step") != step:
            ev = evals.get(step) if step is not None else None
        rows.append({
            "name": name, "path": d, "step": step, "saved": saved, "meta": meta,
            "bytes": None if meta is None else sum(int(f["bytes"]) for f in meta["files"].values()),
            "world_size": None if meta is None else meta.get("world_size"),
            "plan": "-" if meta is None else _plan_text(meta),
            "markers": marks.get(name, []), "eval": ev, "ok": ok, "integrity": integrity,
        })
    return rows


def inspect(run_dir: str, checkpoint: str | None = None, verify: bool = False) -> int:
    """Print the checkpoints of ``run_dir`` (a table; ``checkpoint``: the details of the one
    ``--checkpoint`` selects, see :func:`~dlrmctl.train.checkpoint.resolve_checkpoint`).

    Returns:
        the exit code: 0, or 1 when a checkpoint shown failed its integrity check.

    Raises:
        CheckpointError: no run directory / no checkpoint, or ``checkpoint`` selects none.
    """
    import glob

    from dlrmctl.commands._common import echo, show_path
    from dlrmctl.train import checkpoint as ckpt

    if not os.path.isdir(run_dir):
        raise ckpt.CheckpointError(f"{run_dir}: no such run directory (expected runs/<name> written by "
                                   "`dlrmctl train`)")
    root = ckpt.checkpoint_root(run_dir)
    if checkpoint is not None:
        path, label = ckpt.resolve_checkpoint(run_dir, checkpoint)
        r = checkpoint_rows(run_dir, verify, only=path)[0]
        m = r["meta"]
        echo(f"{show_path(path)}: {label}" + (f"  [{', '.join(r['markers'])}]" if r["markers"] else ""))
        echo(f"  saved        {r['saved']}")
        echo(f"  size         {r['bytes']:,} bytes in {len(m['files'])} files")
        echo(f"  world size   {r['world_size']}")
        echo(f"  plan         {r['plan']}" + (" (every table whole in each process)" if r["plan"] == "none" else ""))
        echo(f"  tables       {len(m.get('tables', {}))} ({sum(a * b for a, b in m.get('tables', {}).values()):,} "
             f"embedding parameters)")
        echo(f"  optimizer    {m.get('embedding_optimizer', '-')} (embeddings)")
        if isinstance(m.get("precision"), dict):
            echo("  precision    " + ", ".join(f"{k} {v}" for k, v in m["precision"].items()))
        src = m.get("resharded_from")
        if isinstance(src, dict):
            echo(f"  resharded    from {src.get('checkpoint')} ({src.get('world_size')} rank(s))")
        ev = r["eval"]
        if ev:
            echo(f"  {ev.get('split', 'val')} metrics  " + "  ".join(
                f"{k} {ev[k]:.4f}" for k in ("auc", "logloss", "ne", "calibration", "accuracy")
                if isinstance(ev.get(k), float)) + (f"  (n={ev['num_samples']})" if "num_samples" in ev else ""))
        else:
            echo("  metrics      none recorded at this step")
        echo(f"  integrity    {r['integrity']}")
        return 0 if r["ok"] else 1
    from dlrmctl.outputs import set_aside_hint

    rows = checkpoint_rows(run_dir, verify)
    stale = sorted(os.path.basename(p) for p in glob.glob(os.path.join(root, ".step_*.tmp")))
    if not rows:
        raise ckpt.CheckpointError(f"{run_dir}: no checkpoint ({root} holds none"
                                   + (f"; {', '.join(stale)} is a save that was interrupted" if stale else "")
                                   + "); `dlrmctl train` writes them (train.checkpoint_every, and at the end)"
                                   + set_aside_hint(run_dir))
    total = sum(r["bytes"] or 0 for r in rows)
    echo(f"{show_path(run_dir)}: {len(rows)} checkpoint(s), {_fmt_bytes(total)}")
    pw = max(4, *(len(r["plan"]) for r in rows))
    head = f"  {'name':<20} {'step':>7}  {'saved':<19}  {'size':>9}  {'ranks':>5}  {'plan':<{pw}}  " \
           f"{'val AUC':>7}  {'logloss':>7}  marks"
    echo(head)
    bad = []
    for r in rows:
        ev = r["eval"] or {}
        auc = f"{ev['auc']:.4f}" if isinstance(ev.get("auc"), float) else "-"
        ll = f"{ev['logloss']:.4f}" if isinstance(ev.get("logloss"), float) else "-"
        marks = ", ".join(r["markers"])
        if not r["ok"]:
            bad.append(r)
            marks = (marks + ", " if marks else "") + "DAMAGED"
        echo(f"  {r['name']:<20} {'-' if r['step'] is None else r['step']:>7}  {r['saved']:<19}  "
             f"{'-' if r['bytes'] is None else _fmt_bytes(r['bytes']):>9}  {r['world_size'] or '-':>5}  "
             f"{r['plan']:<{pw}}  {auc:>7}  {ll:>7}  {marks}")
    for marked in (ckpt.latest_checkpoint, ckpt.best_checkpoint):
        try:
            marked(run_dir)
        except ckpt.CheckpointError as e:  # a marker naming a missing checkpoint
            echo(f"warning: {e}", err=True)
    for name in stale:
        echo(f"note: {name} in {show_path(root)} is a save that was interrupted (ignored; the next save removes it)")
    for r in bad:
        echo(f"integrity {r['name']}: {r['integrity']}", err=True)
    if not bad:
        echo("integrity: " + ("every block of every checkpoint verified" if verify else
                              "all files present with their recorded sizes (--verify reads and checks every block)"))
    return 1 if bad else 0


@app.command("inspect", short_help="List the checkpoints of RUN_DIR with their metrics")
def inspect_command(
    run_dir: str = typer.Argument(..., help="training run directory (runs/<name>)"),
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint",
                                             help="describe one: best | last | <step> | <name, e.g. step_00000080.1>"),
    verify: bool = typer.Option(False, "--verify", help="also read every data file and check each block's CRC-32"),
) -> None:
    """List the checkpoints of RUN_DIR: step, time, size, world size, plan, val metrics, LATEST / BEST, integrity."""
    require_run_dir(run_dir)
    code = inspect(run_dir, checkpoint, verify)  # user errors: reported by dlrmctl.cli
    if code:
        raise typer.Exit(code)


@app.command("reshard", short_help="Rewrite a checkpoint of RUN_DIR for NPROC ranks")
def reshard_command(
    run_dir: str = typer.Argument(..., help="training run directory (runs/<name>)"),
    nproc: int = typer.Option(..., "--nproc", min=1, help="ranks of the target job"),
    plan: Optional[str] = typer.Option(None, "--plan", help="target sharding plan (dlrmctl plan); default: the planner's"),
    out: Optional[str] = typer.Option(None, "--out", help="new run directory (default: a new checkpoint in RUN_DIR)"),
    checkpoint: str = typer.Option("last", "--checkpoint", help="the checkpoint to reshard: best | last | <step> | <name, e.g. step_00000080.1>"),
) -> None:
    """Rewrite a checkpoint of RUN_DIR (the newest by default) for NPROC ranks (and PLAN); weights and moments are copied exactly."""
    from dlrmctl.procs import check_local_fanout

    # the reshard runs --nproc local processes
    check_local_fanout(nproc, f"--nproc {nproc}", "or reshard on the cluster that will train it")
    require_run_dir(run_dir)  # before torch
    from dlrmctl.train.checkpoint import load_checkpoint_meta
    from dlrmctl.train.checkpoint import latest_checkpoint as ckpt_latest
    if out and os.path.lexists(out) and (not os.path.isdir(out) or os.listdir(out)):
        # --out makes a new run directory: never one that holds anything (another run, a user's files)
        fail(f"--out {out}: exists and is not empty; the resharded copy goes to a new directory "
              "(--out a new path), or omit --out to add the checkpoint to the run itself")
    path = reshard(run_dir, nproc, plan, out, checkpoint)  # user errors: reported by dlrmctl.cli
    m = load_checkpoint_meta(path)
    src = m.get("resharded_from", {})
    nbytes = sum(f["bytes"] for f in m["files"].values())
    typer.echo(f"resharded step {m['step']} from {src.get('world_size')} to {m['world_size']} rank(s): {path} "
               f"({len(m['tables'])} tables, {nbytes:,} bytes)")
    if src.get("bytes"):
        typer.echo(f"read {src['bytes_read']:,} bytes of the {src['bytes']:,}-byte source checkpoint "
                   f"({src['bytes_read'] / src['bytes']:.2f}x; per rank {src['bytes_read_per_rank']})")
    latest = ckpt_latest(os.path.dirname(os.path.dirname(path)))
    if latest is not None and os.path.abspath(latest) != os.path.abspath(path):
        typer.echo(f"LATEST still names {os.path.basename(latest)} (a newer step); resume from this one with "
                   f"`train --resume --checkpoint {m['step']}`")
    elif latest is not None:  # say it: `train --resume` of the run now continues from the new layout
        run = os.path.dirname(os.path.dirname(path))
        if out:  # its config.yaml is the source run's (name, run_dir): resuming needs them pointed here
            parent, name = os.path.split(os.path.abspath(run))
            typer.echo(f"{run} is a new run directory holding the source run's config.yaml; resume it with "
                       f"`dlrmctl train {os.path.join(run, 'config.yaml')} --resume --nproc {m['world_size']} "
                       f"--set name={name} --set train.run_dir={parent}` (without the two --set, train resumes "
                       "the source run)")
        else:
            typer.echo(f"LATEST of {run} now names {os.path.basename(path)}: `train --resume` continues from it "
                       f"with --nproc {m['world_size']}; --out DIR writes the copy to a new run directory instead")


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="checkpoint")
