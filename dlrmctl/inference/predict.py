"""Score raw logs with an exported model (``dlrmctl predict MODEL_DIR --input raw.tsv``).

Raw lines go through the *training* preprocessing, recorded in the artifact's manifest
(``preprocessing``: the training data's meta.json transforms + vocabularies copied into
``MODEL_DIR/vocab``), using the preprocessing module's own transform function
(:data:`RAW_TRANSFORMS`: dataset name -> ``module:Class``) so the two can never drift apart;
``dlrmctl serve`` applies the same transformer to raw lines in a request (:func:`raw_transformer`).

Also the small binary format shared with the C++ example (``scripts/cpp_inference``):
:func:`write_cpp_input` / :func:`read_cpp_output`.

A model with weighted features (``manifest["weighted_features"]``) needs per-id weights: raw rows
of a schema with a weight column carry them (:class:`~dlrmctl.data.raw_rows.Bags`); raw rows
without them (Criteo lines) are refused, naming the features.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import struct
import sys
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, TextIO

import numpy as np
import torch

from dlrmctl import outputs
from dlrmctl.data.datasets import raw_transforms
from dlrmctl.data.raw_rows import Bags
from dlrmctl.inference.export import ExportError, ExportedModel, load_exported, to_host

__all__ = [
    "RAW_TRANSFORMS",
    "OOV_WARN_SHARE",
    "PredictReport",
    "count_oov",
    "oov_ids",
    "predict_file",
    "raw_transformer",
    "raw_weighted_features",
    "iter_model_inputs",
    "write_cpp_raw_input",
    "read_cpp_output",
    "to_model_inputs",
    "write_cpp_input",
]

#: dataset (``meta["dataset"]``) -> ``"module:Class"`` transforming raw rows with a data meta, from
#: the dataset registry (:func:`dlrmctl.data.datasets.raw_transforms`, which documents the interface).
RAW_TRANSFORMS: dict[str, str] = raw_transforms()

_IN_MAGIC = b"DLRMIN01"
_IN_MAGIC_WEIGHTED = b"DLRMIN02"
_OUT_MAGIC = b"DLRMOUT1"


# ----------------------------------------------------------------------------- tensors
def to_model_inputs(
    dense: np.ndarray, ids: np.ndarray | Bags, feature_order: list[str], data_features: list[str],
    weighted: list[str] | tuple = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A raw-row chunk -> the model's inputs (:func:`dlrmctl.data.raw_rows.model_inputs`).

    Args:
        dense: ``[n, D]`` float32 (transformed).
        ids: ``[n, F_data]`` int64, one id per sparse feature in ``data_features`` order, or
            :class:`~dlrmctl.data.raw_rows.Bags` (multi-valued / weighted features).
        feature_order: the model's sparse features (``manifest["sparse_features"]``).
        data_features: feature names of ``ids``.
        weighted: the model's weighted features (``manifest["weighted_features"]``).

    Returns:
        ``dense [n, D]`` float32, ``values [N]`` int64 key-major, ``lengths [F*n]`` int64,
        ``weights [N]`` float32 (None when ``weighted`` is empty).

    Raises:
        ExportError: a model feature missing from the data, a weighted feature without weights.
    """
    from dlrmctl.data.raw_rows import RawInputError, model_inputs

    try:
        values, lengths, weights = model_inputs(ids, data_features, feature_order, weighted)
    except RawInputError as e:
        raise ExportError(str(e)) from None
    return (torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)), torch.from_numpy(values),
            torch.from_numpy(lengths.reshape(-1)), None if weights is None else torch.from_numpy(weights))


def write_cpp_input(path: str | os.PathLike | BinaryIO, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                    weights: torch.Tensor | None = None) -> None:
    """Write the C++ example's input (little-endian) to ``path`` (a file name, or a binary file open
    for writing).

    Without weights: ``"DLRMIN01"``, int64 ``B, D, N, FB``, float32 ``dense[B*D]``, int64
    ``values[N]``, int64 ``lengths[FB]``.  With ``weights [N]`` (a model with weighted features):
    ``"DLRMIN02"``, int64 ``B, D, N, FB``, the same three arrays, then float32 ``weights[N]``.

    Raises:
        ValueError: ``weights`` not of ``values``' length.
    """
    d = dense.detach().cpu().to(torch.float32).contiguous().numpy()
    v = values.detach().cpu().to(torch.int64).contiguous().numpy()
    ln = lengths.detach().cpu().to(torch.int64).contiguous().numpy()
    w = None if weights is None else weights.detach().cpu().to(torch.float32).contiguous().numpy()
    if w is not None and w.shape != v.shape:
        raise ValueError(f"weights must have one entry per value ({v.size}), got shape {tuple(w.shape)}")
    with open(path, "wb") if isinstance(path, (str, os.PathLike)) else contextlib.nullcontext(path) as f:
        f.write(_IN_MAGIC if w is None else _IN_MAGIC_WEIGHTED)
        f.write(struct.pack("<4q", d.shape[0], d.shape[1], v.size, ln.size))
        f.write(d.astype("<f4").tobytes())
        f.write(v.astype("<i8").tobytes())
        f.write(ln.astype("<i8").tobytes())
        if w is not None:
            f.write(w.astype("<f4").tobytes())


