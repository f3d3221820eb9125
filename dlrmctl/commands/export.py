"""``dlrmctl export`` and ``dlrmctl predict``: ship a trained run as an inference artifact and
score raw logs with it.  The lead's ``dlrmctl/cli.py`` calls :func:`register`;
``dlrmctl evaluate MODEL_DIR`` goes to :func:`dlrmctl.inference.export.evaluate_exported`.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Optional

import typer

from dlrmctl.commands._common import fail, require_run_dir
from dlrmctl.commands.options import CheckpointChoice
from dlrmctl.errors import UserError, interrupt_exit_code


def export_command(
    run_dir: Path = typer.Argument(..., help="training run directory (runs/<name>)"),
    int8: bool = typer.Option(False, "--int8", help="row-wise int8 embeddings (fp16 scale + bias per row); the default"),
    int4: bool = typer.Option(False, "--int4", help="row-wise int4 embeddings (fp16 scale + bias per row)"),
    fp16: bool = typer.Option(False, "--fp16", help="fp16 embeddings"),
    fp32: bool = typer.Option(False, "--fp32", help="fp32 embeddings (reference artifact)"),
    quantize_dense: bool = typer.Option(False, "--quantize-dense", help="dynamic int8 nn.Linear layers in the MLPs (needs --torchscript: torch.export cannot trace them)"),
    out: Optional[Path] = typer.Option(None, "--out", help="artifact directory (default: RUN_DIR/export-<dtype>)"),
    data: Optional[Path] = typer.Option(None, "--data", help="preprocessed data dir holding the vocabularies (default: the run's data.path)"),
    force: bool = typer.Option(False, "--force", help="replace an existing artifact directory"),
    checkpoint: CheckpointChoice = None,
    torchscript: bool = typer.Option(False, "--torchscript", help="legacy TorchScript model.pt on FBGEMM's IntNBit TBE "
                                                                  "instead of the torch.export model.pt2"),
    aot: bool = typer.Option(False, "--aot", help="also an AOTInductor package (model_aoti.pt2) for C++ "
                                                  "(AOTIModelPackageLoader); compiles for tens of seconds"),
    parity_split: str = typer.Option("val", "--parity-split", help="split of --data for the parity report"),
) -> None:
    """Export a checkpoint of RUN_DIR (the best by default) as a torch.export program (model.pt2) + manifest.json,
    with int8 embeddings unless --int4, --fp16 or --fp32 says otherwise."""
    chosen = [n for n, f in (("int8", int8), ("int4", int4), ("fp16", fp16), ("fp32", fp32)) if f] or ["int8"]
    if len(chosen) != 1:
        fail(f"choose one of --int8 (the default), --int4, --fp16, --fp32; got {', '.join('--' + c for c in chosen)}")
    if aot and torchscript:
        fail("--aot compiles the torch.export program; drop --torchscript (or --aot)")
    if quantize_dense and not torchscript:  # before the first line: options alone decide it
        from dlrmctl.inference.artifact import QUANTIZE_DENSE_NEEDS_TORCHSCRIPT

        fail(QUANTIZE_DENSE_NEEDS_TORCHSCRIPT)
    require_run_dir(run_dir)  # before torch: a mistyped run name answers in seconds
    # before torch: an existing --out without --force (export_run checks it again, and what --force may replace)
    target = out if out is not None else run_dir / (f"export-{chosen[0]}" + ("-dq" if quantize_dense else ""))
    if not force and os.path.lexists(target) and os.path.isdir(run_dir):
        from dlrmctl import outputs

        if outputs.kind_of(target) == "run":
            fail(f"{target} is a training run directory, not an export; --out another directory "
                  "(--force never replaces a run)")
        fail(f"{target} already exists; pass --force to replace it or --out another directory")
    from dlrmctl.commands._common import checkpoint_choice, show_path
    from dlrmctl.console import stage, stages

    with stages("export"):  # a line per step with its start time: tracing and --aot's compile take minutes
        # the first line before torch is imported and the checkpoint read (seconds on a loaded machine)
        stage(f"exporting {show_path(run_dir)}, checkpoint {checkpoint_choice(run_dir, checkpoint)}, "
              f"{chosen[0]} embeddings, to {show_path(target)}")
        from dlrmctl.inference.export import export_run

        started = time.time()
        try:
            res = export_run(run_dir, chosen[0], out, data_dir=data, quantize_dense=quantize_dense, force=force,
                             checkpoint=checkpoint, artifact="torchscript" if torchscript else "pt2", aot=aot,
                             parity_split=parity_split)
            stage("done")
        except RuntimeError as e:  # fbgemm_gpu missing (user errors: dlrmctl.cli reports them)
            if isinstance(e, UserError):
                raise
            fail(str(e))
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (dlrmctl.cli): say what stopped and what is left
            import signal

            if _written_since(target, started):  # the signal came after the export was in place
                fail(f"interrupted ({signal.Signals(interrupt_exit_code(e) - 128).name}) after the export of "
                     f"{show_path(run_dir)} had finished: {show_path(target)} is complete",
                     code=interrupt_exit_code(e))
            fail(f"interrupted ({signal.Signals(interrupt_exit_code(e) - 128).name}): the export of "
                 f"{show_path(run_dir)} to {show_path(target)} stopped; an export is renamed into place only "
                 f"when complete (what {show_path(target)} held before stays until then): run the same command "
                 "again", code=interrupt_exit_code(e))
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
    for rel, rec in (m.get("files") or {}).items():
        typer.echo(f"  {rel:<14} {rec['bytes']:,} bytes")
    _print_parity(m.get("parity") or {})


def _written_since(target: Path, t0: float) -> bool:
    """``target`` holds an export whose manifest was written at or after ``t0`` (epoch seconds):
    this command's export, renamed into place."""
    from dlrmctl.inference.artifact import MANIFEST_FILE

    try:
        return os.path.getmtime(target / MANIFEST_FILE) >= t0 - 1.0  # (file-system timestamp granularity)
    except OSError:
        return False


