"""``dlrmctl report RUN_DIR``: summary table and PNG plots of a run's metrics.jsonl."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import typer

from dlrmctl.commands._common import echo, fail


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


def run_info(run_dir: str, evals: list[dict[str, Any]]) -> dict[str, Any]:
    """What the plots mark, from the run directory: ``name`` (config.yaml's ``name``, else the
    directory's name), ``best_step`` / ``best_metric`` (summary.json's best, else the best
    evaluation by config.yaml's ``train.keep_best``: lowest NE for ``ne``, else highest AUC;
    None without evaluations) and ``stop_step`` (the last step when summary.json says early
    stopping ended the run, else None).  Missing or unreadable files fall back silently: a
    report of a run still training has neither summary.json nor, maybe, config.yaml."""
    import yaml

    info: dict[str, Any] = {"name": os.path.basename(os.path.normpath(run_dir)), "best_step": None,
                            "best_metric": "auc", "stop_step": None}
    try:
        with open(os.path.join(run_dir, "config.yaml")) as f:
            cfg = yaml.safe_load(f) or {}
        info["name"] = str(cfg.get("name") or info["name"])
        if (cfg.get("train") or {}).get("keep_best") == "ne":
            info["best_metric"] = "ne"
    except (OSError, yaml.YAMLError, AttributeError):
        pass
    summary: dict[str, Any] = {}
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        pass
    best = summary.get("best") if isinstance(summary, dict) else None
    if isinstance(best, dict) and isinstance(best.get("step"), int):
        info["best_step"] = best["step"]
    else:
        k = info["best_metric"]
        scored = [r for r in evals if isinstance(r.get(k), (int, float)) and not math.isnan(r[k])]
        if scored:
            pick = min if k == "ne" else max
            info["best_step"] = pick(scored, key=lambda r: r[k])["step"]
    if isinstance(summary, dict) and summary.get("early_stopped") and isinstance(summary.get("steps"), int):
        info["stop_step"] = summary["steps"]
    return info


def epoch_ends(records: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """``(epoch, last step)`` of every epoch that a later record follows (epochs numbered from 1,
    as metrics.jsonl records them); the epoch-end evaluation gives the exact step."""
    last: dict[int, int] = {}
    for r in records:
        e, s = r.get("epoch"), r.get("step")
        if isinstance(e, int) and isinstance(s, int):
            last[e] = max(s, last.get(e, s))
    es = sorted(last)
    return [(e, last[e]) for e in es[:-1]]


def write_plots(run_dir: str, train: list[dict[str, Any]], evals: list[dict[str, Any]]) -> list[str]:
    """PNG plots over steps, each titled with the run's name: ``loss.png`` (training loss, mean
    since the previous point, and the validation log loss of each evaluation: the same per-sample
    binary cross-entropy), ``auc.png`` (validation AUC) and ``throughput.png`` (samples/s).  Each
    marks the epoch boundaries (dotted), the best step (the checkpoint ``best``: a star and a
    dashed line) and the step where early stopping ended the run (see :func:`run_info`); the
    PNG's ``Title`` / ``Description`` text chunks repeat the title and these marks.

    Returns:
        the paths written.

    Raises:
        ImportError: matplotlib is not installed (``pip install dlrmctl[report]``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    info = run_info(run_dir, evals)
    split = evals[-1].get("split", "val") if evals else "val"
    ends = epoch_ends(sorted(train + evals, key=lambda r: r.get("step", 0)))
    best = next((r for r in reversed(evals) if r.get("step") == info["best_step"]), None)
    loss = [(r["step"], r.get("loss_avg", r["loss"])) for r in train if r.get("loss") is not None]
    val_loss = [(r["step"], r["logloss"]) for r in evals if r.get("logloss") is not None]
    auc = [(r["step"], r["auc"]) for r in evals if r.get("auc") is not None]
    sps = [(r["step"], r["samples_per_s"]) for r in train if "samples_per_s" in r]
    # (file, title, y label, [(label, points, eval key of the best marker)])
    plots = [
        ("loss.png", "loss", "log loss", [("training (mean since previous point)", loss, None),
                                          (f"{split} log loss", val_loss, "logloss")]),
        ("auc.png", f"{split} AUC", "AUC", [(f"{split} AUC", auc, "auc")]),
        ("throughput.png", "training throughput", "samples/s", [("samples/s", sps, None)]),
    ]
    out = []
    for name, title, ylabel, series in plots:
        series = [s for s in series if s[1]]
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, pts, key in series:
            few = len(pts) < 30
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if few else None, markersize=3, label=label)
            if key and best is not None and best.get(key) is not None:
                ax.plot([best["step"]], [best[key]], marker="*", markersize=14, color="tab:red", linestyle="none",
                        label=f"best: step {best['step']} ({key} {best[key]:.4f})", zorder=5)
        for i, (e, step) in enumerate(ends):
            ax.axvline(step, color="grey", linestyle=":", linewidth=1, label="end of epoch" if i == 0 else None)
            ax.annotate(f"epoch {e}", (step, 1.0), xycoords=("data", "axes fraction"), fontsize=7, color="grey",
                        ha="right", va="top", rotation=90, xytext=(-2, -2), textcoords="offset points")
        if info["best_step"] is not None:
            ax.axvline(info["best_step"], color="tab:red", linestyle="--", linewidth=1, alpha=0.6,
                       label=None if best is not None and any(s[2] for s in series) else f"best step {info['best_step']}")
        if info["stop_step"] is not None:
            ax.axvline(info["stop_step"], color="black", linestyle="-.", linewidth=1,
                       label=f"early stop (step {info['stop_step']})")
        ax.set_title(f"{info['name']}: {title}")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
        fig.tight_layout()
        path = os.path.join(run_dir, name)
        tmp = os.path.join(run_dir, f".{name}.tmp.png")
        marks = [f"series: {', '.join(s[0] for s in series)}"]
        marks += [f"best step {info['best_step']}"] if info["best_step"] is not None else []
        marks += [f"early stop at step {info['stop_step']}"] if info["stop_step"] is not None else []
        marks += [f"epoch ends at steps {', '.join(str(st) for _, st in ends)}"] if ends else []
        # the PNG's text chunks say what it shows (Title, Description): readable without viewing it
        fig.savefig(tmp, dpi=100, metadata={"Title": f"{info['name']}: {title}", "Description": "; ".join(marks)})
        plt.close(fig)
        os.replace(tmp, path)  # a failed save leaves the previous plot
        out.append(path)
    return out


