"""The trainer: one rank of a training run (single process or one rank of a sharded job).

Reads top to bottom like torchtitan's ``Trainer.train()``: build the model, shard it (world
size > 1), restore the last checkpoint if resuming, then loop ``train_step`` and ask the
components what is due (the metrics log: a loss record; the evaluator: validation, early
stopping; the checkpointer: a save), and finish with a final evaluation and checkpoint.

Loss semantics (exact parity between world sizes): on each rank
``loss = sum over local samples of BCEWithLogits / global batch size``; sharded
embedding gradients are summed by the backward all-to-all and dense gradients
are all-reduced with SUM, so every update equals the single-process update on
the same global batch.  The logged loss is the global-batch mean.

Ways in for tests and tools: the public components (``optimizers``, ``amp``, ``evaluator``,
``checkpointer``, ``metrics_log``, ``loss_window``) and :meth:`Trainer.run_step` (what the
pipeline calls per step) may be wrapped on an instance before :meth:`Trainer.train`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import torch

from dlrmctl import _fbgemm
from dlrmctl.config import (ExperimentConfig, meta_as_trained, read_data_meta, recorded_weighted_features,
                            resolve_tables, weighted_features)
from dlrmctl.console import echo
from dlrmctl.data.batch import Batch
from dlrmctl.distributed.env import RunEnv, apply_matmul_precision
from dlrmctl.distributed.model_parallel import TrainModel
from dlrmctl.fileio import write_text_atomic
from dlrmctl.modules.mlp import apply_cpu_linear
from dlrmctl.train.amp import MixedPrecision
from dlrmctl.train.checkpoint import Checkpointer, check_shared_checkpoint_dir, load_checkpoint_meta, resolve_resume
from dlrmctl.train.data import aligned_epoch, aligned_num_batches, loader_features, make_loader
from dlrmctl.train.evaluator import Evaluator, undefined_best_note
from dlrmctl.train.factory import attach_eviction_optimizer, build_model, init_from_train_split
from dlrmctl.train.init_from import restore_init_from
from dlrmctl.train.malloc_tuning import tune_glibc_malloc
from dlrmctl.train.optimizers import TrainOptimizers
from dlrmctl.train.pipeline import make_pipeline
from dlrmctl.train.plan import plan_rank_summary, resolve_plan
from dlrmctl.train.run_dir import TrainError, check_train_splits, finish_replacement
from dlrmctl.train.train_log import (EpochProgress, LossWindow, MetricsLog, check_tensorboard, dense_fallback_line, jsonable,
                                     model_size_line)

log = logging.getLogger("dlrmctl.train")


def resolve_device(cfg: ExperimentConfig) -> torch.device:
    """``train.device``: ``cuda`` (current device) when asked or when ``auto`` finds CUDA, else ``cpu``.

    Raises:
        TrainError: ``cuda`` asked for, but this torch build has no CUDA or sees no GPU.
    """
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        if torch.version.cuda is None:
            raise TrainError(f"train.device=cuda but this torch build has no CUDA (torch {torch.__version__}); "
                             f"install the gpu extra (pip install 'dlrmctl[gpu]' with a CUDA torch) or use "
                             f"--set train.device=cpu")
        raise TrainError(f"train.device=cuda but torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}); run on a "
                         f"machine with a GPU or use --set train.device=cpu")
    if cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Trainer:
    """One rank of a training run.

    Args:
        cfg: the experiment.
        env: rank / world / device (:class:`~dlrmctl.distributed.env.RunEnv`).
        run_dir: ``runs/<name>``; created by rank 0.
        resume: restore the newest checkpoint in ``run_dir``.
        plan: sharding plan for world size > 1 (None: from config / planner).
        checkpoint: with ``resume``, the checkpoint to restore: ``best``, ``last`` (default) or a step.

    Attributes:
        step / epoch: global steps trained, epochs finished (the trainer's own counters).
        model: the DLRM, or its DistributedModelParallel when sharded.
        optimizers / amp / evaluator / checkpointer / metrics_log / loss_window: the components.

    Raises:
        TrainError: missing data (names the path and the command to create it).
        ConfigError: resuming a checkpoint without a ``weighted_features`` record whose weighting
            cannot be told (:func:`dlrmctl.config.recorded_weighted_features`).
    """

    def __init__(self, cfg: ExperimentConfig, env: RunEnv, run_dir: str, resume: bool = False, plan: Any = None,
                 checkpoint: str | None = None, init_from: str | None = None):
        if cfg.train.malloc_tuning:
            tune_glibc_malloc()
        check_tensorboard(cfg.train.tensorboard)  # before any work: not at the first metrics record
        self.cfg, self.env, self.run_dir, self.device = cfg, env, run_dir, env.device
        apply_matmul_precision(self.device, cfg.train.tf32)  # TF32 GEMMs on CUDA (train.tf32); cpu: nothing
        # several nodes: every rank must see the directory rank 0 creates the checkpoints in (one host: no-op).
        # torchrun's LOCAL_WORLD_SIZE counts the real nodes even when sharding.local_world_size says otherwise
        per_node = min(env.local_world_size, int(os.environ.get("LOCAL_WORLD_SIZE") or env.local_world_size))
        check_shared_checkpoint_dir(run_dir, env.rank, env.world_size, per_node, env.pg)
        self.meta = read_data_meta(cfg)
        if self.meta is None:
            raise TrainError(
                f"data.path {cfg.data.path!r} has no meta.json: run `dlrmctl preprocess ... --out {cfg.data.path}` first"
            )
        check_train_splits(cfg, self.meta)
        # the checkpoint a resume restores, resolved once (LATEST may move meanwhile: a run writing beside it)
        resume_from = resolve_resume(run_dir, checkpoint) if resume else None
        if resume_from is not None:  # the weighted features the run trained with, not today's resolution
            self.meta = meta_as_trained(self.meta, recorded_weighted_features(
                cfg, load_checkpoint_meta(resume_from.path).get("weighted_features"), self.meta,
                os.path.join(resume_from.path, "meta.json")))
        self.tables = resolve_tables(cfg, self.meta)
        self.num_dense = len(self.meta["dense_features"])
        # ids are range-checked by the loader on the CPU batch (no device reads in the step)
        self.model: TrainModel = build_model(cfg, self.tables, self.num_dense, device=self.device,
                                             sparse_placeholder=env.sharded, check_ids=False, meta=self.meta)
        try:  # train.cpu_linear, resolved on this machine; a line when the MLPs train on oneDNN
            cpu_linear_line = apply_cpu_linear(self.model, cfg.train.cpu_linear, self.device, cfg.train.precision)
        except ValueError as e:
            raise TrainError(str(e)) from None
        if resume_from is None:
            # a resumed run's checkpoint holds these values: no pass over the train split for nothing
            init_from_train_split(self.model, cfg, self.meta)
        self.plan = None
        if env.sharded:
            self._shard(plan)
        self.optimizers = TrainOptimizers.for_model(self.model, cfg)
        attach_eviction_optimizer(self.model, self.optimizers.embedding_dense)  # managed-collision tables
        fallback = dense_fallback_line(len(self.model.embedding_dense_parameters()), _fbgemm.HAS_FBGEMM, self.device)
        #: "dense fallback" when the tables run on nn.EmbeddingBag for want of fbgemm_gpu (in the figures)
        self.kernel_note = "dense fallback" if fallback else None
        if env.is_main:  # one line on every world size (a sharded run prints its plan beside it)
            echo(model_size_line(self.tables, self.model.dense_parameters(), cfg.model.embedding_precision))
            for line in filter(None, (cpu_linear_line, fallback)):
                echo(line)
        self.amp = MixedPrecision(cfg.train.precision, self.device, env.pg)
        # each input feature once, also when several tables look it up
        self.feature_names = loader_features(self.tables)
        self.train_loader = make_loader(cfg, self.meta, cfg.data.train_split, env, train=True, tables=self.tables)
        if len(self.train_loader) == 0:
            raise TrainError(
                f"{cfg.data.path}: split '{cfg.data.train_split}' gives no training batch "
                f"({self.train_loader.num_rows} rows, data.batch_size {cfg.data.batch_size}, "
                f"data.drop_last {cfg.data.drop_last})"
            )
        self.weighted_features = weighted_features(cfg, self.meta)
        self.weighted = bool(self.weighted_features)  # the KJTs carry per-id weights
        self.loss_window = LossWindow(env)
        self.metrics_log = MetricsLog(run_dir, env.is_main, cfg.train.log_every, cfg.train.tensorboard)
        self.evaluator = Evaluator(cfg, env, self.meta, self.tables, self.num_dense, self.weighted, self.model,
                                   lambda batch: self.logits(batch, None, autocast=False), self.metrics_log)
        self.checkpointer = Checkpointer(cfg, env, run_dir, self.model, self.optimizers, self.plan, self.state_dict,
                                         after_save=finish_replacement, weighted_features=self.weighted_features)
        self.step = 0
        self.epoch = 0
        self._batches_done = 0  # batches of the current epoch trained
        if resume:
            self._restore(resume_from)
        elif init_from:  # a new run from another run's checkpoint (dlrmctl.train.init_from)
            restore_init_from(init_from, self)

    # ------------------------------------------------------------- set-up
    def _shard(self, plan: Any) -> None:
        from dlrmctl.distributed.model_parallel import DistributedModelParallel, describe_plan
        from dlrmctl.train.factory import embedding_optimizer_spec

        from dlrmctl.config import check_managed_collision_sharding

        check_managed_collision_sharding(self.cfg, self.meta, self.env.world_size)
        if plan is None:
            plan = resolve_plan(self.cfg, self.tables, self.env, self.meta)
        mc = getattr(self.model.sparse_arch, "managed_collision_configs", None)
        if mc is not None:  # managed-collision tables are sharded row_wise by zone, whatever the planner chose
            from dlrmctl.distributed.sharded_mc import managed_collision_plan

            given, plan = plan, managed_collision_plan(plan, mc[0], self.cfg.model.compute_kernel)
            moved = [t.name for t in mc[0] if given.plan[t.name] != plan.plan[t.name]]
            if moved and self.cfg.sharding.plan_file and self.env.is_main:  # never silently depart from a given plan
                log.warning("the plan %s lays managed-collision table(s) %s out otherwise; they train row_wise by "
                            "zone of their buckets (the layout `dlrmctl plan` writes for them)",
                            self.cfg.sharding.plan_file, ", ".join(moved))
        plan.validate(self.tables, self.env.world_size, where="sharding plan")
        self.plan = plan
        self.model = DistributedModelParallel(
            self.model, self.env.sharding_env, plan, embedding_optimizer_spec(self.cfg), seed=self.cfg.train.seed,
            check_ids=False, comm_precision=self.cfg.sharding.comm_precision,
            overlap_output_dist=self.cfg.sharding.overlap_output_dist,
        )
        if self.env.is_main:
            from dlrmctl.planner.enumerator import COLUMN_TYPES, column_shards_change_training

            cw = [n for n, ps in plan.plan.items() if ps.sharding_type in COLUMN_TYPES and len(ps.shards or []) > 1]
            if cw and column_shards_change_training(self.cfg.optimizer.embedding.type):
                log.warning("tables %s are column-sharded under %s: each column shard keeps its own per-row "
                            "state (accumulator / second moment / trust ratio), so training differs from one "
                            "process (use exact_adagrad / exact_sgd / adam, or another sharding type, for identical "
                            "results)", cw, self.cfg.optimizer.embedding.type)
            text = describe_plan(plan, self.tables)
            origin = (f"from {self.cfg.sharding.plan_file}" if self.cfg.sharding.plan_file
                      else "from the planner" + (" and sharding.tables" if self.cfg.sharding.tables else ""))
            echo(plan_rank_summary(plan, self.tables, origin, os.path.join(self.run_dir, "plan.txt")))
            log.debug("sharding plan:\n%s", text)
            os.makedirs(self.run_dir, exist_ok=True)
            plan.save(os.path.join(self.run_dir, "plan.yaml"))
            with open(os.path.join(self.run_dir, "plan.txt"), "w") as f:
                f.write(text + "\n")


    # --------------------------------------------------------------- step
    def _global_batch_size(self, local: int, sparse_ctx: Any) -> int | torch.Tensor:
        """Samples in this step over all ranks: host ints from the input_dist size exchange
        when it saw every rank, else one all-reduce on the device (no host read)."""
        if not self.env.sharded:
            return local
        sizes = getattr(sparse_ctx, "full_batch_sizes", None)
        if sizes is not None and len(sizes) == self.env.world_size:
            return int(sum(sizes))
        t = torch.full((), float(local), dtype=torch.float32, device=self.device)  # 0-d, filled on the device
        self.env.all_reduce_sum(t)
        return t

    def train_step(self, batch: Batch) -> torch.Tensor:
        """Forward, backward, optimizer steps on one (host) batch.

        Returns:
            this rank's share of the global-batch mean loss, a detached 0-d tensor on the
            device (summed over ranks it is the global loss; read it with ``loss_window.read``).
        """
        return self.run_step(batch.to(self.device, non_blocking=True), None)

    def run_step(self, batch: Batch, sparse_ctx: Any, after_forward: Any = None) -> torch.Tensor:
        """One step on a device-resident batch (what the pipeline calls; a test may wrap it); ``sparse_ctx``:
        its finished input_dist (pipelined) or None; ``after_forward``: called once the forward is
        queued, before the backward (the sparse_dist pipeline starts the next batch's input_dist there).

        No host reads: the loss stays on the device (see :class:`~dlrmctl.train.train_log.LossWindow`)."""
        self.optimizers.set_lr(self.step)
        if sparse_ctx is None and self.env.sharded:
            sparse_ctx = self.model.sparse_input_dist(batch.sparse_features).wait()
        gbs = self._global_batch_size(batch.labels.numel(), sparse_ctx)
        logits = self.logits(batch, sparse_ctx)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum") / gbs
        if after_forward is not None:
            after_forward()
        self.optimizers.zero_grad()
        self.amp.backward_and_step(loss, self.optimizers)
        self.step += 1
        out = loss.detach()
        self.loss_window.accumulate(out)
        return out

    def logits(self, batch: Batch, sparse_ctx: Any = None, autocast: bool = True) -> torch.Tensor:
        """Logits ``[B]`` float32 of a device-resident batch: the embedding lookups (and their
        output_dist) in the embeddings' precision, the dense arch / interaction / over arch under
        ``train.precision``'s autocast (``autocast=False``: in fp32, as evaluation runs);
        ``sparse_ctx``: a finished input_dist (sharded) or None."""
        if sparse_ctx is None and self.env.sharded:
            sparse_ctx = self.model.sparse_input_dist(batch.sparse_features).wait()
        if sparse_ctx is None:
            embedded = self.model.sparse_arch(batch.sparse_features)
        else:
            # with sharding.overlap_output_dist an Awaitable[KeyedTensor]: dense_forward waits on
            # it after the dense arch (the GradScaler path needs the values now)
            embedded = self.model.compute_and_output_dist(sparse_ctx)
        embedded = self.amp.unscale_embeddings(embedded)
        with self.amp.autocast(autocast):
            logits = self.model.dense_forward(batch.dense_features, embedded)
        return logits.squeeze(1).float()

    @torch.no_grad()
    def evaluate(self, split: str | None = None, data_dir: str | None = None) -> dict[str, float]:
        """Metrics of the model now over the whole ``split`` (:meth:`Evaluator.evaluate`; collective)."""
        return self.evaluator.evaluate(split, data_dir)

    # -------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The trainer's part of a checkpoint (``meta/trainer``): step, epoch, best,
        evaluations since the best, and the data position (batches trained this epoch: the
        loader may have prefetched further)."""
        ev = self.evaluator.state_dict()
        return {"step": self.step, "epoch": self.epoch, "best": ev["best"], "evals_since_best": ev["evals_since_best"],
                "data": {"epoch": self.epoch, "batches_yielded": self._batches_done,
                         "order": self.train_loader.order()}}

    def save(self) -> str:
        """Write a checkpoint of this step (collective); it becomes the run's best when this
        step's evaluation improved on the best (``train.keep_best``)."""
        return self.checkpointer.save(self.step, self.evaluator.take_new_best(), self.evaluator.last_eval)

    def _maybe_checkpoint(self, last_step: bool = False) -> None:
        self.checkpointer.maybe_save(self.step, last_step=last_step, new_best=self.evaluator.take_new_best(),
                                     eval_record=self.evaluator.last_eval)

    def _restore(self, which: Any) -> None:
        """Load the checkpoint ``which`` (:class:`~dlrmctl.train.checkpoint.ResumePoint`; None: nothing to
        resume from): any world size / plan."""
        if which is None:
            log.info("no checkpoint in %s: starting from scratch", self.run_dir)
            return
        saved = self.checkpointer.load(which)
        tr = saved["trainer"]
        try:
            self.train_loader.load_state_dict(tr["data"])
        except ValueError as e:
            raise TrainError(f"{saved['path']}: {e}") from None
        self.step, self.epoch = tr["step"], tr["epoch"]
        self._batches_done = int(tr["data"]["batches_yielded"])
        ev = saved["eval"]
        restored = None  # the validation metrics the checkpoint recorded at its own step (this split)
        if isinstance(ev, dict) and ev.get("step") == self.step and ev.get("split") == self.cfg.data.val_split:
            restored = {k: v for k, v in ev.items() if k not in ("step", "split")}
        self.evaluator.load_state_dict(tr, restored, self.step)
        self.metrics_log.drop_after(self.step)  # records of steps past the checkpoint are logged again
        if self.env.is_main:  # a line like the run's others (not a log record)
            echo(f"resumed from {saved['path']} (step {self.step}, saved by {saved['world_size']} rank(s))")

    # ---------------------------------------------------------------- run
    def epoch_number(self) -> int:
        """The epoch the latest step belongs to, numbered from 1 as everywhere the user sees epochs
        (console, metrics.jsonl, ``dlrmctl report``); ``self.epoch`` counts finished epochs."""
        return self.epoch + 1 if self._batches_done > 0 or self.epoch == 0 else self.epoch

    def train(self) -> dict[str, Any]:
        """Run the configured epochs / steps; returns ``{"final": metrics, "best": metrics, "steps": int,
        "train_seconds": float, "early_stopped": bool}`` (also written to ``summary.json``)."""
        cfg = self.cfg.train
        if self.env.is_main:
            os.makedirs(self.run_dir, exist_ok=True)
        t_start = time.perf_counter()
        sparse_dist = self.model.sparse_input_dist if self.env.sharded else None
        pipe = make_pipeline(cfg.pipeline, self.device, self.run_step, sparse_dist)
        stopped = self.evaluator.should_stop()  # resuming a run that stopped early: nothing more to train
        done = stopped or self.epoch >= cfg.epochs or (cfg.max_steps is not None and self.step >= cfg.max_steps)
        if done and self.step > 0 and self.env.is_main:  # resuming a run that had finished
            echo(f"the run had already finished at step {self.step}: nothing to train")
        while (not stopped and self.epoch < cfg.epochs
               and (cfg.max_steps is None or self.step < cfg.max_steps)):
            stopped, finished = self._train_epoch(pipe)
            if not finished:  # stopped by max_steps (or early stopping) mid-epoch
                break
            self.epoch += 1
            self._batches_done = 0
            self.train_loader.set_epoch(self.epoch)
            if not self.evaluator.validated(self.step):
                self.evaluator.validate(self.step, self.epoch_number(), f"epoch {self.epoch}")
                self._maybe_checkpoint()
                stopped = self.evaluator.should_stop()
        if stopped and not done and self.env.is_main:  # (a finished run's stop was said when it stopped)
            ev = self.evaluator
            echo(f"early stopping at step {self.step}: {ev.evals_since_best} evaluation(s) without a better "
                 f"{self.cfg.data.val_split} {cfg.keep_best.upper()} than step {ev.best['step']} "
                 f"(train.early_stopping_patience {cfg.early_stopping_patience})")
        if not self.evaluator.validated(self.step):
            self.evaluator.validate(self.step, self.epoch_number(), "final")
        self._maybe_checkpoint(last_step=True)
        return self._finish(stopped, time.perf_counter() - t_start, keep_summary=done and self.step > 0)

    def _train_epoch(self, pipe: Any) -> tuple[bool, bool]:
        """Train (the rest of) epoch ``self.epoch``, up to ``train.max_steps``; returns
        ``(stopped early, the epoch's every batch trained)``."""
        cfg = self.cfg.train
        if self.train_loader.epoch != self.epoch:
            self.train_loader.set_epoch(self.epoch)
        n = aligned_num_batches(self.env, len(self.train_loader))
        self._batches_done = self.train_loader.state_dict()["batches_yielded"]  # > 0 when resuming mid-epoch
        todo = n - self._batches_done
        if cfg.max_steps is not None:
            todo = min(todo, cfg.max_steps - self.step)
        end = self._batches_done + max(todo, 0)  # this epoch stops after batch `end` (max_steps)
        progress = EpochProgress(self.step + max(todo, 0), self.step, self.env.is_main and cfg.progress,
                                 f"epoch {self.epoch + 1}/{cfg.epochs}", cfg.progress_every_s)
        pipe.reset(aligned_epoch(self.train_loader, todo, self.num_dense, self.feature_names, self.weighted))
        pipe.reset_stats()
        stopped = False
        while not stopped and pipe.progress() is not None:
            self._batches_done += 1
            stopped = self._after_step(pipe, progress, self._batches_done == end)
        progress.close()
        sh = pipe.stats.shares()
        if self.env.is_main and pipe.stats.steps:
            echo(f"epoch {self.epoch + 1}/{cfg.epochs}: {pipe.stats.steps} steps, {sh['samples_per_s'] * self.env.world_size:,.0f} "
                 f"samples/s ({cfg.pipeline} pipeline{', ' + self.kernel_note if self.kernel_note else ''}), waiting on data {100 * sh['data_wait_share']:.1f}% and on "
                 f"input_dist {100 * sh['comm_wait_share']:.1f}% of step time")
        return stopped, self._batches_done >= n

    def _after_step(self, pipe: Any, progress: EpochProgress, end_of_epoch: bool) -> bool:
        """Ask the components what this step is due for: a loss record, validation, a checkpoint.
        Returns True when early stopping ends the run here."""
        sh = pipe.stats.shares()
        sps = sh["samples_per_s"] * self.env.world_size
        # the loss stays on the device; it is read (one all-reduce + one host sync) every
        # log_every steps and at the end of the epoch (non-finite losses surface there)
        if self.metrics_log.is_due(self.step):
            loss, loss_avg = self.loss_window.read(self.step)
            # "loss": this step's; "loss_avg": mean over the steps since the last record
            self.metrics_log.write({"kind": "train", "step": self.step, "epoch": self.epoch + 1, "loss": loss,
                                    "loss_avg": loss_avg, "samples_per_s": sps,
                                    "data_wait_share": sh["data_wait_share"], "comm_wait_share": sh["comm_wait_share"],
                                    "lr_factor": self.optimizers.lr_factor(self.step - 1)})
        elif end_of_epoch:
            self.loss_window.read(self.step)
        progress.update(self.loss_window.last_loss, self.loss_window.last_loss_step, sps)
        eval_due = self.evaluator.should_validate(self.step)
        if eval_due or self.checkpointer.is_due(self.step):
            self.loss_window.check_finite(self.step)  # never evaluate or checkpoint a model that went non-finite
        if eval_due:
            self.evaluator.validate(self.step, self.epoch_number(), "eval")
        self._maybe_checkpoint()
        return eval_due and self.evaluator.should_stop()

    def _finish(self, stopped: bool, elapsed: float, keep_summary: bool = False) -> dict[str, Any]:
        """The run's summary: written to ``summary.json`` and a best line printed (rank 0).
        ``keep_summary`` (a resumed run that had finished): the summary its training wrote stays
        (its ``train_seconds`` is that of the training, not of this call)."""
        b, kb = self.evaluator.best, self.cfg.train.keep_best
        summary = {"final": self.evaluator.latest, "best": b, "steps": self.step, "train_seconds": elapsed,
                   "early_stopped": stopped}
        path = os.path.join(self.run_dir, "summary.json")
        kept_file = keep_summary and os.path.exists(path)
        if kept_file:
            with open(path) as f:
                summary["train_seconds"] = json.load(f).get("train_seconds", elapsed)
        if self.env.is_main and not kept_file:
            # a temp file renamed over it: a resumed run's previous summary (what `dlrmctl sweep` ranks)
            # is replaced whole or kept, never left truncated
            text = json.dumps({k: (jsonable(v) if isinstance(v, dict) else v) for k, v in summary.items()}, indent=1)
            write_text_atomic(path, text)
        if self.env.is_main:
            what = (f"NE {b['ne']:.4f} (AUC {b['auc']:.4f})" if kb == "ne" else f"AUC {b['auc']:.4f}")
            kept = "" if kb == "none" else (undefined_best_note(b, kb, self.cfg.data.val_split)
                                            or self.checkpointer.best_kept_note(b["step"]))
            echo(f"best {self.cfg.data.val_split} {what} at step {b['step']}{kept}; run directory {self.run_dir}")
        self.metrics_log.close()
        return summary
