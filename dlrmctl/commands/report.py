"""``dlrmctl report RUN_DIR``: summary table and PNG plots of a run's metrics.jsonl."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import typer


#: fields of a metrics.jsonl record that the report formats as numbers (each a number or null)
NUMERIC_FIELDS = ("auc", "logloss", "ne", "calibration", "loss", "loss_avg", "samples_per_s")


def read_metrics(run_dir: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(train_records, eval_records)`` from ``run_dir/metrics.jsonl``.

    Every record must be a JSON object with an integer ``step``; :data:`NUMERIC_FIELDS`, when
    present, are numbers or null.

    Raises:
        FileNotFoundError: no metrics.jsonl.
        ValueError: a line that is not UTF-8, not JSON, not an object, or a field of the wrong
            type (``<path>:<line>: ...``, naming the field).
    """
    path = os.path.join(run_dir, "metrics.jsonl")
    train, evals = [], []
    with open(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{path}:{i}: not UTF-8 text; metrics.jsonl holds one JSON object a line "
                                 f"(written by dlrmctl train)") from None
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not JSON ({e})") from e
            if not isinstance(r, dict):
                raise ValueError(f"{path}:{i}: expected a JSON object (one record a line), got {type(r).__name__}")
            if isinstance(r.get("step"), bool) or not isinstance(r.get("step"), int):
                raise ValueError(f"{path}:{i}: 'step' must be an integer, got {r.get('step')!r}")
            for k in NUMERIC_FIELDS:
                v = r.get(k)
                if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                    raise ValueError(f"{path}:{i}: '{k}' must be a number or null, got {v!r}")
            (evals if r.get("kind") == "eval" else train).append(r)
    return train, evals


def summary_table(train: list[dict[str, Any]], evals: list[dict[str, Any]]) -> str:
    """Markdown table: one row per evaluation (epochs numbered from 1, as training prints them),
    then the training throughput and the last losses, each labelled for what it is: the last
    logged step's own loss (one batch) and the mean over the steps since the previous record
    (the quantity ``loss.png`` plots)."""
    lines = ["| step | epoch | AUC | logloss | NE | calibration |", "|---:|---:|---:|---:|---:|---:|"]

    def f(v: Any, nd: int = 4) -> str:
        return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{nd}f}"

    for r in evals:
        lines.append(f"| {r['step']} | {r.get('epoch', '')} | {f(r.get('auc'))} | {f(r.get('logloss'))} | "
                     f"{f(r.get('ne'))} | {f(r.get('calibration'), 3)} |")
    if train:
        sps = [r["samples_per_s"] for r in train if "samples_per_s" in r]
        lines.append("")
        lines.append(f"training: {len(train)} logged steps (every train.log_every steps)"
                     + (f", median {sorted(sps)[len(sps) // 2]:,.0f} samples/s" if sps else ""))
        last = train[-1]
        if last.get("loss") is not None:
            lines.append(f"loss of step {last['step']} alone (one batch): {f(last['loss'])}")
        if last.get("loss_avg") is not None:
            first = train[-2]["step"] + 1 if len(train) > 1 else 1
            span = f"step {first}" if first == last["step"] else f"steps {first}-{last['step']}"
            lines.append(f"mean loss over {span} (what loss.png plots): {f(last['loss_avg'])}")
    if evals:
        best = max((r for r in evals if r.get("auc") is not None), key=lambda r: r["auc"], default=None)
        if best:
            lines.append(f"best AUC {best['auc']:.4f} at step {best['step']}")
    return "\n".join(lines)


def write_plots(run_dir: str, train: list[dict[str, Any]], evals: list[dict[str, Any]]) -> list[str]:
    """PNG plots of loss, AUC and throughput over steps; returns the paths written.

    Raises:
        ImportError: matplotlib is not installed (``pip install dlrmctl[report]``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    series = [
        ("loss.png", "training loss (mean since previous point)",
         [(r["step"], r.get("loss_avg", r["loss"])) for r in train if "loss" in r]),
        ("auc.png", "validation AUC", [(r["step"], r["auc"]) for r in evals if r.get("auc") is not None]),
        ("throughput.png", "samples/s", [(r["step"], r["samples_per_s"]) for r in train if "samples_per_s" in r]),
    ]
    for name, label, pts in series:
        if not pts:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if len(pts) < 30 else None)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = os.path.join(run_dir, name)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        out.append(path)
    return out


def register(app: typer.Typer) -> None:
    @app.command()
    def report(run_dir: str = typer.Argument(..., help="runs/<name>"),
               plots: bool = typer.Option(True, "--plots/--no-plots", help="write PNG plots (needs matplotlib)")) -> None:
        """Summary table and PNG plots (loss, AUC, throughput) of a run."""
        path = os.path.join(run_dir, "metrics.jsonl")
        if not os.path.isfile(path):
            typer.echo(f"error: {run_dir}: no metrics.jsonl; not a training run directory, or the run has not "
                       "logged yet", err=True)
            raise typer.Exit(2)
        try:
            train, evals = read_metrics(run_dir)
        except (OSError, ValueError) as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2)
        if not train and not evals:
            typer.echo(f"error: {path}: empty; the run has logged nothing yet", err=True)
            raise typer.Exit(2)
        typer.echo(summary_table(train, evals))
        if plots:
            try:
                for p in write_plots(run_dir, train, evals):
                    typer.echo(f"wrote {p}")
            except ImportError:
                typer.echo("matplotlib is not installed: pip install 'dlrmctl[report]' for plots", err=True)