def read_cpp_output(path: str | os.PathLike) -> np.ndarray:
    """Read the C++ example's output -> scores ``[B]`` float32.

    Raises:
        ValueError: wrong magic or truncated file.
    """
    raw = Path(path).read_bytes()
    if raw[:8] != _OUT_MAGIC or len(raw) < 16:
        raise ValueError(f"{path}: not a DLRMOUT1 file")
    (n,) = struct.unpack("<q", raw[8:16])
    if len(raw) != 16 + 4 * n:
        raise ValueError(f"{path}: truncated ({len(raw)} bytes for {n} scores)")
    return np.frombuffer(raw, dtype="<f4", offset=16, count=n).astype(np.float32)


# ----------------------------------------------------------------------------- raw logs
#: ``predict`` warns about a feature when more than this share of its ids is out of vocabulary
OOV_WARN_SHARE = 0.5


class PredictReport:
    """Summary of :func:`predict_file`.

    Attributes:
        rows: lines scored.
        labelled: the input had a label column (then ``metrics`` holds AUC/logloss/NE).
        metrics: :func:`dlrmctl.metrics.compute_metrics_from_logits` output or None.
        output: where scores went (path or ``"-"``).
        oov: per feature with a vocabulary (meta.json ``oov_id``: ids rarer than the frequency
            threshold in the training split, or never seen there, share that row), ``(ids on its
            out-of-vocabulary row, ids)`` over the scored rows.
        train_oov: per feature, the share of the train split's own ids on that row
            (:func:`dlrmctl.inference.train_oov.train_oov_shares`); absent: taken as 0.
    """

    def __init__(self, rows: int, labelled: bool, metrics: dict | None, output: str,
                 oov: dict[str, list[int]] | None = None, train_oov: dict[str, float] | None = None) -> None:
        self.rows, self.labelled, self.metrics, self.output = rows, labelled, metrics, output
        self.oov = dict(oov or {})
        self.train_oov = dict(train_oov or {})

    def oov_warnings(self, threshold: float = OOV_WARN_SHARE) -> list[str]:
        """One line per feature whose out-of-vocabulary share is well above the train split's own
        share ``t``: above ``t + (1 - t) * threshold`` (``threshold`` a fraction: the share of the
        ids the train split maps in vocabulary that are out of it here), without the ``warning:``
        prefix, in feature order."""
        out = []
        for f, (n, total) in self.oov.items():
            t = self.train_oov.get(f, 0.0)
            limit = t + (1 - t) * threshold
            if total and n / total > limit:
                out.append(f"feature '{f}': {n / total:.1%} of its {total:,} ids are out of the training vocabulary "
                           f"(the train split's own ids: {t:.1%}; warned above {limit:.0%}), so they all score as one "
                           "row; check that the input is the data the model was trained for, or train on newer data")
        return out


def oov_ids(model: ExportedModel) -> list[int | None]:
    """Per input feature of ``model`` (``model.feature_names`` order), its out-of-vocabulary id
    from the manifest's preprocessing (None: no vocabulary, e.g. hashed or raw ids)."""
    pre = model.manifest.get("preprocessing")
    sparse = (pre.get("sparse") if isinstance(pre, dict) else None) or []
    by_name = {sf.get("name"): sf.get("oov_id") for sf in sparse if isinstance(sf, dict)}
    return [by_name.get(f) if isinstance(by_name.get(f), int) else None for f in model.feature_names]


def count_oov(counts: dict[str, list[int]], names: list[str], oov: list[int | None], values: torch.Tensor,
              lengths: torch.Tensor, batch: int) -> None:
    """Add one batch's ids to ``counts`` (feature -> ``[ids on its OOV row, ids]``): ``values [N]``
    int64 key-major with ``lengths [F*batch]`` int64, ``oov`` per feature (None: not counted)."""
    if not any(o is not None for o in oov):
        return
    per = lengths.view(len(names), batch).sum(1).tolist()
    for f, (name, o, part) in enumerate(zip(names, oov, torch.split(values, per))):
        if o is not None:
            c = counts.setdefault(name, [0, 0])
            c[0] += int((part == o).sum())
            c[1] += int(per[f])


