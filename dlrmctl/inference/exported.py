"""A loaded export: :func:`load_exported` checks ``manifest.json`` and every file it lists
(size and SHA-256), picks the format that runs (:func:`dlrmctl.inference.formats.choose_format`)
and loads it as an :class:`ExportedModel`, which scores tensors or a KeyedJaggedTensor through that
format's input contract.  :func:`evaluate_exported` computes the metrics of one on a split of
preprocessed data (``dlrmctl evaluate MODEL_DIR``).
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from dlrmctl.inference.artifact import FORMAT_VERSION, MANIFEST_FILE, MODEL_FILE, ExportError, sha256
from dlrmctl.inference.formats import ARTIFACTS, FORMATS, Format, choose_format

log = logging.getLogger("dlrmctl.export")

__all__ = ["ExportedModel", "evaluate_exported", "load_exported", "to_host"]


class ExportedModel:
    """A loaded artifact (TorchScript module or torch.export program) plus its manifest.

    Attributes:
        model_dir: the artifact directory.
        manifest: the parsed manifest.
        module: the ``torch.jit.ScriptModule`` (``artifact`` ``torchscript``; loaded for a non-CPU
            device: an eager :class:`~dlrmctl.inference.formats.torchscript.ExportedDLRM` with its
            TBE rebuilt there) or the program's ``ExportedProgram.module()`` (``pt2``: returns
            ``(scores, logits)``).
        artifact: ``pt2`` | ``torchscript`` (``manifest["artifact"]``; older manifests: torchscript).
        runner: the name of the format that runs (:mod:`dlrmctl.inference.formats`): ``aoti`` (the
            package of a ``pt2`` export), ``pt2`` or ``torchscript``.
        format: that :class:`~dlrmctl.inference.formats.base.Format` (how the module is run).
        feature_names: sparse features in input order.
        weighted_features: features whose per-id weights the model uses (empty: it takes none).
        num_dense: ``D_in``.
    """

    def __init__(self, model_dir: Path, manifest: dict, module: torch.jit.ScriptModule,
                 device: torch.device | str = "cpu", runner: str | None = None) -> None:
        self.model_dir = model_dir
        self.manifest = manifest
        self.module = module
        self.artifact = manifest.get("artifact", "torchscript")
        self.runner = runner or self.artifact
        self.format = FORMATS[self.runner]
        self.device = torch.device(device)
        self.feature_names: list[str] = list(manifest["sparse_features"])
        self.weighted_features: list[str] = list(manifest.get("weighted_features") or [])
        self.num_dense = int(manifest["inputs"]["dense"]["shape"][1])

    @property
    def description(self) -> str:
        """What runs, for a command's first line: ``model_aoti.pt2 (AOTInductor package) on cpu``."""
        return self.format.describe(self.device)

    def score(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
              weights: torch.Tensor | None = None) -> torch.Tensor:
        """``dense [B, D_in]`` float32, ``values [N]`` int64, ``lengths [F*B]`` int64 (key-major,
        manifest feature order), ``weights [N]`` float32 (required exactly when the model has
        :attr:`weighted_features`), on any device -> scores ``[B]`` float32 on the model's device.

        Raises:
            ExportError: inputs rejected by the module (message from the module).
        """
        return self._call(False, dense, values, lengths, weights)

    def score_kjt(self, dense: torch.Tensor, kjt: Any) -> torch.Tensor:
        """Scores ``[B]`` of a batch given as ``dense [B, D_in]`` + a KeyedJaggedTensor (any key
        order; reordered to the manifest's; its ``weights()`` are the per-id weights)."""
        return self.score(dense, *self._kjt_inputs(kjt))

    def logits(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
               weights: torch.Tensor | None = None) -> torch.Tensor:
        """Same inputs as :meth:`score` (``weights`` included) -> logits ``[B]`` float32 on the
        model's device (``score == sigmoid(logits)``).  Metrics use these: a float32 sigmoid
        rounds to 1.0 above a logit of ~16.6.

        Raises:
            ExportError: inputs rejected by the module (message from the module).
        """
        return self._call(True, dense, values, lengths, weights)

    def _call(self, logits: bool, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
              weights: torch.Tensor | None) -> torch.Tensor:
        """The format's run of the module (scores, or ``logits``) on the inputs moved to the model's
        device; a rejected input becomes an :class:`ExportError` carrying the module's own message
        (:meth:`~dlrmctl.inference.formats.base.Format.input_message`).  Runs in the format's
        :meth:`~dlrmctl.inference.formats.base.Format.no_autograd` context (``torch.inference_mode``,
        or ``no_grad`` for TorchScript)."""
        with self.format.no_autograd():
            return self._run(logits, dense, values, lengths, weights)

    def _run(self, logits: bool, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
             weights: torch.Tensor | None) -> torch.Tensor:
        dev, fmt = self.device, self.format
        dense, values, lengths = dense.to(dev), values.to(dev), lengths.to(dev)
        fmt.check_inputs(self, dense, values, lengths, weights)
        # the 3-input call every artifact accepts when there are no weights
        args = (dense, values, lengths) if weights is None else (dense, values, lengths, weights.to(dev))
        try:
            return fmt.run(self.module, args, logits)
        except (RuntimeError, AssertionError, ValueError, torch.jit.Error) as e:
            msg = fmt.input_message(self, e, values, lengths, dense.size(0))
            raise ExportError(f"{self.model_dir}: bad model input: {msg}") from None

    def logits_kjt(self, dense: torch.Tensor, kjt: Any) -> torch.Tensor:
        """Logits ``[B]`` float32 of ``dense [B, D_in]`` + a KeyedJaggedTensor (any key order;
        its ``weights()`` are the per-id weights, as :meth:`score_kjt`)."""
        return self.logits(dense, *self._kjt_inputs(kjt))

    def _kjt_inputs(self, kjt: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``values`` int64, ``lengths`` int64 (manifest key order) and float32 ``weights`` (or None) of a KJT."""
        if kjt.keys() != self.feature_names:
            kjt = kjt.select_keys(self.feature_names)
        w = kjt.weights_or_none()
        return kjt.values().to(torch.int64), kjt.lengths().to(torch.int64), None if w is None else w.to(torch.float32)


def to_host(t: torch.Tensor) -> np.ndarray:
    """A model output (scores / logits ``[B]`` on any device) as a NumPy array on the host:
    detached and copied to the CPU first (``.numpy()`` refuses a CUDA tensor).  Every consumer of
    :class:`ExportedModel` outputs (predict, evaluate, the parity report) goes through it."""
    return t.detach().cpu().numpy()


def load_exported(model_dir: str | os.PathLike, device: torch.device | str = "cpu",
                  artifact: str | None = None, bulk: bool = False) -> ExportedModel:
    """Load ``model_dir/manifest.json`` and its model -- ``model.pt2`` (``torch.export.load``; needs
    no fbgemm_gpu) or ``model.pt`` (TorchScript, ``manifest["artifact"]``) -- onto ``device``
    (``cpu``, or ``cuda[:i]``; not run on a GPU yet): the program's buffers are moved there
    (``ep.module().to(device)``); a TorchScript artifact's IntNBit TBE is rebuilt for the device
    (DEVICE placement, 16-byte rows:
    :func:`~dlrmctl.inference.formats.torchscript.torchscript_for_device`; needs fbgemm_gpu's CUDA
    build), its module then an eager :class:`~dlrmctl.inference.formats.torchscript.ExportedDLRM`
    with the same ``forward`` / ``logits``.
    Outputs stay on ``device``: :func:`to_host` brings them to NumPy.

    ``artifact`` (``aoti`` | ``pt2`` | ``torchscript``) names the format to run; by default the
    fastest the directory holds that runs on ``device`` per request (the AOTInductor package of a
    ``--aot`` export on the CPU), or with ``bulk`` for whole-file scoring (``model.pt2`` first):
    :func:`dlrmctl.inference.formats.choose_format`.

    Raises:
        ExportError: no manifest (not an exported model), unknown format version, model file
            missing, of another size than recorded (truncated copy) or with another SHA-256 than
            recorded (``manifest["files"]``, every model file; damaged; hashed in 4 MiB chunks).
        RuntimeError: fbgemm_gpu missing for a TorchScript artifact (its operators run the module).
    """
    d = Path(model_dir)
    mpath = d / MANIFEST_FILE
    if not mpath.is_file():
        raise ExportError(f"{mpath}: not found; {d} is not an exported model (create one with `dlrmctl export RUN_DIR`)")
    try:
        manifest = json.loads(mpath.read_text())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ExportError(f"{mpath}: corrupt manifest: {e}") from None
    if not isinstance(manifest, dict):
        raise ExportError(f"{mpath}: corrupt manifest: a JSON object expected, got {type(manifest).__name__}")
    try:
        return _load_checked(d, mpath, manifest, device, artifact, bulk)
    except (KeyError, TypeError, AttributeError, ValueError) as e:  # a field of the wrong shape
        raise ExportError(f"{mpath}: corrupt manifest ({type(e).__name__}: {e}); export the run again") from None


def _load_checked(d: Path, mpath: Path, manifest: dict, device: str | torch.device,
                  runner: str | None = None, bulk: bool = False) -> "ExportedModel":
    """:func:`load_exported` once ``manifest`` parsed as a JSON object (same errors)."""
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ExportError(f"{mpath}: format_version {manifest.get('format_version')!r} is not supported (expected {FORMAT_VERSION})")
    artifact = manifest.get("artifact", "torchscript")
    if artifact not in ARTIFACTS:
        raise ExportError(f"{mpath}: artifact {artifact!r} is not one of {list(ARTIFACTS)}")
    model_path = d / manifest.get("model_file", MODEL_FILE)
    files = dict(manifest.get("files") or {})
    if not files:  # manifests before "files": the model file alone
        files = {model_path.name: {"bytes": manifest.get("model_bytes"), "sha256": manifest.get("model_sha256")}}
    if model_path.name not in files or not (files[model_path.name] or {}).get("sha256") \
            or os.path.dirname(manifest.get("model_file", MODEL_FILE)):
        # the file that is loaded must be one whose SHA-256 is checked below
        raise ExportError(f"{mpath}: model_file {manifest.get('model_file')!r} is not a file the manifest records a "
                          "SHA-256 for; the manifest was edited or damaged: export the run again")
    for rel, rec in files.items():  # every artifact file the manifest lists: present, same size and SHA-256
        f = d / rel
        if not f.is_file():
            raise ExportError(f"{f}: missing")
        if rec.get("bytes") is not None and f.stat().st_size != rec["bytes"]:
            raise ExportError(f"{f}: {f.stat().st_size} bytes but the manifest records {rec['bytes']}; truncated copy?")
        want = rec.get("sha256")
        if want:
            got = sha256(f)
            if got != want:
                raise ExportError(
                    f"{f}: SHA-256 {got} differs from {want} recorded in {mpath}: the file is damaged or "
                    "was changed after export; export the run again (`dlrmctl export RUN_DIR --force --out "
                    f"{d}`) or copy the artifact again"
                )
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ExportError(f"{model_path}: device {device} requested but CUDA is not available")
    fmt = choose_format(d, manifest, device, runner, bulk)
    fmt.check_loadable(d / fmt.file)
    with _unloadable(d / fmt.file, fmt):
        module = fmt.load(d / fmt.file, manifest, device)
    return ExportedModel(d, manifest, module, device, runner=fmt.name)


@contextmanager
def _unloadable(model_path: Path, fmt: Format) -> Iterator[None]:
    """A model file that passed its SHA-256 check but does not load as ``fmt`` (a file replaced
    with its hash updated, an edited ``artifact`` field): one :class:`ExportError` naming the file
    and what the manifest claims, not the loader's traceback or a "corrupt manifest".  torch's own
    loggers are held to errors meanwhile: ``torch.export.load`` logs such a failure as a WARNING
    with the whole traceback (about twenty lines on stderr above the one error line)."""
    torch_log = logging.getLogger("torch")  # (its child loggers, torch.export's included, inherit the level)
    level = torch_log.level
    torch_log.setLevel(logging.ERROR)
    try:
        yield
    except Exception as e:  # noqa: BLE001 - whatever the loader raises about a file that is not its format
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ExportError(f"{model_path}: does not load as the '{fmt.name}' artifact the manifest names "
                          f"({fmt.loads_with}: "
                          f"{first}); the file or the manifest was replaced or edited after export: export the run "
                          "again") from None
    finally:
        torch_log.setLevel(level)


# ----------------------------------------------------------------------------- evaluate
@torch.no_grad()
def evaluate_exported(
    model_dir: str | os.PathLike, data_dir: str | os.PathLike, split: str = "val", batch_size: int = 8192,
    device: torch.device | str = "cpu", any_split: bool = False, progress: bool = False,
    artifact: str | None = None, announce: Callable[[str], None] | None = None,
) -> dict[str, float]:
    """Metrics of an exported model on a split of preprocessed data (``dlrmctl evaluate MODEL_DIR``).

    The data must be preprocessed with the same transforms as the training data (the ids are
    checked against each table's rows by the module).

    Computed from the module's logits in float64, like training's evaluation.

    The data's fingerprint (schema, vocabularies and split; without the split with ``any_split``)
    must equal the one the export recorded (``manifest["data"]``; artifacts without one are
    evaluated with a warning).

    ``device`` (``cpu`` | ``cuda[:i]``) and ``artifact`` choose what runs as in
    :func:`load_exported` with ``bulk`` (a whole split: ``model.pt2`` first); each batch is moved there once
    and its logits come back in one copy.
    ``announce`` is called with :attr:`ExportedModel.description` once the model is loaded and the
    data checked.

    Returns:
        ``{"auc", "logloss", "ne", "calibration", "accuracy", "ctr", "num_samples"}``
        (:func:`dlrmctl.metrics.compute_metrics_from_logits`).

    Raises:
        ExportError: not an exported model, data without labels, ids out of range.
        DataError: unknown split / bad data directory.
    """
    from dlrmctl.console import Progress, stage
    from dlrmctl.data.fingerprint import PARTS, check_same_data, read_meta_json, split_rows
    from dlrmctl.data.loader import BatchLoader
    from dlrmctl.metrics import compute_metrics_from_logits

    stage("loading the exported model")
    m = load_exported(model_dir, device, artifact, bulk=True)
    mpath = os.path.join(str(data_dir), "meta.json")
    dmeta = read_meta_json(mpath, "data")
    rec = m.manifest.get("data") or {}
    if rec.get("meta"):
        check_same_data(rec["meta"], f"{Path(model_dir) / MANIFEST_FILE} (recorded from {rec.get('source', '?')})",
                        dmeta, mpath, PARTS[:2] if any_split else PARTS,
                        hint="Evaluate on the data the model was trained on"
                             + ("" if any_split else "; --any-split accepts other rows with the same schema and "
                                                     "vocabularies"))
    else:
        log.warning("%s records no training-data fingerprint (exported by an older dlrmctl): the data is not "
                    "checked against it", Path(model_dir) / MANIFEST_FILE)
    rows = split_rows(dmeta, str(data_dir), split)
    if announce is not None:  # once the data is known to fit: a bad input stays one error line
        announce(m.description)
    loader = BatchLoader(str(data_dir), split, batch_size, shuffle=False, features=m.feature_names,
                         weighted_features=m.weighted_features,
                         **({} if "multi_hot" in (m.manifest.get("in_program") or [])
                            else (m.manifest.get("source") or {}).get("multi_hot", {})))
    stage(f"scoring {rows:,} rows of split '{split}' in {len(loader):,} batch(es)")
    logits, labels = [], []
    bar = Progress(len(loader), f"eval {split}", "batch", enabled=progress, final_line=False, leave=False)
    for batch in loader:
        if bool(torch.isnan(batch.labels).any()):
            raise ExportError(f"{data_dir}: split '{split}' has no labels; cannot compute metrics")
        logits.append(to_host(m.logits_kjt(batch.dense_features.float(), batch.sparse_features)))
        labels.append(batch.labels.numpy())
        bar.update(1)
    bar.close()
    if not logits:
        raise ExportError(f"{data_dir}: split '{split}' is empty")
    return compute_metrics_from_logits(np.concatenate(logits), np.concatenate(labels))