def _sweep_summary(sweep_dir: str) -> None:
    """``report SWEEP_DIR``: the sweep's ranking (its ``sweep.md``, as ``dlrmctl sweep`` wrote it) and
    how to report one point."""
    md = os.path.join(sweep_dir, "sweep.md")
    try:
        with open(md, encoding="utf-8") as f:
            text = f.read(1 << 20)
    except (OSError, UnicodeDecodeError) as e:
        fail(f"{md}: cannot read the sweep's summary: {getattr(e, 'strerror', None) or e}")
    echo(f"{sweep_dir} is a sweep; its ranking ({md}, also sweep.csv):")
    echo(text.rstrip("\n"))
    echo(f"report one point (a run directory) with `dlrmctl report {os.path.join(sweep_dir, '<point>')}`")


def register(app: typer.Typer) -> None:
    @app.command(short_help="Summary table and PNG plots of a run")
    def report(run_dir: str = typer.Argument(..., help="runs/<name>"),
               plots: bool = typer.Option(True, "--plots/--no-plots", help="write PNG plots (needs matplotlib)")) -> None:
        """Summary table and PNG plots (loss and val loss, AUC, throughput; best step, early stop, epochs) of a run."""
        path = os.path.join(run_dir, "metrics.jsonl")
        if not os.path.isfile(path) and os.path.isfile(os.path.join(run_dir, "sweep.md")):
            _sweep_summary(run_dir)
            return
        if not os.path.isfile(path):
            from dlrmctl.outputs import set_aside_hint

            fail(f"{run_dir}: no metrics.jsonl; not a training run directory, or the run has not logged yet"
                 f"{set_aside_hint(run_dir)}")
        try:
            train, evals = read_metrics(run_dir)
        except (OSError, ValueError) as e:
            fail(str(e))
        if not train and not evals:
            fail(f"{path}: empty; the run has logged nothing yet")
        typer.echo(summary_table(train, evals))
        if plots:
            try:
                for p in write_plots(run_dir, train, evals):
                    typer.echo(f"wrote {p}")
            except ImportError:
                typer.echo("matplotlib is not installed: pip install 'dlrmctl[report]' for plots", err=True)
