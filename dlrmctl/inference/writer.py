"""Writing an export directory: its ``manifest.json`` and files, atomically.

:func:`build_manifest` describes what a format built; :func:`write_artifact` writes the
vocabularies, the format's model file (and the AOTInductor package with ``--aot``) and the
manifest into a temporary sibling of the output (:func:`atomic_dir`), recording every model file's
size and SHA-256, and swaps it in -- so a crash never leaves a half-written ``model_dir`` and
nothing replaces what dlrmctl did not write (:mod:`dlrmctl.outputs`).

MANIFEST (``manifest.json``, ``format_version`` 1)::

    {"format_version": 1, "artifact": "pt2" | "torchscript", "model_file": "model.pt2",
     "model_bytes": n, "model_sha256": "...", "files": {file: {"bytes", "sha256"}},
     "aoti_package": "model_aoti.pt2" | null,
     "inputs": {"dense", "values", "lengths"[, "weights"]: {"shape", "dtype", ...}}, "output": {...},
     "dynamic": ..., "in_program": [...],           # the format's (Format.manifest_fields)
     "dense_features": ["I1", ...], "sparse_features": ["C1", ...],     # input order
     "weighted_features": ["C1", ...],    # features whose per-id weights are used ([]: no weights input)
     "tables": [{"name", "features", "num_embeddings", "embedding_dim", "stored_dim", "pooling",
                 "weighted", "dtype",
                 "row_bytes",       # bytes of one stored row: codes + scale and bias (see scale_bias)
                 "bytes",           # row_bytes * num_embeddings
                 "ids": "index" | "raw"}, ...],   # raw: a managed-collision table, inputs are raw 64-bit ids
     "lookups": [{"key": "C1" | "C1@t1", "feature", "table"}, ...],   # pooled outputs, in order
     "on_invalid_id": "error" | "zero",
     "quantization": {"embeddings": "int8", "dense": "fp32" | "dynamic_int8",
                      "scale_bias": "...",  # the format's row layout: fp16 scale and bias in front of
                                            # the codes (torchscript); after them for pt2, the int8
                                            # ones widened to float32 (row_bytes counts them so)
                      "formula": "...", "source": "...", "kernel": "...", "padding": "..."},
     "embedding_bytes": {"stored": n, "fp32": m, "ratio": n/m},
     "preprocessing": {"dataset", "dense_features", "sparse_features", "label", "transforms",
                       "sparse": [{"name", "num_embeddings", ...}], "vocab_files": {"C1": "vocab/C1.arrow"}},
     "data": {"meta": training data meta.json, "fingerprint": {"schema", "vocabulary", "split", "all"},
              "source": "runs/<name>/data_meta.json", "vocab_sha256": {"vocab/C1.arrow": "..."}},
     "source": {"run_dir", "name", "checkpoint", "checkpoint_choice", "metrics"},
     "parity": {...} (export_run: :mod:`dlrmctl.inference.parity`),
     "versions": {"dlrmctl", "torch", "fbgemm_gpu"}, "created": "ISO-8601"}
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import io
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from dlrmctl import outputs
from dlrmctl.console import stage
from dlrmctl.inference import artifact as files
from dlrmctl.inference.artifact import AOTI_FILE, FORMAT_VERSION, MANIFEST_FILE, ExportError
from dlrmctl.inference.exported import load_exported
from dlrmctl.inference.formats import FORMATS
from dlrmctl.inference.formats.base import Built, ExportPlan, Format

__all__ = ["atomic_dir", "build_manifest", "check_out", "versions", "write_artifact"]


def versions() -> dict[str, str | None]:
    """The versions of dlrmctl, torch and fbgemm_gpu (None: not installed), for the manifest."""
    import importlib.metadata as md

    import dlrmctl

    fb = None
    for d in ("fbgemm-gpu-cpu", "fbgemm-gpu"):
        try:
            fb = md.version(d)
            break
        except md.PackageNotFoundError:
            continue
    return {"dlrmctl": dlrmctl.__version__, "torch": torch.__version__, "fbgemm_gpu": fb}


@contextmanager
def atomic_dir(out: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary sibling of ``out`` (:func:`dlrmctl.outputs.make_temp_dir`); on success
    swap it in at ``out`` (replacing an existing ``out`` only with ``force`` and only when it is an
    export of ours, :func:`dlrmctl.outputs.check_replaceable`); on any failure remove it, the old
    ``out`` untouched.  Temporaries of killed exports to ``out`` are reclaimed first."""
    check_out(out, force)
    outputs.reclaim_stale(out)
    tmp = outputs.make_temp_dir(out, "export")
    try:
        yield tmp
        outputs.finish_marker(tmp, "export")
        check_out(out, force)  # again: it may have appeared meanwhile
        outputs.swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_out(out: Path, force: bool) -> None:
    """``out`` may receive a new export: absent, or (with ``force``) an export of ours.

    Raises:
        ExportError: ``out`` exists (without ``force``), is a training run, or may not be replaced.
    """
    if not os.path.lexists(out):
        return
    if outputs.kind_of(out) == "run":
        raise ExportError(f"{out} is a training run directory, not an export; --out another directory "
                          "(--force never replaces a run)")
    if not force:
        raise ExportError(f"{out} already exists; pass --force to replace it or --out another directory")
    try:
        outputs.check_replaceable(out, "export", "--force", "--out another directory")
    except outputs.OutputError as e:
        raise ExportError(str(e)) from None