def raw_transformer(model: ExportedModel) -> tuple[object, list[str]]:
    """The training preprocessing of raw lines for ``model`` (its manifest's ``preprocessing``,
    vocabularies from the artifact): ``(transformer, data_features)`` -- the
    :data:`RAW_TRANSFORMS` class built once (``.file(path, batch_rows)``, ``.lines(lines, name)``)
    and the column names of the ids it yields.

    Raises:
        ExportError: no preprocessing in the manifest, unsupported dataset.
        DataError: a meta the transform cannot apply (multi-hot, unknown mode).
    """
    pre = model.manifest.get("preprocessing")
    if pre and not isinstance(pre, dict):
        raise ExportError(f"{model.model_dir}/manifest.json: corrupt manifest: preprocessing is a {type(pre).__name__}, "
                          "not an object; export the run again")
    if not pre:
        raise ExportError(
            f"{model.model_dir}: the manifest has no preprocessing (exported without the data meta); "
            "raw lines cannot be scored, only preprocessed tensors"
        )
    dataset = pre.get("dataset")
    target = RAW_TRANSFORMS.get(dataset)
    if target is None:
        raise ExportError(f"raw lines can be scored for datasets {sorted(RAW_TRANSFORMS)}, this model was trained on {dataset!r}")
    mod_name, fn_name = target.split(":")
    cls = getattr(importlib.import_module(mod_name), fn_name, None)
    if cls is None:
        raise ExportError(f"{mod_name}.{fn_name} is not available in this dlrmctl; cannot preprocess raw {dataset} lines")
    meta = dict(pre.get("meta") or {})
    meta.update({
        "dataset": dataset,
        "dense_features": pre.get("dense_features"),
        "sparse_features": pre.get("sparse"),
        "label": pre.get("label"),
        "transforms": pre.get("transforms"),
        "vocab_files": pre.get("vocab_files") or {},
    })
    try:
        return cls(meta, model.model_dir, source=Path(model.model_dir) / "manifest.json"), \
            [sf["name"] for sf in pre.get("sparse") or []]
    except (KeyError, TypeError, AttributeError) as e:
        raise ExportError(f"{model.model_dir}/manifest.json: corrupt manifest: its preprocessing does not match its "
                          f"vocabularies ({type(e).__name__}: {e}); export the run again") from None


def raw_weighted_features(manifest: dict) -> set[str]:
    """The features whose raw rows carry per-id weights: those with a weight column in the schema
    recorded in ``manifest["preprocessing"]`` (a schema's log); empty for every other dataset."""
    pre = manifest.get("preprocessing")
    meta = pre.get("meta") if isinstance(pre, dict) else None
    schema = meta.get("schema") if isinstance(meta, dict) else None
    cats = schema.get("categorical") if isinstance(schema, dict) else None
    return {c.get("name") for c in cats or [] if isinstance(c, dict) and c.get("weights")}


def iter_model_inputs(
    model: ExportedModel, input_path: str | os.PathLike, batch_rows: int = 65536
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, np.ndarray | None]]:
    """A raw file through the model's raw-row transformer (:func:`raw_transformer`), in file order:
    yields ``(dense [n, D] float32, values [N] int64, lengths [F*n] int64, weights [N] float32 |
    None, labels [n] float32 | None)``, the inputs of :meth:`ExportedModel.score`.

    Raises:
        ExportError: no preprocessing in the manifest, unsupported dataset, a model with weighted
            features whose raw rows carry no per-id weights for them.
        DataError: a malformed line (the preprocessing's message: file, line, field).
    """
    weighted = list(model.weighted_features)
    if not set(weighted) <= raw_weighted_features(model.manifest):
        raise ExportError(
            f"{model.model_dir}: the model has weighted features {weighted} and needs per-id weights, which its "
            "raw rows do not carry; score preprocessed data with weight columns (`dlrmctl evaluate MODEL_DIR "
            "--data DIR`) or pass weights to ExportedModel.score / the C++ loader")
    transformer, data_features = raw_transformer(model)
    for dense, ids, labels in transformer.file(Path(input_path), batch_rows):
        yield (*to_model_inputs(dense, ids, model.feature_names, data_features, weighted), labels)


