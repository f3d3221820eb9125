"""``dlrmctl export`` and ``dlrmctl predict``: ship a trained run as an inference artifact and
score raw logs with it.  The lead's ``dlrmctl/cli.py`` calls :func:`register`;
``dlrmctl evaluate MODEL_DIR`` goes to :func:`dlrmctl.inference.export.evaluate_exported`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import typer


def _fail(msg: str, code: int = 2) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code)


def _user_errors() -> tuple[type[BaseException], ...]:
    from dlrmctl.data.columnar import DataError
    from dlrmctl.data.fingerprint import DataMismatchError
    from dlrmctl.inference.export import ExportError
    from dlrmctl.inference.quantize import QuantizationError
    from dlrmctl.train.checkpoint import CheckpointError
    from dlrmctl.train.run_dir import TrainError

    return (ExportError, QuantizationError, DataError, DataMismatchError, CheckpointError, TrainError, FileNotFoundError)


def export_command(
    run_dir: Path = typer.Argument(..., help="training run directory (runs/<name>)"),
    int8: bool = typer.Option(False, "--int8", help="row-wise int8 embeddings (fp16 scale + bias per row)"),
    int4: bool = typer.Option(False, "--int4", help="row-wise int4 embeddings (fp16 scale + bias per row)"),
    fp16: bool = typer.Option(False, "--fp16", help="fp16 embeddings"),
    fp32: bool = typer.Option(False, "--fp32", help="fp32 embeddings (reference artifact)"),
    quantize_dense: bool = typer.Option(False, "--quantize-dense", help="dynamic int8 nn.Linear layers in the MLPs"),
    out: Optional[Path] = typer.Option(None, "--out", help="artifact directory (default: RUN_DIR/export-<dtype>)"),
    data: Optional[Path] = typer.Option(None, "--data", help="preprocessed data dir holding the vocabularies (default: the run's data.path)"),
    force: bool = typer.Option(False, "--force", help="replace an existing artifact directory"),
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint", help="best | last | <step> | <name> (default: best when "
                                                                         "the run kept one, else last)"),
) -> None:
    """Export a checkpoint of RUN_DIR (the best by default) as TorchScript + manifest.json, embeddings on FBGEMM's IntNBit TBE."""
    chosen = [n for n, f in (("int8", int8), ("int4", int4), ("fp16", fp16), ("fp32", fp32)) if f]
    if len(chosen) != 1:
        _fail("choose exactly one of --int8, --int4, --fp16, --fp32")
    from dlrmctl.inference.export import export_run

    try:
        res = export_run(run_dir, chosen[0], out, data_dir=data, quantize_dense=quantize_dense, force=force,
                         checkpoint=checkpoint)
    except _user_errors() as e:
        _fail(str(e))
    except RuntimeError as e:  # fbgemm_gpu missing
        _fail(str(e))
    from dlrmctl.commands._common import show_path

    m = res.manifest
    src = m.get("source") or {}
    ev = src.get("metrics") or {}
    at = f", val AUC {ev['auc']:.4f}" if isinstance(ev.get("auc"), float) and ev.get("step") is not None else ""
    typer.echo(f"exported {show_path(run_dir)}, checkpoint {src.get('checkpoint_choice', 'last')}{at} -> "
               f"{show_path(res.model_dir)}")
    typer.echo(f"  embeddings   {m['quantization']['embeddings']} ({len(m['tables'])} tables, "
               f"{res.embedding_bytes:,} bytes = {res.embedding_bytes / max(res.embedding_bytes_fp32, 1):.3f}x fp32 "
               f"{res.embedding_bytes_fp32:,})")
    typer.echo(f"  dense        {m['quantization']['dense']}")
    typer.echo(f"  model.pt     {m['model_bytes']:,} bytes")


def predict_command(
    model_dir: Path = typer.Argument(..., help="exported model directory (dlrmctl export)"),
    input: Path = typer.Option(..., "--input", help="raw log file (Criteo: 40 fields with label, or 39)"),
    output: Optional[Path] = typer.Option(None, "--output", help="scores CSV (default: stdout)"),
    batch_rows: int = typer.Option(65536, "--batch-rows", help="rows scored per batch"),
) -> None:
    """Score raw log lines with the same preprocessing as training; writes a row,[label,]score CSV (and metrics if labelled)."""
    from dlrmctl.inference.predict import predict_file

    try:
        rep = predict_file(model_dir, input, output, batch_rows)
    except _user_errors() as e:
        _fail(str(e))
    except RuntimeError as e:
        _fail(str(e))
    err = output is None or str(output) == "-"
    typer.echo(f"scored {rep.rows} lines" + ("" if err else f" -> {rep.output}"), err=err)
    if rep.metrics:
        for k in ("auc", "logloss", "ne"):
            v = rep.metrics[k]
            typer.echo(f"  {k:<8} {v:.6f}" if not math.isnan(v) else f"  {k:<8} nan", err=err)


def register(app: typer.Typer) -> None:
    """Add ``export`` and ``predict`` to the main ``dlrmctl`` app."""
    app.command("export")(export_command)
    app.command("predict")(predict_command)
