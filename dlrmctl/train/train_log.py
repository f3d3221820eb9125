"""What a training run reports: the loss window (the loss stays on the device and is read
every ``train.log_every`` steps), ``metrics.jsonl`` and the TensorBoard scalars, and the
rank-0 progress of an epoch.

Named ``train_log`` rather than ``logging``: a module ``dlrmctl/train/logging.py`` would shadow
the standard library's ``logging`` for anything that puts ``dlrmctl/train`` on ``sys.path``
(running one of its files as a script, some test runners), and reads ambiguously next to the
``import logging`` of its neighbours.
"""

from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING, Any

import torch

from dlrmctl.console import Progress
from dlrmctl.train.run_dir import TrainError

if TYPE_CHECKING:
    from dlrmctl.distributed.env import RunEnv


def jsonable(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` with NaN floats as None (JSON has no NaN)."""
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}


class LossWindow:
    """The training loss on the device: this rank's last step loss and its sum since the last
    :meth:`read` (``[2]`` float64), read with one all-reduce and one host sync.

    Attributes:
        last_loss: the latest global loss read (None before the first read).
        last_loss_step: the step ``last_loss`` is of.
    """

    def __init__(self, env: "RunEnv") -> None:
        self.env = env
        self._window: torch.Tensor | None = None  # [2]: last step's local loss, window sum
        self._steps = 0
        self.last_loss: float | None = None
        self.last_loss_step = 0

    def accumulate(self, local: torch.Tensor) -> None:
        """Add one step's local loss (a 0-d device tensor; no host read)."""
        if self._window is None:
            self._window = torch.zeros(2, dtype=torch.float64, device=local.device)
        self._window[0] = local
        self._window[1] += local
        self._steps += 1

    def check_finite(self, step: int) -> None:
        """Raise if a loss since the last :meth:`read` was not finite (collective, one host
        sync; the window is kept).  Called before every evaluation and checkpoint.

        Raises:
            TrainError: naming the step range (ending at ``step``).
        """
        if self._window is None or self._steps == 0:
            return
        w = self._window[1:].clone()
        self.env.all_reduce_sum(w)
        total = w.tolist()[0]
        if not math.isfinite(total):
            n = self._steps
            raise TrainError(f"loss became {total / n} in steps {step - n + 1}..{step}; lower the "
                             "learning rate (no evaluation or checkpoint of this model was made)")

    def read(self, step: int) -> tuple[float, float]:
        """``(last step's global loss, mean global loss since the previous read)``; resets the
        window.  Collective (one 16-byte all-reduce) and one host sync: the trainer calls it
        every ``train.log_every`` steps and at the end of an epoch, on every rank.

        Raises:
            TrainError: the loss is not finite (names the step range, ending at ``step``).
        """
        if self._window is None or self._steps == 0:
            return (float("nan"), float("nan")) if self.last_loss is None else (self.last_loss, self.last_loss)
        w = self._window.clone()
        self.env.all_reduce_sum(w)
        last, total = w.tolist()
        n = self._steps
        self._window.zero_()
        self._steps = 0
        if not (math.isfinite(last) and math.isfinite(total)):
            raise TrainError(f"loss became {total / n} in steps {step - n + 1}..{step}; lower the learning rate")
        self.last_loss, self.last_loss_step = last, step
        return last, total / n


class MetricsLog:
    """``run_dir/metrics.jsonl`` (one JSON record a line, appended) and TensorBoard scalars
    (``run_dir/tensorboard``, when tensorboard is installed); rank 0 writes, other ranks ignore.
    Opened on the first record.  ``log_every``: ``train.log_every`` (0: no train records)."""

    def __init__(self, run_dir: str, is_main: bool, log_every: int = 0, tensorboard: bool | str = "auto") -> None:
        self.run_dir = run_dir
        self.is_main = is_main
        self.log_every = log_every
        self.tensorboard = tensorboard  # train.tensorboard: auto | true | false
        self._f = None
        self._tb = None

    def is_due(self, step: int) -> bool:
        """Step ``step`` gets a train record (``train.log_every``; the same on every rank)."""
        return bool(self.log_every and step % self.log_every == 0)

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` (``kind``: ``train`` | ``eval``, ``step``, ...; NaN as null)."""
        if not self.is_main:
            return
        if self._f is None:
            self._f = open(os.path.join(self.run_dir, "metrics.jsonl"), "a")
            self._tb = tensorboard_writer(self.run_dir, self.tensorboard)
        self._f.write(json.dumps(jsonable(record)) + "\n")
        self._f.flush()
        if self._tb is not None:
            prefix = "train" if record.get("kind") == "train" else f"eval_{record.get('split', 'val')}"
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "epoch"):
                    self._tb.add_scalar(f"{prefix}/{k}", v, record["step"])

    def drop_after(self, step: int) -> int:
        """Remove from ``metrics.jsonl`` the records of steps after ``step`` (a resumed run's
        checkpoint: an interrupted attempt logged them past its last kept checkpoint, and the
        resumed run logs those steps again) and a torn last line; rank 0, the file rewritten
        whole (temp file + rename).  Returns the number of records dropped.  TensorBoard event
        files are append-only: their readers take the newest value of a step."""
        path = os.path.join(self.run_dir, "metrics.jsonl")
        if not self.is_main or not os.path.isfile(path):
            return 0
        self.close()
        keep, dropped = [], 0
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                    past = int(rec.get("step", 0)) > step
                except (ValueError, TypeError, AttributeError):
                    past = True  # a line torn by the kill
                if past:
                    dropped += 1
                else:
                    keep.append(line if line.endswith("\n") else line + "\n")
        if dropped:
            from dlrmctl.fileio import write_text_atomic

            write_text_atomic(path, "".join(keep))
        return dropped

    def close(self) -> None:
        """Close the file and the writer (a later :meth:`write` opens them again)."""
        if self._f is not None:
            self._f.close()
            if self._tb is not None:
                self._tb.close()
        self._f = self._tb = None


def check_tensorboard(setting: bool | str) -> None:
    """``train.tensorboard: true`` needs TensorBoard (``torch.utils.tensorboard`` and the
    ``tensorboard`` package); ``auto`` / ``false`` need nothing.

    Raises:
        TrainError: ``true`` and it does not import (names the key, the import error and the remedy).
    """
    if setting is not True:
        return
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as e:
        raise TrainError(f"train.tensorboard: true, but TensorBoard logging cannot start ({e}); install it "
                         "(`pip install tensorboard`), or set train.tensorboard: auto (log when it is installed) "
                         "or false") from None


def tensorboard_writer(run_dir: str, setting: bool | str = "auto") -> Any:
    """A TensorBoard SummaryWriter on ``run_dir/tensorboard`` (``train.tensorboard``: ``auto`` when
    tensorboard is installed, ``true`` always, see :func:`check_tensorboard`), else None."""
    if setting is False:
        return None
    check_tensorboard(setting)
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(os.path.join(run_dir, "tensorboard"))


def model_size_line(tables: list, dense_params: list, embedding_precision: str = "fp32") -> str:
    """The model's size as rank 0 prints it at start (any world size): total parameters, the
    embedding tables' (rows x dim over all tables, whole: not a rank's shards) and the dense
    layers' (MLPs, interaction, projections: replicated on every rank), and their weight bytes
    (embeddings at ``model.embedding_precision``, dense at their dtype; optimizer state not
    counted; MB = 10^6 bytes).

    Args:
        tables: the EmbeddingBagConfigs (``num_embeddings``, ``embedding_dim``).
        dense_params: the dense parameters (tensors; their ``numel`` / ``element_size``).
    """
    emb = sum(int(t.num_embeddings) * int(t.embedding_dim) for t in tables)
    emb_bytes = emb * (2 if embedding_precision in ("fp16", "bf16") else 4)
    dense = sum(p.numel() for p in dense_params)
    dense_bytes = sum(p.numel() * p.element_size() for p in dense_params)
    dtypes = sorted({str(p.dtype).replace("torch.float32", "fp32").replace("torch.", "") for p in dense_params})
    return (f"model: {emb + dense:,} parameters, {(emb_bytes + dense_bytes) / 1e6:,.2f} MB of weights: "
            f"embeddings {emb:,} ({len(tables)} tables, {emb_bytes / 1e6:,.2f} MB {embedding_precision}), "
            f"dense {dense:,} ({dense_bytes / 1e6:,.3f} MB {'/'.join(dtypes) or 'fp32'})")


def dense_fallback_line(num_dense_tables: int, has_fbgemm: bool, device: torch.device | str) -> str | None:
    """What rank 0 prints at start when the tables run on the ``dense`` kernel because fbgemm_gpu is
    absent (a GPU machine without it: every table), or None (FBGEMM present, or no dense table).

    ``num_dense_tables``: this rank's dense-kernel table shards (``embedding_dense_parameters()``).
    The fallback is one ``nn.EmbeddingBag`` lookup and one optimizer pass per table each step, so
    its throughput is not FBGEMM's: the line, and the epoch line's ``dense fallback``, say so."""
    if has_fbgemm or num_dense_tables == 0:
        return None
    return (f"embeddings: dense fallback (fbgemm_gpu is not installed): {num_dense_tables} table shard(s) on "
            f"torch.nn.EmbeddingBag on {torch.device(device).type}, one lookup and one optimizer pass per table "
            "each step; this run's samples/s are the fallback's, not FBGEMM's")


class EpochProgress:
    """Rank-0 progress of one epoch (:class:`dlrmctl.console.Progress`): a bar on a terminal, a line
    every ``train.progress_every_s`` seconds otherwise.  Counts global steps; shows samples/s and the
    latest loss read from the device (every ``train.log_every`` steps, see :meth:`LossWindow.read`) with its step."""

    def __init__(self, total: int, initial: int, enabled: bool, desc: str, every_s: float) -> None:
        self.p = Progress(total, desc, "step", enabled=enabled, every_s=every_s, initial=initial)

    def update(self, loss: float | None, loss_step: int, sps: float) -> None:
        """One step done; ``loss``: the latest loss read (at step ``loss_step``), or None."""
        self.p.update(1, **{"samples/s": f"{sps:,.0f}",
                            "loss": "-" if loss is None else f"{loss:.4f} (step {loss_step})"})

    def close(self) -> None:
        """End the bar (or print the last line)."""
        self.p.close()