@torch.no_grad()
def iter_scores(
    model: ExportedModel, input_path: str | os.PathLike, batch_rows: int = 65536, logits: bool = False,
    on_inputs: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], None] | None = None,
) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
    """Scores of raw lines in file order (``predict``'s loop): yields ``(scores [n] float32, labels
    [n] float32 | None)`` per batch of at most ``batch_rows`` lines; with ``logits=True`` the logits
    ``[n]`` float32 instead of the scores (``sigmoid(logits)``).

    Args:
        on_inputs: called with each batch's model inputs ``(dense [n, D] float32, values [N] int64,
            lengths [F*n] int64, weights [N] float32 | None)`` before its forward (predict counts
            out-of-vocabulary ids there: :func:`count_oov`).

    Raises:
        ExportError, DataError: see :func:`iter_model_inputs`.
    """
    for d, v, ln, w, labels in iter_model_inputs(model, input_path, batch_rows):
        if on_inputs is not None:
            on_inputs(d, v, ln, w)
        yield to_host(model.logits(d, v, ln, w) if logits else model.score(d, v, ln, w)), labels


def write_cpp_raw_input(model_dir: str | os.PathLike, input_path: str | os.PathLike,
                        output: str | os.PathLike, batch_rows: int = 65536) -> int:
    """Raw rows of a file -> the C++ example's input file (:func:`write_cpp_input`; ``DLRMIN02``
    with the weights of a weighted model), through the same raw-row transformer as ``predict`` and
    ``serve`` (:func:`iter_model_inputs`, read ``batch_rows`` at a time): one batch of every row,
    written to a temp file and renamed.

    Returns:
        the rows written ``B``.

    Raises:
        ExportError, DataError: see :func:`iter_model_inputs`; DataError: no rows in the input.
    """
    from dlrmctl.data.columnar import DataError

    model = load_exported(model_dir, "cpu", bulk=True)
    parts = list(iter_model_inputs(model, input_path, batch_rows))
    if not parts:
        raise DataError("no rows to write", path=input_path)
    F = len(model.feature_names)
    dense = torch.cat([p[0] for p in parts])
    # each part is key-major over its own rows: regroup feature by feature across the parts
    lengths = torch.cat([p[2].view(F, -1) for p in parts], dim=1)
    splits = [p[2].view(F, -1).sum(1).tolist() for p in parts]
    vals = [torch.split(p[1], s) for p, s in zip(parts, splits)]
    values = torch.cat([v[f] for f in range(F) for v in vals]) if F else torch.zeros(0, dtype=torch.int64)
    weights = None
    if parts[0][3] is not None:
        ws = [torch.split(p[3], s) for p, s in zip(parts, splits)]
        weights = torch.cat([w[f] for f in range(F) for w in ws])
    with outputs.atomic_file(output, mode="wb") as f:
        write_cpp_input(f, dense, values, lengths.reshape(-1), weights)
    return int(dense.shape[0])


def _is_empty(path: Path) -> bool:
    """No non-blank line (a plain file, or .gz / .bz2 as the raw readers open them)."""
    import bz2
    import gzip

    opener = gzip.open if path.suffix == ".gz" else bz2.open if path.suffix == ".bz2" else open
    with opener(path, "rt", errors="replace") as f:
        return all(not line.strip() for line in f)


def check_vocabularies(model: ExportedModel) -> None:
    """The artifact's vocabulary files are the ones exported (SHA-256 recorded in
    ``manifest["data"]["vocab_sha256"]``; artifacts without the record are not checked).

    Raises:
        DataMismatchError: naming the file, both digests and where the record comes from.
    """
    from dlrmctl.data.fingerprint import DataMismatchError
    from dlrmctl.inference.artifact import MANIFEST_FILE, sha256

    rec = model.manifest.get("data") or {}
    for rel, want in (rec.get("vocab_sha256") or {}).items():
        f = Path(model.model_dir) / rel
        got = sha256(f) if f.is_file() else "missing"
        if got != want:
            raise DataMismatchError(
                f"{f}: vocabulary SHA-256 {got[:12]} differs from {want[:12]} recorded in "
                f"{Path(model.model_dir) / MANIFEST_FILE} at export (from {rec.get('source', '?')}): the vocabulary "
                "was changed after export; re-export the model")


