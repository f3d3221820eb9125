"""``dlrmctl checkpoint``: inspect and reshard run-directory checkpoints.

``dlrmctl checkpoint reshard RUN --nproc N [--plan plan.yaml] [--out DIR] [--checkpoint best|last|STEP]``
rewrites RUN's newest (or the chosen) checkpoint for N ranks: N gloo processes on this machine
each read only their target shards' slices (DCP reads the overlapping parts of
the saved chunks) and write them, so no process ever holds more than its share
(``--nproc 1``: one process, every table whole — that is what 1 process needs).

The target plan is ``--plan`` (written by ``dlrmctl plan``), else the planner's
plan for RUN's config on N ranks (none for N = 1).  Output: ``--out DIR`` (a new
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

app = typer.Typer(help="inspect and reshard checkpoints", no_args_is_help=True)


def _fail(msg: str, code: int = 2) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code)


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
        CheckpointError / PlanError: no checkpoint, or a plan that does not fit the tables.
    """
    import yaml

    from dlrmctl.distributed.types import ShardingPlan
    from dlrmctl.train import checkpoint as ckpt

    src, _ = ckpt.resolve_checkpoint(run_dir, checkpoint or "last")
    meta = ckpt.load_checkpoint_meta(src)
    tables = [SimpleNamespace(name=n, num_embeddings=r, embedding_dim=d) for n, (r, d) in meta["tables"].items()]
    plan = None
    if plan_path:
        plan = ShardingPlan.load(plan_path)
    elif nproc > 1:
        from dlrmctl.config import config_from_dict
        from dlrmctl.planner.planner import plan_for_config

        with open(os.path.join(run_dir, "config.yaml")) as f:
            cfg = config_from_dict(yaml.safe_load(f), source=os.path.join(run_dir, "config.yaml"))
        with open(os.path.join(run_dir, "data_meta.json")) as f:
            dmeta = json.load(f)
        plan = plan_for_config(cfg, nproc, None, dmeta)
    if plan is not None:
        plan.validate(tables, nproc, where=plan_path or "plan")
    step = int(meta["step"])
    if out:
        out_run, name = out, f"step_{step:08d}"
        ckpt.copy_run_files(run_dir, out_run)
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


@app.command("reshard")
def reshard_command(
    run_dir: str = typer.Argument(..., help="training run directory (runs/<name>)"),
    nproc: int = typer.Option(..., "--nproc", help="ranks of the target job"),
    plan: Optional[str] = typer.Option(None, "--plan", help="target sharding plan (dlrmctl plan); default: the planner's"),
    out: Optional[str] = typer.Option(None, "--out", help="new run directory (default: a new checkpoint in RUN_DIR)"),
    checkpoint: str = typer.Option("last", "--checkpoint", help="the checkpoint to reshard: best | last | <step> | <name, e.g. step_00000080.1>"),
) -> None:
    """Rewrite a checkpoint of RUN_DIR (the newest by default) for NPROC ranks (and PLAN); weights and moments are copied exactly."""
    from dlrmctl.train.checkpoint import load_checkpoint_meta
    from dlrmctl.train.checkpoint import latest_checkpoint as ckpt_latest

    if nproc < 1:
        _fail("--nproc must be >= 1")
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


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="checkpoint")