def _print_parity(p: dict) -> None:
    """The parity report (manifest["parity"]) as a few lines."""
    if p.get("artifact"):
        line = f"  parity       {p['split']} ({p['rows']:,} rows): AUC {p['artifact']['auc']:.6f}, logloss {p['artifact']['logloss']:.6f}"
        if p.get("float"):
            line += (f"; float AUC {p['float']['auc']:.6f}, logloss {p['float']['logloss']:.6f}; "
                     f"max |dlogit| {p['max_abs_dlogit']:.3g}")
        typer.echo(line)
    lat = p.get("latency_ms") or {}
    if lat:
        typer.echo("  latency ms   " + ", ".join(f"B={b}: p50 {v['p50']:.3f} p99 {v['p99']:.3f}" for b, v in lat.items())
                   + f" (synthetic ids, {p.get('threads')} intra-op threads, ~1 s per batch size under this "
                     "machine's current load: a check, not a benchmark)")
    if p.get("note"):
        typer.echo(f"  note         {p['note']}")


def predict_command(
    model_dir: Path = typer.Argument(..., help="exported model directory (dlrmctl export)"),
    input: Path = typer.Option(..., "--input", help="raw rows in the training data's format (Criteo: 40 fields with label, or 39; a schema dataset: its log format)"),
    output: Optional[Path] = typer.Option(None, "--output", help="scores CSV (default: stdout)"),
    batch_rows: int = typer.Option(65536, "--batch-rows", help="rows scored per batch (>= 1)"),
    force: bool = typer.Option(False, "--force", help="replace an existing --output file"),
    artifact: Optional[str] = typer.Option(None, "--artifact", help="aoti | pt2 | torchscript (default: the fastest "
                                           "for a whole file the export holds that runs on --device: pt2, "
                                           "else aoti, else torchscript)"),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda[:i] | auto (cuda when a GPU is visible)"),
) -> None:
    """Score raw log lines with the same preprocessing as training; writes a row,[label,]score CSV (and metrics if labelled)."""
    if batch_rows < 1:
        fail(f"--batch-rows must be >= 1 (rows scored per batch), got {batch_rows}")
    if os.path.exists(input) and not os.path.isdir(input) and not os.path.isfile(input):
        fail(f"--input {input}: not a regular file (a device or a FIFO is never read to its end); give a raw log "
              "file")
    if output is not None and str(output) != "-":
        out_real, model_real = os.path.realpath(output), os.path.realpath(model_dir)
        if out_real == os.path.realpath(input) or out_real.startswith(model_real + os.sep):
            fail(f"--output {output}: is the input or inside the exported model {model_dir}; write the scores "
                  "to another file")
        from dlrmctl import outputs

        outputs.check_file_replaceable(output, "scores CSV", outputs.is_scores_csv, force=force, option="--output",
                                       inputs=(input,))
    from dlrmctl.inference.raw_input import check_predict_input

    check_predict_input(model_dir, input)  # the input's kind and first line, before torch and the model load
    from dlrmctl.inference.formats import resolve_device
    from dlrmctl.inference.predict import predict_file

    err = output is None or str(output) == "-"
    try:
        rep = predict_file(model_dir, input, output, batch_rows, force=force, device=resolve_device(device),
                           artifact=artifact, announce=lambda what: typer.echo(f"predict: running {what}", err=err))
    except RuntimeError as e:
        if isinstance(e, UserError):
            raise
        fail(str(e))
    typer.echo(f"scored {rep.rows} lines" + ("" if err else f" -> {rep.output}"), err=err)
    for line in rep.oov_warnings():
        typer.echo(f"warning: {line}", err=True)
    if rep.metrics:
        for k in ("auc", "logloss", "ne"):
            v = rep.metrics[k]
            typer.echo(f"  {k:<8} {v:.6f}" if not math.isnan(v) else f"  {k:<8} nan", err=err)


def register(app: typer.Typer) -> None:
    """Add ``export`` and ``predict`` to the main ``dlrmctl`` app."""
    app.command("export", short_help="Export a checkpoint as a torch.export program + manifest")(export_command)
    app.command("predict", short_help="Score raw log lines with the training preprocessing")(predict_command)
