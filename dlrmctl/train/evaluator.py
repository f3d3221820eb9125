"""Evaluation during training: metrics over the whole validation split (each rank scores its
own rows), the best evaluation so far (``train.keep_best``), early stopping
(``train.early_stopping_patience``) and when validation is due (``train.eval_every``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import torch

from dlrmctl.config import ExperimentConfig
from dlrmctl.console import Progress, echo
from dlrmctl.distributed.env import full_fp32_matmul
from dlrmctl.train.data import aligned_epoch, aligned_num_batches, loader_features, make_loader
from dlrmctl.metrics import compute_metrics_from_logits
from dlrmctl.train.run_dir import TrainError
from dlrmctl.train.train_log import MetricsLog, jsonable

if TYPE_CHECKING:
    from dlrmctl.data.batch import Batch
    from dlrmctl.distributed.env import RunEnv
    from dlrmctl.distributed.model_parallel import TrainModel


def is_defined(m: dict[str, float], keep_best: str) -> bool:
    """The ``keep_best`` metric of ``m`` is a real score: not NaN, and (AUC) the split has both
    classes (a single-class split reports AUC 0.5 by convention, which says nothing about the model)."""
    if keep_best == "ne":
        return not math.isnan(m.get("ne", math.nan))
    ctr = m.get("ctr", 0.5)
    return not math.isnan(m.get("auc", math.nan)) and not (isinstance(ctr, float) and ctr in (0.0, 1.0))


def is_better(m: dict[str, float], best: dict[str, float], keep_best: str) -> bool:
    """``m`` beats ``best`` on the ``train.keep_best`` metric (``none``: AUC, for the summary only):
    an undefined score (NaN, single-class AUC) never wins, and any defined one beats an undefined one."""
    if not is_defined(m, keep_best):
        return False
    if not is_defined(best, keep_best):
        return True
    if keep_best == "ne":
        return m["ne"] < best["ne"]
    return m["auc"] > best["auc"]




def undefined_best_note(best: dict[str, Any], keep_best: str, split: str) -> str | None:
    """What the end-of-run line says when the run's best ``keep_best`` score is undefined (every
    evaluation so far had NaN, or a ``split`` of one class only, whose AUC 0.5 is a convention and
    whose NE divides by the zero log loss of its CTR):
    why, and that no checkpoint was kept as ``best`` (an undefined score never wins,
    :func:`is_better`).  None when the score is defined."""
    if is_defined(best, keep_best):
        return None
    ctr = best.get("ctr")
    one_class = isinstance(ctr, float) and ctr in (0.0, 1.0)
    if keep_best != "ne" and one_class:
        why = (f"every {split} row has label {int(ctr)}, and AUC needs both classes (0.5 is reported "
               "by convention)")
    elif one_class:  # NE = logloss / the CTR prior's log loss, which is 0 on one class
        why = (f"every {split} row has label {int(ctr)}, so the log loss of predicting its CTR ({ctr:g}) is 0 "
               "and NE, the log loss divided by it, has no value; a split with both labels gives one "
               "(or train.keep_best: auc | none)")
    else:
        why = f"the {keep_best.upper() if keep_best != 'none' else 'AUC'} of {split} is NaN"
    return (f" (undefined: {why}; no evaluation of this run had a defined score, so no checkpoint is kept "
            "as 'best': evaluate and export take the last checkpoint)")


class Evaluator:
    """Validation of one trainer, and what follows from it.

    Args:
        cfg: the experiment (``data.val_split``, ``data.eval_batch_size``, ``train.eval_every``,
            ``train.keep_best``, ``train.early_stopping_patience``).
        env: this rank.
        meta / tables / num_dense / weighted: the data's meta.json, the resolved tables, dense
            columns and whether the KJTs carry weights (the loader and empty padding batches).
        model: the trained model (put in eval mode while scoring).
        logits: ``batch -> logits [B] float32`` of a device-resident batch, in fp32 (no autocast).
        metrics_log: where an evaluation record goes.

    Attributes:
        best: the best evaluation so far (``{metrics..., "step"}``; an undefined first score is
            kept until a defined one comes), or None.
        evals_since_best: evaluations in a row without a new best.
        last_eval: the latest evaluation as the checkpoint records it (``step``, ``split``).
        latest / latest_step: the latest metrics and their step (-1: none in this run).
    """

    def __init__(self, cfg: ExperimentConfig, env: "RunEnv", meta: dict[str, Any], tables: list, num_dense: int,
                 weighted: bool, model: "TrainModel", logits: Callable[["Batch"], torch.Tensor],
                 metrics_log: MetricsLog) -> None:
        self.cfg = cfg
        self.env = env
        self.meta = meta
        self.tables = tables
        self.num_dense = num_dense
        self.weighted = weighted
        self.model = model
        self.logits = logits
        self.metrics_log = metrics_log
        self.best: dict[str, float] | None = None
        self.evals_since_best = 0
        self.last_eval: dict[str, Any] | None = None
        self.latest: dict[str, Any] | None = None
        self.latest_step = -1
        self._improved = False  # the latest evaluation is a new best (train.keep_best)

    # ------------------------------------------------------------ timing
    def should_validate(self, step: int) -> bool:
        """``train.eval_every`` says step ``step`` is evaluated."""
        every = self.cfg.train.eval_every
        return bool(every and step % every == 0)

    def validated(self, step: int) -> bool:
        """Step ``step`` has been evaluated already (in this run, or before its checkpoint)."""
        return self.latest_step == step and self.latest is not None

    def should_stop(self) -> bool:
        """``train.early_stopping_patience`` evaluations in a row did not improve on the best
        ``train.keep_best`` metric (the same answer on every rank: the metrics are broadcast)."""
        p = self.cfg.train.early_stopping_patience
        return bool(p) and self.evals_since_best >= p

    def take_new_best(self) -> bool:
        """The latest evaluation is a new best (same on every rank); the flag is cleared, so the
        checkpoint that may keep it (:meth:`Checkpointer.maybe_save`) is told once."""
        improved, self._improved = self._improved, False
        return improved

    # --------------------------------------------------------- evaluate
    @torch.no_grad()
    def evaluate(self, split: str | None = None, data_dir: str | None = None) -> dict[str, float]:
        """Metrics over the WHOLE split, computed where the logits are: each rank keeps its own rows.

        Computed from the logits in float64 (:func:`~dlrmctl.metrics.compute_metrics_from_logits`
        with the process group): AUC ranks logits (no float32-sigmoid saturation), log loss uses a
        stable log-sigmoid; one class only gives AUC 0.5 and a logged warning.  Exact sums, so the
        figure is bit-identical for any world size and eval batch size.  Memory per rank: its own
        ``[n_local, 2]`` float32 logits and labels, float64 copies and the AUC ring's buffers
        (O(local rows), never all N rows).  The model runs in eval mode: the sharded collections
        then send pooled embeddings at full precision (``sharding.comm_precision`` is a
        training-speed setting), so the val metrics that pick ``keep_best`` and stop early are
        those of the checkpoint as ``dlrmctl evaluate`` and the fp32 export compute them; for the
        same reason fp32 GEMMs run at full precision on CUDA (no TF32 whatever ``train.tf32`` says).

        Returns:
            ``{"auc", "logloss", "ne", "calibration", "accuracy", "ctr", "num_samples"}`` (every rank).
        """
        with full_fp32_matmul(self.env.device):  # train.tf32 is a training-speed setting, as comm_precision
            return self._evaluate(split, data_dir)

    def _evaluate(self, split: str | None, data_dir: str | None) -> dict[str, float]:
        split = split or self.cfg.data.val_split
        loader = make_loader(self.cfg, self.meta, split, self.env, data_dir=data_dir, tables=self.tables)
        self.model.eval()
        rows: list[torch.Tensor] = []  # [b, 2] float32: logit, label (on the device)
        n_batches = aligned_num_batches(self.env, len(loader))
        bar = Progress(n_batches, f"eval {split}", "batch", enabled=self.env.is_main and self.cfg.train.progress,
                       every_s=self.cfg.train.progress_every_s, final_line=False, leave=False)
        features = loader_features(self.tables)
        for batch in aligned_epoch(loader, n_batches, self.num_dense, features, self.weighted):
            batch = batch.to(self.env.device)
            z = self.logits(batch)
            rows.append(torch.stack([z, batch.labels.float()], dim=1))
            bar.update(1)
        bar.close()
        self.model.train()
        local = (torch.cat(rows) if rows else torch.zeros(0, 2, device=self.env.device)).cpu().numpy()
        del rows
        # exact distributed metrics: each rank keeps its own rows (O(local rows) memory); only the
        # rarer class's rows travel around a ring of point-to-point shifts (see metrics/compute.py)
        return compute_metrics_from_logits(local[:, 0], local[:, 1], pg=self.env.pg, device=self.env.device)

    def validate(self, step: int, epoch: int, tag: str) -> dict[str, float]:
        """Evaluate ``data.val_split`` at ``step``, update the best and the early-stopping count,
        log the record (``epoch``: numbered from 1) and print one line (rank 0).

        Raises:
            TrainError: the model's scores are not finite (the training diverged: its weights went
                inf/nan after the last finite loss); nothing of this evaluation is recorded or kept.
        """
        m = self.evaluate()
        if m["num_samples"] > 0 and not math.isfinite(m["logloss"]):  # every rank: the same all-rank metrics
            raise TrainError(f"the model diverged: its {self.cfg.data.val_split} scores at step {step} are not "
                             "finite (nan/inf); lower the learning rate or model.embedding_init_max (no evaluation "
                             "or checkpoint of this model was made)")
        kb = self.cfg.train.keep_best
        if (self.best is None and is_defined(m, kb)) or (self.best is not None and is_better(m, self.best, kb)):
            self.best = dict(m, step=step)
            self._improved = True
            self.evals_since_best = 0
        else:
            self.evals_since_best += 1
            if self.best is None:  # an undefined score (NaN, one class) is reported but never kept as best
                self.best = dict(m, step=step)
        self.last_eval = dict(jsonable(m), step=step, split=self.cfg.data.val_split)
        self.latest, self.latest_step = m, step
        self.metrics_log.write({"kind": "eval", "split": self.cfg.data.val_split, "step": step, "epoch": epoch, **m})
        if self.env.is_main:
            echo(
                f"[{tag}] step {step} {self.cfg.data.val_split}: AUC {m['auc']:.4f}  logloss {m['logloss']:.4f}  "
                f"NE {m['ne']:.4f}  calibration {m['calibration']:.3f}  accuracy {m['accuracy']:.4f}  (n={m['num_samples']})"
            )
        return m

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: ``{"best", "evals_since_best"}``."""
        return {"best": self.best, "evals_since_best": self.evals_since_best}

    def load_state_dict(self, state: dict[str, Any], restored_eval: dict[str, Any] | None = None,
                        step: int = 0) -> None:
        """Restore :meth:`state_dict` (``evals_since_best`` absent in checkpoints before early
        stopping); ``restored_eval``: the metrics the checkpoint recorded for its own ``step``
        on this val split (that step is not evaluated again)."""
        self.best = state["best"]
        self.evals_since_best = int(state.get("evals_since_best", 0))
        if restored_eval is not None:
            self.latest, self.latest_step = dict(restored_eval), step