def build_manifest(fmt: Format, plan: ExportPlan, built: Built, weighted: list[str], lookup_keys: list[str],
                   dense_mode: str, data_record: dict | None = None, source: dict | None = None) -> dict[str, Any]:
    """``manifest.json`` of an export of ``plan`` in ``fmt`` (``built``: what the format built;
    ``weighted``: the weighted features; ``lookup_keys``: the EBC's output names; ``dense_mode``:
    ``fp32`` | ``dynamic_int8``), before the files are written: the file records, preprocessing
    and parity are added by :func:`write_artifact`.

    Raises:
        ExportError: the data meta's dense features disagree with the model's dense width.
    """
    dtype = plan.embedding_dtype
    wf = weighted
    row_align, kernel, stored = built.row_alignment, built.kernel, built.stored_bytes
    tables = plan.tables
    fp32_bytes = sum(t.num_embeddings * t.embedding_dim * 4 for t in tables)
    managed = set(plan.managed_collision.tables()) if plan.managed_collision is not None else set()
    table_entries = []
    for t in tables:
        sd = fmt.stored_dim(t.embedding_dim, dtype)
        rb = fmt.row_bytes(sd, dtype, row_align)
        table_entries.append({
            "name": t.name, "features": list(t.feature_names), "num_embeddings": t.num_embeddings,
            "embedding_dim": t.embedding_dim, "stored_dim": sd, "pooling": t.pooling.value,
            "weighted": any(f in wf for f in t.feature_names), "dtype": dtype,
            "row_bytes": rb, "bytes": rb * t.num_embeddings,
            # a managed-collision table takes raw ids (any int64 >= 0): the program maps them to rows
            "ids": "raw" if t.name in managed else "index",
        })
    num_dense = plan.num_dense
    dense_names = list((plan.data_meta or {}).get("dense_features") or [f"dense_{i}" for i in range(num_dense)])
    if len(dense_names) != num_dense:
        raise ExportError(f"data meta lists {len(dense_names)} dense features but the model takes {num_dense}")
    fields = fmt.manifest_fields()
    return {
        "format_version": FORMAT_VERSION,
        "artifact": fmt.name,
        "model_file": fields["model_file"],
        "inputs": {
            "dense": {"shape": ["B", num_dense], "dtype": "float32", "features": dense_names},
            "values": {"shape": ["N"], "dtype": "int64", "layout": "key-major ids of all bags"},
            "lengths": {"shape": ["F*B"], "dtype": "int64", "layout": "key-major: [f0_b0..f0_b(B-1), f1_b0, ...]"},
            **({"weights": {"shape": ["N"], "dtype": "float32", "features": wf,
                            "layout": "one per id, aligned with values; required; entries of features not in "
                                      "'features' are ignored (1.0)"}} if wf else {}),
        },
        "output": fields["output"],
        "dynamic": fields["dynamic"],
        "in_program": fields["in_program"],
        "dense_features": dense_names,
        "sparse_features": plan.feature_names,
        "weighted_features": wf,
        "tables": table_entries,
        "lookups": [{"key": k, "feature": f, "table": t}
                    for k, f, t in zip(lookup_keys, plan.lookup_features, plan.lookup_tables)],
        "on_invalid_id": plan.on_invalid_id,
        "quantization": {
            "embeddings": dtype,
            "dense": dense_mode,
            "scale_bias": fields["scale_bias"],
            "formula": "bias = fp16_down(min(row)); scale = fp16_up((max(row) - bias) / (2^bits - 1)); "
                       "q = clamp(round((x - bias) / scale), 0, 2^bits - 1) (q = 0 if scale == 0); x' = q*scale + bias",
            "source": "FBGEMM FloatToFusedNBitRowwiseQuantizedSBHalf / IntNBitTableBatchedEmbeddingBagsCodegen row layout",
            "kernel": kernel,
            "padding": "rows padded to the kernel's dim alignment with the row's minimum (scale and bias "
                       "unchanged), pooled output sliced back to the real dims",
        },
        "embedding_bytes": {"stored": stored, "fp32": fp32_bytes, "ratio": stored / fp32_bytes if fp32_bytes else None},
        "preprocessing": None,
        "data": dict(data_record) if data_record else None,
        "source": source or {},
        "versions": versions(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_artifact(out: Path, fmt: Format, manifest: dict, saved: Any, *, force: bool = False,
                   data_meta: dict | None = None, data_dir: str | os.PathLike | None = None, aot: bool = False,
                   parity: Callable[[Any], dict] | None = None) -> None:
    """Write the artifact directory (vocabularies, the format's model file [+ model_aoti.pt2],
    manifest.json) through :func:`atomic_dir`; every model file is listed in
    ``manifest["files"]`` with its size and SHA-256.  ``parity`` runs on the written artifact
    (loaded back, its hashes checked) before the swap; its result is ``manifest["parity"]``.

    Raises:
        ExportError: a vocabulary file of ``data_meta`` missing under ``data_dir``, or what
            :func:`atomic_dir` and the format raise.
        OSError: a full disk or a read-only place (the caller words it).
    """
    meta = data_meta
    with atomic_dir(out, force) as tmp:
        if meta:
            vocab_files = {}
            for feat, rel in (meta.get("vocab_files") or {}).items():
                src = Path(data_dir) / rel if data_dir is not None else Path(rel)
                if not src.is_file():
                    raise ExportError(
                        f"vocabulary of feature '{feat}' not found at {src}; the artifact must carry it. "
                        "Pass --data DIR (the preprocessed data directory the run was trained on)"
                    )
                dst = tmp / "vocab" / Path(rel).name
                dst.parent.mkdir(exist_ok=True)
                shutil.copyfile(src, dst)
                vocab_files[feat] = f"vocab/{dst.name}"
                if manifest["data"] is not None:
                    manifest["data"].setdefault("vocab_sha256", {})[f"vocab/{dst.name}"] = files.sha256(dst)
            manifest["preprocessing"] = {
                "dataset": meta.get("dataset"),
                "dense_features": meta.get("dense_features"),
                "sparse_features": [sf["name"] for sf in meta.get("sparse_features", [])],
                "sparse": meta.get("sparse_features"),
                "label": meta.get("label"),
                "transforms": meta.get("transforms"),
                "vocab_files": vocab_files,
                "meta": {k: v for k, v in meta.items() if k not in ("splits", "vocab_files")},
            }
        buf = io.BytesIO()  # serialised in memory: TorchScript's C++ writer aborts the process on a full disk
        model_file = manifest["model_file"]
        stage(f"writing {model_file}")
        fmt.save(saved, buf)
        data = buf.getbuffer()
        free = shutil.disk_usage(tmp).free
        if free < len(data):
            raise OSError(errno.ENOSPC, f"{len(data):,} bytes needed, {free:,} free", str(tmp / model_file))
        files.write_bytes(tmp / model_file, data)
        manifest["model_bytes"] = len(data)
        manifest["model_sha256"] = hashlib.sha256(data).hexdigest()
        manifest["files"] = {model_file: {"bytes": len(data), "sha256": manifest["model_sha256"]}}
        del data, buf
        manifest["aoti_package"] = None
        if aot:
            stage(f"compiling the AOTInductor package {AOTI_FILE} (C++; minutes on a loaded machine)")
            FORMATS["aoti"].compile(saved, tmp / AOTI_FILE)
            manifest["aoti_package"] = AOTI_FILE
            manifest["files"][AOTI_FILE] = {"bytes": (tmp / AOTI_FILE).stat().st_size,
                                            "sha256": files.sha256(tmp / AOTI_FILE)}
        if parity is not None:
            stage("parity report: latency, then the artifact against the float model")
            files.write_bytes(tmp / MANIFEST_FILE, (json.dumps(manifest, indent=2, default=str) + "\n").encode())
            manifest["parity"] = parity(load_exported(tmp, artifact=manifest["artifact"]))
        files.write_bytes(tmp / MANIFEST_FILE, (json.dumps(manifest, indent=2, default=str) + "\n").encode())