def predict_file(
    model_dir: str | os.PathLike,
    input_path: str | os.PathLike,
    output: str | os.PathLike | None = None,
    batch_rows: int = 65536,
    force: bool = False,
    device: str | torch.device = "cpu",
    artifact: str | None = None,
    announce: Callable[[str], None] | None = None,
) -> PredictReport:
    """Score a raw log file (39 fields, or 40 with the label first) and write a CSV of scores.

    Output: a CSV with header ``row,score`` (``row,label,score`` when the input is labelled), one
    line per input line in order: ``row`` is the input line's number (from 1), scores have 8
    significant digits; to stdout when ``output`` is None or ``"-"``; a file output is written to
    a temp file and renamed (:func:`dlrmctl.outputs.atomic_file`) over an existing ``output`` only
    with ``force`` and when that is a scores CSV dlrmctl wrote (:func:`dlrmctl.outputs.check_file_replaceable`).  Before scoring, the artifact's vocabulary files are checked against
    the SHA-256 the export recorded (:func:`check_vocabularies`).

    ``device`` (``cpu`` | ``cuda[:i]``) and ``artifact`` (``aoti`` | ``pt2`` | ``torchscript``; default
    the fastest the export holds for whole-file scoring: ``model.pt2``, else the AOTInductor package,
    else TorchScript) choose what runs (:func:`~dlrmctl.inference.export.load_exported` with ``bulk``);
    ``announce`` is called with its :attr:`~dlrmctl.inference.export.ExportedModel.description`
    once loaded, before any line is scored.

    Returns:
        :class:`PredictReport`: its out-of-vocabulary counts per feature, and AUC/logloss/NE when
        labelled (computed from the logits as :func:`dlrmctl.metrics.compute_metrics_from_logits`).

    Raises:
        ExportError, DataError: see :func:`iter_model_inputs` (no preprocessing in the manifest, a
            model with weighted features whose raw rows carry no weights, a malformed line); an
            empty input file or a directory;
        DataMismatchError: a vocabulary file differs from the one exported; FileNotFoundError: no input.
        OutputError: ``output`` exists and may not be replaced.
        ValueError: ``batch_rows`` < 1.
    """
    from dlrmctl.data.columnar import DataError
    from dlrmctl.metrics import compute_metrics_from_logits

    if int(batch_rows) < 1:
        raise ValueError(f"batch_rows must be >= 1, got {batch_rows}")
    p = Path(input_path)
    if not p.exists():
        raise FileNotFoundError(f"{input_path}: no such file")
    if p.is_dir():
        raise DataError("is a directory; give one raw log file (--input FILE)", path=input_path)
    if _is_empty(p):
        raise DataError("empty file: no lines to score", path=input_path)
    model = load_exported(model_dir, device, artifact, bulk=True)
    check_vocabularies(model)
    if announce is not None:  # once the inputs are known to fit: a bad input stays one error line
        announce(model.description)
    to_stdout = output is None or str(output) == "-"
    rows = 0
    all_s, all_l = [], []
    labelled = None
    with contextlib.ExitStack() as stack:
        if to_stdout:
            f: TextIO = sys.stdout
        else:  # a temporary sibling renamed over --output only when complete, and only over a scores CSV of ours
            f = stack.enter_context(outputs.atomic_file(output, recheck=lambda: outputs.check_file_replaceable(
                output, "scores CSV", outputs.is_scores_csv, force=force, option="--output", inputs=(input_path,))))
        oov, names, oov_counts = oov_ids(model), list(model.feature_names), {}

        def count(d: torch.Tensor, v: torch.Tensor, ln: torch.Tensor, w: torch.Tensor | None) -> None:
            count_oov(oov_counts, names, oov, v, ln, d.size(0))

        for z, labels in iter_scores(model, input_path, batch_rows, logits=True, on_inputs=count):
            scores = torch.sigmoid(torch.from_numpy(z)).numpy()  # the module's forward: sigmoid(logits)
            if labelled is None:
                labelled = labels is not None
                f.write("row,label,score\n" if labelled else "row,score\n")
            if labelled:
                f.writelines(f"{rows + i + 1},{int(y)},{s:.8g}\n" for i, (y, s) in enumerate(zip(labels, scores)))
                all_s.append(z)
                all_l.append(labels)
            else:
                f.writelines(f"{rows + i + 1},{s:.8g}\n" for i, s in enumerate(scores))
            rows += len(scores)
        if labelled is None:
            f.write("row,score\n")
    metrics = compute_metrics_from_logits(np.concatenate(all_s), np.concatenate(all_l)) if labelled and rows else None
    from dlrmctl.inference.train_oov import train_oov_shares

    return PredictReport(rows, bool(labelled), metrics, "-" if to_stdout else str(output), oov_counts,
                         train_oov_shares(model.manifest, model.model_dir) if oov_counts else None)
