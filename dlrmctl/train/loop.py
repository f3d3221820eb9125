"""The training loop (single process or one rank of a sharded job).

Reads top to bottom like torchtitan's ``Trainer.train()``: build the model,
shard it (world size > 1), restore the last checkpoint if resuming, then loop
``train_step`` -> evaluate if due -> checkpoint if due, and finish with a
final evaluation and checkpoint.

Loss semantics (exact parity between world sizes): on each rank
``loss = sum over local samples of BCEWithLogits / global batch size``; sharded
embedding gradients are summed by the backward all-to-all and dense gradients
are all-reduced with SUM, so every update equals the single-process update on
the same global batch.  The logged loss is the global-batch mean.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch
import yaml

from dlrmctl import outputs, run_lock
from dlrmctl.errors import UserError, check_output_dir
from dlrmctl.config import ExperimentConfig, read_data_meta, resolve_tables, to_dict, weighted_features
from dlrmctl.console import Progress, echo
from dlrmctl.distributed import comm
from dlrmctl.fileio import write_text_atomic
from dlrmctl.modules.dlrm import DLRM, set_cpu_linear
from dlrmctl.modules.embedding_configs import DataType
from dlrmctl.sparse import KeyedTensor
from dlrmctl.train import checkpoint as ckpt
from dlrmctl.train.factory import build_model
from dlrmctl.train.malloc_tuning import tune_glibc_malloc
from dlrmctl.train.metrics import compute_metrics_from_logits
from dlrmctl.train.pipeline import make_pipeline
from dlrmctl.train.optim import WarmupPolyDecay, dense_optimizer, embedding_optimizer_for_dense

log = logging.getLogger("dlrmctl.train")


class _UnscaleGrad(torch.autograd.Function):
    """Identity forward; backward divides the gradient by the GradScaler's current scale.

    Under ``train.precision: fp16`` the loss is scaled, but the embedding optimizers run
    inside the lookup's backward (FBGEMM's fused TBE) or straight after it on their own
    gradients: they must see the true gradient of the pooled embeddings, so it is unscaled
    where it leaves the dense part.

    Overflow: the scaler's first scales (2^16, growing) overflow fp16 now and then by design
    (Micikevicius et al., "Mixed Precision Training", ICLR 2018, sec. 3.2); the scaler then
    skips the dense step and halves the scale.  A fused embedding update cannot be skipped
    (it runs inside this backward), so a gradient ``[N, D]`` float32 with any inf/NaN is
    replaced by zeros (rows unchanged under the Adagrad family and SGD; Adam-family moments
    take one zero-gradient step) and ``found_inf`` (a 0-d float32 device tensor) is set to
    1, which :meth:`Trainer._run_step` hands to the scaler so that it also skips the dense
    step and backs off.  The flag is max-reduced over ``pg`` here, before the gradient goes
    back through the output_dist: a rank whose own gradient is finite zeroes it too, so no
    table takes a partial update from the other ranks' rows on a step every rank skips.  No
    host read here (the all-reduce runs on the device's stream).
    """

    @staticmethod
    def forward(ctx, values: torch.Tensor, scaler: Any, found_inf: torch.Tensor,  # type: ignore[override]
                pg: Any = None) -> torch.Tensor:
        ctx.scaler = scaler
        ctx.found_inf = found_inf
        ctx.pg = pg
        return values.view_as(values)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        scale = ctx.scaler._get_scale_async()  # the scale as a device tensor: no host read
        g = grad / (scale if scale is not None else ctx.scaler.get_scale())
        bad = (~torch.isfinite(g).all()).to(ctx.found_inf.dtype)
        comm.all_reduce(bad, ctx.pg, op="max")  # every rank zeroes (and skips) the same step
        ctx.found_inf.add_(bad)
        return torch.where(bad > 0, torch.zeros((), dtype=g.dtype, device=g.device), g), None, None, None


class TrainError(RuntimeError, UserError):
    """A run cannot start (bad run directory, missing data, ...)."""


@dataclass
class RunEnv:
    """Where this process runs: rank, world, device and (world > 1) the sharding env."""

    rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    #: dlrmctl.distributed.env.ShardingEnv: with world_size > 1, or a one-rank group (sharding.force)
    sharding_env: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def pg(self) -> Any:
        """The process group (``None`` for a plain single process)."""
        return getattr(self.sharding_env, "pg", None)

    @property
    def sharded(self) -> bool:
        """The model runs through DistributedModelParallel (several ranks, or one rank with a group)."""
        return self.world_size > 1 or self.pg is not None

    def barrier(self) -> None:
        comm.barrier(self.pg)

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        comm.all_reduce(x, self.pg)
        return x


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


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}


class Trainer:
    """One rank of a training run.

    Args:
        cfg: the experiment.
        env: rank / world / device (:class:`RunEnv`).
        run_dir: ``runs/<name>``; created by rank 0.
        resume: restore the newest checkpoint in ``run_dir``.
        plan: sharding plan for world size > 1 (None: from config / planner).
        checkpoint: with ``resume``, the checkpoint to restore: ``best``, ``last`` (default) or a step.

    Raises:
        TrainError: missing data (names the path and the command to create it).
    """

    def __init__(self, cfg: ExperimentConfig, env: RunEnv, run_dir: str, resume: bool = False, plan: Any = None,
                 checkpoint: str | None = None):
        from dlrmctl.data.loader import BatchLoader

        if cfg.train.malloc_tuning:
            tune_glibc_malloc()
        check_tensorboard(cfg.train.tensorboard)  # before any work: not at the first metrics record
        self.cfg = cfg
        self.env = env
        self.run_dir = run_dir
        self.device = env.device
        self.meta = read_data_meta(cfg)
        if self.meta is None:
            raise TrainError(
                f"data.path {cfg.data.path!r} has no meta.json: run `dlrmctl preprocess ... --out {cfg.data.path}` first"
            )
        check_train_splits(cfg, self.meta)
        self.tables = resolve_tables(cfg, self.meta)
        self.num_dense = len(self.meta["dense_features"])
        # ids are range-checked by the loader on the CPU batch (no device reads in the step)
        self.model: Any = build_model(cfg, self.tables, self.num_dense, device=self.device,
                                      sparse_placeholder=env.sharded, check_ids=False)
        if cfg.train.cpu_linear != "aten":
            try:
                set_cpu_linear(self.model, cfg.train.cpu_linear)
            except ValueError as e:
                raise TrainError(str(e)) from None
        if not (resume and (checkpoint is not None or ckpt.latest_checkpoint(run_dir) is not None)):
            # a resumed run's checkpoint holds these values: no pass over the train split for nothing
            init_from_train_split(self.model, cfg, self.meta)
        self.plan = None
        if env.sharded:
            self._shard(plan)
        self._build_optimizers()
        if cfg.train.precision == "fp16" and self.device.type != "cuda":
            raise TrainError(f"train.precision: fp16 autocast needs CUDA (a GradScaler on a GPU), the device is "
                             f"{self.device}; use bf16 on the CPU")
        #: fp16: loss scaling for the dense optimizer (torch.amp.GradScaler); None otherwise
        self.scaler = torch.amp.GradScaler(self.device.type) if cfg.train.precision == "fp16" else None
        #: fp16: 1 when this step's pooled-embedding gradient was non-finite (set by _UnscaleGrad)
        self._emb_found_inf = torch.zeros((), dtype=torch.float32, device=self.device)
        self.schedule = WarmupPolyDecay(cfg.optimizer.lr_schedule)
        # each input feature once, also when several tables look it up
        feats = list(dict.fromkeys(f for t in self.tables for f in t.feature_names))
        self.train_loader = BatchLoader(
            cfg.data.path, cfg.data.train_split, cfg.data.batch_size, rank=env.rank, world_size=env.world_size,
            shuffle=cfg.data.shuffle, seed=cfg.train.seed, drop_last=cfg.data.drop_last, prefetch=cfg.data.prefetch,
            shuffle_window_rows=cfg.data.shuffle_window_rows, shuffle_block_rows=cfg.data.shuffle_block_rows,
            num_samples=cfg.data.num_samples, features=feats, pin_memory=self.device.type == "cuda",
            **self._id_policy(), **multi_hot_kwargs(cfg, self.meta), require_labels=True,
        )
        self.feature_names = feats
        if len(self.train_loader) == 0:
            raise TrainError(
                f"{cfg.data.path}: split '{cfg.data.train_split}' gives no training batch "
                f"({self.train_loader.num_rows} rows, data.batch_size {cfg.data.batch_size}, "
                f"data.drop_last {cfg.data.drop_last})"
            )
        self.weighted = bool(weighted_features(cfg))  # the KJTs carry per-id weights
        self._loss_window: torch.Tensor | None = None  # [2]: last step's local loss, window sum
        self._window_steps = 0
        self.last_loss: float | None = None
        self.last_loss_step = 0  # the step whose loss last_loss is
        self.step = 0
        self.epoch = 0
        self._batches_done = 0
        self.best: dict[str, float] | None = None
        self._improved = False  # the latest evaluation is a new best (train.keep_best)
        self._evals_since_best = 0  # evaluations in a row without a new best (train.early_stopping_patience)
        self._last_eval: dict[str, Any] | None = None
        self._saved_step = -1
        self._resume_from = checkpoint
        #: the validation metrics the restored checkpoint recorded at its own step (None: none / other split)
        self._restored_eval: dict[str, Any] | None = None
        self._metrics_f = None
        self._tb = None
        if resume:
            self._restore()

    # ------------------------------------------------------------- set-up
    def _id_policy(self) -> dict[str, Any]:
        """BatchLoader arguments applying ``model.on_invalid_id`` to every CPU batch: feature ->
        the (table, rows) of each lookup it feeds, and the policy."""
        from dlrmctl.modules.embedding_modules import table_id_bounds

        return {"id_bounds": table_id_bounds(self.tables), "on_invalid_id": self.cfg.model.on_invalid_id}

    def _shard(self, plan: Any) -> None:
        from dlrmctl.distributed.model_parallel import DistributedModelParallel, describe_plan
        from dlrmctl.train.factory import embedding_optimizer_spec

        if plan is None:
            plan = resolve_plan(self.cfg, self.tables, self.env, self.meta)
        plan.validate(self.tables, self.env.world_size, where="sharding plan")
        self.plan = plan
        self.model = DistributedModelParallel(
            self.model, self.env.sharding_env, plan, embedding_optimizer_spec(self.cfg), seed=self.cfg.train.seed,
            check_ids=False, comm_precision=self.cfg.sharding.comm_precision,
            overlap_output_dist=self.cfg.sharding.overlap_output_dist,
        )
        if self.cfg.optimizer.embedding.weight_decay and self.model.is_sharded:
            # a densified data_parallel gradient would let weight decay reach rows not looked up
            self.model.sparse_arch.dense_grad_max_bytes = 0
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

    def _build_optimizers(self) -> None:
        m = self.model
        if self.env.sharded:
            self.fused_opt = m.fused_optimizer()
            dense_params = m.dense_parameters()
            emb_dense = m.embedding_dense_parameters()
        else:
            self.fused_opt = m.sparse_arch.fused_optimizer()
            emb_dense = m.sparse_arch.lookup.dense_parameters()
            dense_params = [p for n, p in m.named_parameters() if not n.startswith("sparse_arch.")]
        self.dense_opt = dense_optimizer(dense_params, self.cfg.optimizer.dense)
        if self.env.is_main:  # one line on every world size (a sharded run prints its plan beside it)
            echo(model_size_line(self.tables, dense_params, self.cfg.model.embedding_precision))
        e = self.cfg.optimizer.embedding
        self.emb_dense_opt = (embedding_optimizer_for_dense(emb_dense, e.type, e.lr, e.eps, e.weight_decay, tuple(e.betas))
                              if emb_dense else None)
        self._lr_targets: list[tuple[Any, float]] = [(self.fused_opt, e.lr), (self.dense_opt, self.cfg.optimizer.dense.lr)]
        if self.emb_dense_opt is not None:
            self._lr_targets.append((self.emb_dense_opt, e.lr))

    # --------------------------------------------------------------- step
    def _global_batch_size(self, local: int, sparse_ctx: Any) -> int | torch.Tensor:
        """Samples in this step over all ranks: host ints from the input_dist size exchange
        when it saw every rank, else one all-reduce on the device (no host read)."""
        if not self.env.sharded:
            return local
        sizes = getattr(sparse_ctx, "full_batch_sizes", None)
        if sizes is not None and len(sizes) == self.env.world_size:
            return int(sum(sizes))
        t = torch.tensor(float(local), dtype=torch.float32, device=self.device)  # 0-d: the loss stays 0-d
        self.env.all_reduce_sum(t)
        return t

    def train_step(self, batch: Any) -> torch.Tensor:
        """Forward, backward, optimizer steps on one batch.

        Returns:
            this rank's share of the global-batch mean loss, a detached 0-d tensor on the
            device (summed over ranks it is the global loss; read it with :meth:`read_loss`).
        """
        return self._run_step(batch.to(self.device, non_blocking=True), None)

    def _run_step(self, batch: Any, sparse_ctx: Any) -> torch.Tensor:
        """One step on a device-resident batch; ``sparse_ctx``: its finished input_dist (pipelined) or None.

        No host reads: the loss stays on the device (see :meth:`read_loss`)."""
        self.schedule.apply(self.step, self._lr_targets)
        if sparse_ctx is None and self.env.sharded:
            sparse_ctx = self.model.sparse_input_dist(batch.sparse_features).wait()
        gbs = self._global_batch_size(batch.labels.numel(), sparse_ctx)
        logits = self._logits(batch, sparse_ctx)
        loss_sum = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum")
        loss = loss_sum / gbs
        self.dense_opt.zero_grad(set_to_none=True)
        if self.emb_dense_opt is not None:
            self.emb_dense_opt.zero_grad(set_to_none=True)
        skipped = False
        if self.scaler is None:
            loss.backward()  # sharded: dense grads are all-reduced in buckets during backward
            self.dense_opt.step()
        else:  # fp16: scaled loss; the embeddings' gradient is unscaled where it leaves the dense part
            self._emb_found_inf.zero_()
            self.scaler.scale(loss).backward()
            self._fp16_unscale_dense()
            # read only when a dense-kernel table optimizer must follow the dense step's fate
            skipped = self.emb_dense_opt is not None and self._fp16_step_skipped()
            self.scaler.step(self.dense_opt)  # skips the step on inf/NaN dense or embedding grads
            self.scaler.update()  # and then backs off the scale
        if self.emb_dense_opt is not None and not skipped:
            self.emb_dense_opt.step()
        self.step += 1
        out = loss.detach()
        self._accumulate_loss(out)
        return out

    def _fp16_unscale_dense(self) -> None:
        """fp16: unscale the dense grads and fold the embeddings' overflow flag into the scaler.

        ``GradScaler.unscale_`` records the dense grads' inf/NaN per device; the pooled-embedding
        gradient's flag (:class:`_UnscaleGrad`, already max-reduced over ranks in the backward, so
        that every rank skips the same step and keeps the same scale) is added to it, so ``scaler.step`` skips the dense step and
        ``scaler.update`` backs off whenever either overflowed.  No host read.  The per-optimizer
        state is GradScaler's (``_per_optimizer_states``, stable since torch 1.6)."""
        assert self.scaler is not None
        self.scaler.unscale_(self.dense_opt)
        found = self.scaler._per_optimizer_states[id(self.dense_opt)]["found_inf_per_device"]
        if not found:  # no dense grads on any device: give the scaler one flag to read
            found[self._emb_found_inf.device] = torch.zeros((), dtype=torch.float32, device=self.device)
        for t in found.values():
            t.add_(self._emb_found_inf.to(t.device))

    def _fp16_step_skipped(self) -> bool:
        """True when the scaler will skip this step (after :meth:`_fp16_unscale_dense`; one host
        read, the one ``scaler.step`` makes anyway)."""
        assert self.scaler is not None
        found = self.scaler._per_optimizer_states[id(self.dense_opt)]["found_inf_per_device"]
        return bool(sum(float(t.item()) for t in found.values()))

    def _autocast(self) -> Any:
        """``torch.autocast`` for ``train.precision`` on this device (fp32: a no-op context)."""
        p = self.cfg.train.precision
        if p == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16 if p == "bf16" else torch.float16)

    def _logits(self, batch: Any, sparse_ctx: Any, autocast: bool = True) -> torch.Tensor:
        """Logits ``[B]`` float32 of a device-resident batch: the embedding lookups (and their
        output_dist) in the embeddings' precision, the dense arch / interaction / over arch under
        :meth:`_autocast` (``autocast=False``: in fp32, as evaluation runs); ``sparse_ctx``: a
        finished input_dist (sharded) or None."""
        if sparse_ctx is None and self.env.sharded:
            sparse_ctx = self.model.sparse_input_dist(batch.sparse_features).wait()
        if sparse_ctx is None:
            embedded = self.model.sparse_arch(batch.sparse_features)
        else:
            # with sharding.overlap_output_dist an Awaitable[KeyedTensor]: dense_forward waits on
            # it after the dense arch (the GradScaler path below needs the values now)
            embedded = self.model.compute_and_output_dist(sparse_ctx)
        if self.scaler is not None and not isinstance(embedded, KeyedTensor):
            embedded = embedded.wait()
        if self.scaler is not None and embedded.values().requires_grad:
            embedded = KeyedTensor(embedded.keys(), embedded.length_per_key(),
                                   _UnscaleGrad.apply(embedded.values(), self.scaler, self._emb_found_inf,
                                                      self.env.pg))
        with self._autocast() if autocast else contextlib.nullcontext():
            logits = self.model.dense_forward(batch.dense_features, embedded)
        return logits.squeeze(1).float()

    def _accumulate_loss(self, local: torch.Tensor) -> None:
        if self._loss_window is None:
            self._loss_window = torch.zeros(2, dtype=torch.float64, device=local.device)
        self._loss_window[0] = local
        self._loss_window[1] += local
        self._window_steps += 1

    def check_loss_finite(self) -> None:
        """Raise if a loss since the last :meth:`read_loss` was not finite (collective, one host
        sync; the window is kept).  Called before every evaluation and checkpoint.

        Raises:
            TrainError: naming the step range.
        """
        if self._loss_window is None or self._window_steps == 0:
            return
        w = self._loss_window[1:].clone()
        self.env.all_reduce_sum(w)
        total = w.tolist()[0]
        if not math.isfinite(total):
            n = self._window_steps
            raise TrainError(f"loss became {total / n} in steps {self.step - n + 1}..{self.step}; lower the "
                             "learning rate (no evaluation or checkpoint of this model was made)")

    def read_loss(self) -> tuple[float, float]:
        """``(last step's global loss, mean global loss since the previous read)``; resets the
        window.  Collective (one 16-byte all-reduce) and one host sync: the trainer calls it
        every ``train.log_every`` steps and at the end of an epoch, on every rank.

        Raises:
            TrainError: the loss is not finite (names the step range).
        """
        if self._loss_window is None or self._window_steps == 0:
            return (float("nan"), float("nan")) if self.last_loss is None else (self.last_loss, self.last_loss)
        w = self._loss_window.clone()
        self.env.all_reduce_sum(w)
        last, total = w.tolist()
        n = self._window_steps
        self._loss_window.zero_()
        self._window_steps = 0
        if not (math.isfinite(last) and math.isfinite(total)):
            raise TrainError(f"loss became {total / n} in steps {self.step - n + 1}..{self.step}; lower the learning rate")
        self.last_loss, self.last_loss_step = last, self.step
        return last, total / n

    # ---------------------------------------------------------- evaluate
    @torch.no_grad()
    def evaluate(self, split: str | None = None, data_dir: str | None = None) -> dict[str, float]:
        """Metrics over the WHOLE split, computed where the logits are: each rank keeps its own rows.

        Computed from the logits in float64 (:func:`~dlrmctl.train.metrics.compute_metrics_from_logits`
        with the process group): AUC ranks logits (no float32-sigmoid saturation), log loss uses a
        stable log-sigmoid; one class only gives AUC 0.5 and a logged warning.  Exact sums, so the
        figure is bit-identical for any world size and eval batch size.  Memory per rank: its own
        ``[n_local, 2]`` float32 logits and labels, float64 copies and the AUC ring's buffers
        (O(local rows), never all N rows).

        Returns:
            ``{"auc", "logloss", "ne", "calibration", "accuracy", "ctr", "num_samples"}`` (every rank).
        """
        from dlrmctl.data.loader import BatchLoader

        split = split or self.cfg.data.val_split
        loader = BatchLoader(
            data_dir or self.cfg.data.path, split, self.cfg.data.eval_batch_size, rank=self.env.rank,
            world_size=self.env.world_size, shuffle=False, prefetch=self.cfg.data.prefetch, features=self.feature_names,
            **self._id_policy(), **multi_hot_kwargs(self.cfg, self.meta), require_labels=True,
        )
        self.model.eval()
        rows: list[torch.Tensor] = []  # [b, 2] float32: logit, label (on the device)
        n_batches = self._agreed_num_batches(len(loader))
        it = iter(loader)
        bar = Progress(n_batches, f"eval {split}", "batch", enabled=self.env.is_main and self.cfg.train.progress,
                       every_s=self.cfg.train.progress_every_s, final_line=False, leave=False)
        with self._full_precision_comm():
            for _ in range(n_batches):
                batch = next(it, None)
                if batch is None:
                    batch = _empty_batch_like(self.num_dense, self.feature_names, self.weighted)
                batch = batch.to(self.device)
                z = self._logits(batch, None, autocast=False)
                rows.append(torch.stack([z, batch.labels.float()], dim=1))
                bar.update(1)
        bar.close()
        self.model.train()
        local = (torch.cat(rows) if rows else torch.zeros(0, 2, device=self.device)).cpu().numpy()
        del rows
        # exact distributed metrics: each rank keeps its own rows (O(local rows) memory); only the
        # rarer class's rows travel around a ring of point-to-point shifts (see train/metrics.py)
        return compute_metrics_from_logits(local[:, 0], local[:, 1], pg=self.env.pg, device=self.device)

    @contextlib.contextmanager
    def _full_precision_comm(self) -> Iterator[None]:
        """Evaluation sends pooled embeddings at full precision (``sharding.comm_precision`` is a
        training-speed setting): with fp32 dense arithmetic (no autocast) the in-training val
        metrics that pick ``keep_best`` and stop early are those of the checkpoint as
        ``dlrmctl evaluate`` and the fp32 export compute them."""
        from dlrmctl.distributed.sharded_ebc import ShardedEmbeddingBagCollection

        mods = [m for m in self.model.modules() if isinstance(m, ShardedEmbeddingBagCollection)]
        saved = [m.comm_dtype for m in mods]
        for m in mods:
            m.comm_dtype = None
        try:
            yield
        finally:
            for m, d in zip(mods, saved):
                m.comm_dtype = d

    def _agreed_num_batches(self, n: int) -> int:
        """All ranks run the same number of steps (collectives must match): the max."""
        if not self.env.sharded:
            return n
        t = torch.tensor([n], dtype=torch.int64, device=self.device)
        comm.all_reduce(t, self.env.pg, op="max")
        return int(t.item())

    # -------------------------------------------------------- checkpoint
    def _rank_state(self) -> dict[str, Any]:
        """This rank's part of the DCP checkpoint (see :func:`checkpoint_state`)."""
        return checkpoint_state(
            self.model, self.dense_opt, self.emb_dense_opt, self.fused_opt, self.env.rank,
            # batches trained this epoch (the loader may have prefetched further)
            trainer={"step": self.step, "epoch": self.epoch, "best": self.best,
                     "evals_since_best": self._evals_since_best,
                     "data": {"epoch": self.epoch, "batches_yielded": self._batches_done,
                              "order": self.train_loader.order()}},
            lr_schedule=to_dict(self.cfg.optimizer.lr_schedule),
        )

    def save(self) -> str:
        """Write a checkpoint of this step (collective: every rank writes its own shards); it becomes
        the run's best when this step's evaluation improved on the best (``train.keep_best``)."""
        extra = checkpoint_meta(self.model, self.plan, self.fused_opt)
        # what the run trained in (a resume may change any of them: tables are cast on load)
        extra["precision"] = {"train": self.cfg.train.precision, "embedding": self.cfg.model.embedding_precision,
                              "comm": self.cfg.sharding.comm_precision}
        if self._last_eval is not None and self._last_eval["step"] == self.step:
            extra["eval"] = self._last_eval
        best = self._best_due()
        path = ckpt.save_checkpoint(
            self.run_dir, self.step, self._rank_state(), rank=self.env.rank, world_size=self.env.world_size,
            process_group=getattr(self.env.sharding_env, "pg", None),
            keep_last=self.cfg.train.keep_last_checkpoints,
            extra_meta=extra, best=best,
        )
        self._improved = False
        self._saved_step, self._saved_path = self.step, path
        if self.env.is_main:
            finish_replacement(self.run_dir)  # the first complete checkpoint: an --overwrite's old run goes
        return path

    def _best_kept_note(self, step: int) -> str:
        """What the end-of-run line says about the best step's checkpoint: only what ``BEST``
        really names (a run resumed from a resharded copy of a non-best checkpoint has found its
        best before the copy: no checkpoint of this directory holds it)."""
        try:  # a BEST naming a missing / incomplete checkpoint must not fail a finished run
            path = ckpt.best_checkpoint(self.run_dir)
            best_step = None if path is None else int(ckpt.load_checkpoint_meta(path)["step"])
        except ckpt.CheckpointError as e:
            return f" (checkpoint 'best' is unusable: {e})"
        if best_step is not None and best_step == int(step):
            return ", kept as checkpoint 'best'"
        if best_step is not None:
            return f" (checkpoint 'best' is step {best_step})"
        return (f" (no checkpoint of {self.run_dir} holds step {step}: it was found before this run's "
                f"checkpoints were made, e.g. by the run a reshard --out copied; evaluate and export "
                f"take the last checkpoint)")

    def _best_due(self) -> bool:
        """This step's evaluation is a new best and ``train.keep_best`` keeps it (same on every rank)."""
        return self._improved and self.cfg.train.keep_best != "none"

    def _checkpoint(self, due: bool) -> None:
        """Save this step when ``due`` or when its evaluation is a new best.  A step saved already
        is not written twice: a new best then only points ``BEST`` at it (rank 0)."""
        if not (due or self._best_due()):
            return
        if self._saved_step != self.step:
            self.save()
            return
        if self._best_due() and self.env.is_main:
            ckpt.mark_best(self.run_dir, self._saved_path, self._last_eval)
        self._improved = False

    def _restore(self) -> None:
        """Load the newest checkpoint: any world size / plan (DCP reads only this rank's slices)."""
        if self._resume_from is not None:  # --checkpoint best|last|<step>
            path, _ = ckpt.resolve_checkpoint(self.run_dir, self._resume_from)
        else:
            path = ckpt.latest_checkpoint(self.run_dir)
        if path is None:
            log.info("no checkpoint in %s: starting from scratch", self.run_dir)
            return
        saved = restore_checkpoint(
            path, self.model, self.dense_opt, self.emb_dense_opt, self.fused_opt, self.env.rank,
            self.env.world_size, getattr(self.env.sharding_env, "pg", None), plan=self.plan,
        )
        tr = saved["trainer"]
        try:
            self.train_loader.load_state_dict(tr["data"])
        except ValueError as e:
            raise TrainError(f"{path}: {e}") from None
        self.step, self.epoch, self.best = tr["step"], tr["epoch"], tr["best"]
        self._evals_since_best = int(tr.get("evals_since_best", 0))  # absent in checkpoints before early stopping
        self._batches_done = int(tr["data"]["batches_yielded"])
        if os.path.realpath(path) == os.path.realpath(ckpt.latest_checkpoint(self.run_dir) or ""):
            # the newest checkpoint IS this state: a resume with nothing left to train (a finished or
            # early-stopped run) must not write it again as step_X.1 (the same on every rank: the
            # path was resolved from the same files)
            self._saved_step, self._saved_path = self.step, path
        ev = ckpt.load_checkpoint_meta(path).get("eval")
        if isinstance(ev, dict) and ev.get("step") == self.step and ev.get("split") == self.cfg.data.val_split:
            self._restored_eval = {k: v for k, v in ev.items() if k not in ("step", "split")}
        log.info("resumed from %s (step %d, saved by %d rank(s))", path, self.step, saved["world_size"])

    # ---------------------------------------------------------------- run
    def _log_metrics(self, record: dict[str, Any]) -> None:
        if not self.env.is_main:
            return
        if self._metrics_f is None:
            self._metrics_f = open(os.path.join(self.run_dir, "metrics.jsonl"), "a")
            self._tb = _tensorboard_writer(self.run_dir, self.cfg.train.tensorboard)
        self._metrics_f.write(json.dumps(_jsonable(record)) + "\n")
        self._metrics_f.flush()
        if self._tb is not None:
            prefix = "train" if record.get("kind") == "train" else f"eval_{record.get('split', 'val')}"
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "epoch"):
                    self._tb.add_scalar(f"{prefix}/{k}", v, record["step"])

    def _eval_and_log(self, tag: str) -> dict[str, float]:
        m = self.evaluate()
        kb = self.cfg.train.keep_best
        if (self.best is None and _defined(m, kb)) or (self.best is not None and _better(m, self.best, kb)):
            self.best = dict(m, step=self.step)
            self._improved = True
            self._evals_since_best = 0
        else:
            self._evals_since_best += 1
            if self.best is None:  # an undefined score (NaN, one class) is reported but never kept as best
                self.best = dict(m, step=self.step)
        self._last_eval = dict(_jsonable(m), step=self.step, split=self.cfg.data.val_split)
        self._log_metrics({"kind": "eval", "split": self.cfg.data.val_split, "step": self.step,
                           "epoch": self.epoch_number(), **m})
        if self.env.is_main:
            echo(
                f"[{tag}] step {self.step} {self.cfg.data.val_split}: AUC {m['auc']:.4f}  logloss {m['logloss']:.4f}  "
                f"NE {m['ne']:.4f}  calibration {m['calibration']:.3f}  accuracy {m['accuracy']:.4f}  (n={m['num_samples']})"
            )
        return m

    def should_stop(self) -> bool:
        """``train.early_stopping_patience`` evaluations in a row did not improve on the best
        ``train.keep_best`` metric (the same answer on every rank: the metrics are broadcast)."""
        p = self.cfg.train.early_stopping_patience
        return bool(p) and self._evals_since_best >= p

    def epoch_number(self) -> int:
        """The epoch the latest step belongs to, numbered from 1 as everywhere the user sees epochs
        (console, metrics.jsonl, ``dlrmctl report``); ``self.epoch`` counts finished epochs."""
        return self.epoch + 1 if self._batches_done > 0 or self.epoch == 0 else self.epoch

    def train(self) -> dict[str, Any]:
        """Run the configured epochs / steps; returns ``{"final": metrics, "best": metrics, "steps": int}``."""
        cfg = self.cfg.train
        if self.env.is_main:
            os.makedirs(self.run_dir, exist_ok=True)
        last_eval_step = -1
        final = None
        t_start = time.perf_counter()
        sparse_dist = self.model.sparse_input_dist if self.env.sharded else None
        pipe = make_pipeline(cfg.pipeline, self.device, self._run_step, sparse_dist)
        stopped = self.should_stop()  # resuming a run that stopped early: nothing more to train
        if self._restored_eval is not None:  # this step was evaluated before the checkpoint: not again
            last_eval_step, final = self.step, dict(self._restored_eval)
        while (not stopped and self.epoch < cfg.epochs
               and (cfg.max_steps is None or self.step < cfg.max_steps)):
            if self.train_loader.epoch != self.epoch:
                self.train_loader.set_epoch(self.epoch)
            n = self._agreed_num_batches(len(self.train_loader))
            self._batches_done = self.train_loader.state_dict()["batches_yielded"]  # > 0 when resuming mid-epoch
            todo = n - self._batches_done
            if cfg.max_steps is not None:
                todo = min(todo, cfg.max_steps - self.step)
            end = self._batches_done + max(todo, 0)  # this epoch stops after batch `end` (max_steps)
            progress = _Progress(self.step + max(todo, 0), self.step, self.env.is_main and cfg.progress,
                                 f"epoch {self.epoch + 1}/{cfg.epochs}", cfg.progress_every_s)
            pipe.reset(_exactly(iter(self.train_loader), todo, lambda: _empty_batch_like(self.num_dense, self.feature_names, self.weighted)))
            pipe.reset_stats()
            while True:
                # the loss stays on the device; it is read (one all-reduce + one host sync)
                # every log_every steps and at the end of the epoch
                if pipe.progress() is None:
                    break
                self._batches_done += 1
                sh = pipe.stats.shares()
                sps = sh["samples_per_s"] * self.env.world_size
                log_due = bool(cfg.log_every and self.step % cfg.log_every == 0)
                if self._batches_done == end and not log_due:
                    self.read_loss()  # end of the epoch: non-finite losses surface here, the bar shows the loss
                if log_due:
                    loss, loss_avg = self.read_loss()
                    # "loss": this step's; "loss_avg": mean over the steps since the last record
                    self._log_metrics({"kind": "train", "step": self.step, "epoch": self.epoch + 1, "loss": loss,
                                       "loss_avg": loss_avg,
                                       "samples_per_s": sps, "data_wait_share": sh["data_wait_share"],
                                       "comm_wait_share": sh["comm_wait_share"],
                                       "lr_factor": self.schedule.factor(self.step - 1)})
                progress.update(self.last_loss, self.last_loss_step, sps)
                eval_due = bool(cfg.eval_every and self.step % cfg.eval_every == 0)
                if eval_due or (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0):
                    self.check_loss_finite()  # never evaluate or checkpoint a model that went non-finite
                if eval_due:
                    final = self._eval_and_log("eval")
                    last_eval_step = self.step
                self._checkpoint(bool(cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0))
                if eval_due and self.should_stop():
                    stopped = True
                    break
            progress.close()
            sh = pipe.stats.shares()
            if self.env.is_main and pipe.stats.steps:
                echo(f"epoch {self.epoch + 1}/{cfg.epochs}: {pipe.stats.steps} steps, {sh['samples_per_s'] * self.env.world_size:,.0f} "
                     f"samples/s ({cfg.pipeline} pipeline), waiting on data {100 * sh['data_wait_share']:.1f}% and on "
                     f"input_dist {100 * sh['comm_wait_share']:.1f}% of step time")
            if self._batches_done < n:  # stopped by max_steps (or early stopping) mid-epoch
                break
            self.epoch += 1
            self._batches_done = 0
            self.train_loader.set_epoch(self.epoch)
            if self.step != last_eval_step:
                final = self._eval_and_log(f"epoch {self.epoch}")
                last_eval_step = self.step
                self._checkpoint(False)
                stopped = self.should_stop()
        if stopped and self.env.is_main:
            kb = self.cfg.train.keep_best
            echo(f"early stopping at step {self.step}: {self._evals_since_best} evaluation(s) without a better "
                 f"{self.cfg.data.val_split} {kb.upper()} than step {self.best['step']} "
                 f"(train.early_stopping_patience {cfg.early_stopping_patience})")
        if self.step != last_eval_step or final is None:
            final = self._eval_and_log("final")
        self._checkpoint(True)
        elapsed = time.perf_counter() - t_start
        summary = {"final": final, "best": self.best, "steps": self.step, "train_seconds": elapsed,
                   "early_stopped": stopped}
        if self.env.is_main:
            # a temp file renamed over it: a resumed run's previous summary (what `dlrmctl sweep` ranks)
            # is replaced whole or kept, never left truncated
            text = json.dumps({k: (_jsonable(v) if isinstance(v, dict) else v) for k, v in summary.items()}, indent=1)
            write_text_atomic(os.path.join(self.run_dir, "summary.json"), text)
            b, kb = self.best, self.cfg.train.keep_best
            what = (f"NE {b['ne']:.4f} (AUC {b['auc']:.4f})" if kb == "ne" else f"AUC {b['auc']:.4f}")
            kept = self._best_kept_note(b["step"]) if kb != "none" else ""
            echo(f"best {self.cfg.data.val_split} {what} at step {b['step']}{kept}; run directory {self.run_dir}")
        if self._metrics_f is not None:
            self._metrics_f.close()
            if self._tb is not None:
                self._tb.close()
        return summary


def init_from_train_split(model: DLRM, cfg: ExperimentConfig, meta: dict[str, Any]) -> None:
    """The initial values a fresh model takes from its train split (``model`` changed in place):

    * ``model.over_arch_bias_init: ctr``: the over arch's output bias ``= logit(p)``, ``p`` the
      train CTR of meta.json (``meta["ctr"]["train"]``);
    * ``model.dense_standardize``: ``model.dense_norm`` gets the train split's per-column mean /
      std (:func:`dlrmctl.data.columnar.dense_column_stats`).

    Deterministic (every rank computes the same values); nothing happens with neither key set.

    Raises:
        TrainError: ``ctr`` asked for but meta.json has no train CTR strictly in (0, 1); a dense
            column with NaN / inf values under ``dense_standardize`` (names the columns).
    """
    if cfg.model.over_arch_bias_init == "ctr":
        p = (meta.get("ctr") or {}).get(cfg.data.train_split)
        if p is None or not 0.0 < float(p) < 1.0:
            raise TrainError(f"model.over_arch_bias_init: ctr needs the train split's CTR in (0, 1) in "
                             f"{cfg.data.path}/meta.json (ctr.{cfg.data.train_split}), got {p!r}")
        last = [m for m in _dlrm(model).over_arch.modules() if isinstance(m, torch.nn.Linear)][-1]
        with torch.no_grad():
            last.bias.fill_(math.log(float(p) / (1.0 - float(p))))
    norm = _dlrm(model).dense_norm
    if norm is not None:
        from dlrmctl.data.columnar import dense_column_stats

        mean, std = dense_column_stats(cfg.data.path, cfg.data.train_split, meta=meta)
        bad = [n for n, m, s in zip(meta["dense_features"], mean, std) if not (math.isfinite(m) and math.isfinite(s))]
        if bad:
            raise TrainError(f"model.dense_standardize: dense column(s) {bad} of the {cfg.data.train_split!r} split "
                             f"of {cfg.data.path} hold NaN or inf values (no mean / std to standardise with); "
                             "re-run `dlrmctl preprocess` or drop model.dense_standardize")
        norm.set_stats(torch.from_numpy(mean), torch.from_numpy(std))


class _Progress:
    """Rank-0 progress of one epoch (:class:`dlrmctl.console.Progress`): a bar on a terminal, a line
    every ``train.progress_every_s`` seconds otherwise.  Counts global steps; shows samples/s and the
    latest loss read from the device (every ``train.log_every`` steps, see read_loss) with its step."""

    def __init__(self, total: int, initial: int, enabled: bool, desc: str, every_s: float) -> None:
        self.p = Progress(total, desc, "step", enabled=enabled, every_s=every_s, initial=initial)

    def update(self, loss: float | None, loss_step: int, sps: float) -> None:
        """One step done; ``loss``: the latest loss read (at step ``loss_step``), or None."""
        self.p.update(1, **{"samples/s": f"{sps:,.0f}",
                            "loss": "-" if loss is None else f"{loss:.4f} (step {loss_step})"})

    def close(self) -> None:
        self.p.close()


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


def plan_rank_summary(plan: Any, tables: list, origin: str, full: str) -> str:
    """The applied plan per rank, as rank 0 prints it at start: tables by sharding type and
    weight bytes on each rank (the per-table plan is in ``full``, plan.txt)."""
    from collections import Counter

    from dlrmctl.distributed.types import ShardingType

    kinds = [Counter() for _ in range(plan.world_size)]
    nbytes = [0] * plan.world_size
    for t in tables:
        ps = plan.plan[t.name]
        if ps.sharding_type == ShardingType.DATA_PARALLEL:
            for r in ps.ranks:
                kinds[r][ps.sharding_type.value] += 1
                nbytes[r] += t.num_embeddings * t.embedding_dim * 4
            continue
        for m in ps.shards or []:
            kinds[m.rank][ps.sharding_type.value] += 1
            nbytes[m.rank] += m.sizes[0] * m.sizes[1] * 4
    hosts = plan.world_size // plan.local_world_size
    lines = [f"sharding plan {origin}: {len(tables)} tables on {plan.world_size} rank(s), {hosts} host(s) "
             f"(per table: {full})"]
    for r in range(plan.world_size):
        what = ", ".join(f"{k} {n}" for k, n in sorted(kinds[r].items())) or "no shards"
        lines.append(f"  rank {r}: {sum(kinds[r].values())} shard(s) ({what}), {nbytes[r] / 1e6:,.2f} MB of weights")
    return "\n".join(lines)


def _defined(m: dict[str, float], keep_best: str) -> bool:
    """The ``keep_best`` metric of ``m`` is a real score: not NaN, and (AUC) the split has both
    classes (a single-class split reports AUC 0.5 by convention, which says nothing about the model)."""
    if keep_best == "ne":
        return not math.isnan(m.get("ne", math.nan))
    ctr = m.get("ctr", 0.5)
    return not math.isnan(m.get("auc", math.nan)) and not (isinstance(ctr, float) and ctr in (0.0, 1.0))


def _better(m: dict[str, float], best: dict[str, float], keep_best: str) -> bool:
    """``m`` beats ``best`` on the ``train.keep_best`` metric (``none``: AUC, for the summary only):
    an undefined score (NaN, single-class AUC) never wins, and any defined one beats an undefined one."""
    if not _defined(m, keep_best):
        return False
    if not _defined(best, keep_best):
        return True
    if keep_best == "ne":
        return m["ne"] < best["ne"]
    return m["auc"] > best["auc"]


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


def _tensorboard_writer(run_dir: str, setting: bool | str = "auto") -> Any:
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


def multi_hot_kwargs(cfg: ExperimentConfig, meta: dict) -> dict[str, Any]:
    """BatchLoader arguments for ``data.multi_hot_sizes`` (one size per sparse feature of meta.json),
    and ``weighted_features`` (the features of ``weighted: true`` tables) when there are any.

    Raises:
        TrainError: the list length does not match the data's sparse features.
    """
    wf = weighted_features(cfg)
    extra: dict[str, Any] = {"weighted_features": wf} if wf else {}
    sizes = cfg.data.multi_hot_sizes
    if not sizes:
        return extra
    names = [f["name"] for f in meta["sparse_features"]]
    if len(sizes) != len(names):
        raise TrainError(
            f"data.multi_hot_sizes has {len(sizes)} sizes but {cfg.data.path}/meta.json has {len(names)} sparse "
            f"features ({names[:4]}...); give one size per feature"
        )
    return {"multi_hot_sizes": dict(zip(names, sizes)), "multi_hot_distribution": cfg.data.multi_hot_distribution,
            "multi_hot_seed": cfg.train.seed, **extra}


def _exactly(it: Any, n: int, empty: Any) -> Any:
    """Yield exactly ``n`` items of ``it``, padding with ``empty()`` if it runs out first.

    A rank whose data slice has fewer batches keeps stepping with empty
    batches, so every rank issues the same collectives and nobody waits forever.
    """
    for _ in range(max(n, 0)):
        b = next(it, None)
        yield empty() if b is None else b


def _empty_batch_like(num_dense: int, feature_names: list[str], weighted: bool = False) -> Any:
    from dlrmctl.data.batch import Batch
    from dlrmctl.sparse import KeyedJaggedTensor

    z = torch.zeros(0, dtype=torch.int64)
    return Batch(
        dense_features=torch.zeros(0, num_dense),
        sparse_features=KeyedJaggedTensor(feature_names, z, lengths=z.clone(), stride=0,
                                          weights=torch.zeros(0) if weighted else None,
                                          length_per_key=[0] * len(feature_names)),
        labels=torch.zeros(0),
    )


# --------------------------------------------------------------- helpers
def _dlrm(model: Any) -> DLRM:
    """The DLRM inside a DistributedModelParallel (or the model itself)."""
    return getattr(model, "module", model)


def _ensure_optimizer_state(opt: torch.optim.Optimizer | None) -> None:
    """Create the lazily-made state of :class:`~dlrmctl.train.optim.RowWiseAdagrad` (per row) and
    :class:`~dlrmctl.train.optim.SparseAdagrad` (per element) (zeros: identical to absent), so every
    dense-kernel shard has its moment tensor to save / load into."""
    if opt is None:
        return
    if hasattr(opt, "ensure_state"):  # the Adam family (dlrmctl.train.optim.EmbeddingAdam)
        opt.ensure_state()
        return
    from dlrmctl.train.optim import RowWiseAdagrad, SparseAdagrad

    for g in opt.param_groups:
        for p in g["params"]:
            st = opt.state[p]
            if isinstance(opt, RowWiseAdagrad) and "momentum1" not in st:
                st["momentum1"] = torch.zeros(p.shape[0], dtype=torch.float32, device=p.device)
            if isinstance(opt, SparseAdagrad) and "sum" not in st:
                st["sum"] = torch.zeros_like(p, dtype=torch.float32)


def local_embedding_shards(model: Any, emb_dense_opt: torch.optim.Optimizer | None = None):
    """This rank's embedding shards as ``(table, offsets [r0, c0], sizes [rows, cols], weight, [state tensors])``.

    Sharded models use :meth:`ShardedEmbeddingBagCollection.local_shards`; an
    unsharded EBC gives each table as one full shard.  Weights and states are
    live views.  State tensors: the fused optimizer's moments, or the torch
    optimizer's per-row / per-element state for dense-kernel tables (created
    here if the optimizer has not stepped yet) — the same layout for both kernels.
    """
    _ensure_optimizer_state(emb_dense_opt)
    sa = _dlrm(model).sparse_arch
    out = []
    if hasattr(sa, "local_shards"):
        for name, shards in sa.local_shards(emb_dense_opt).items():
            for meta, w, states in shards:
                out.append((name, list(meta.offsets), list(meta.sizes), w, list(states)))
        return out
    fused = sa.fused_optimizer().momentum()
    weights = sa.embedding_weights()
    for t in sa.embedding_bag_configs():
        w = weights[t.name]
        states = fused.get(t.name)
        if states is None:
            st = emb_dense_opt.state.get(w, {}) if emb_dense_opt is not None else {}
            states = [v for _, v in sorted(st.items()) if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == w.shape[0]]
        out.append((t.name, [0, 0], [t.num_embeddings, t.embedding_dim], w, list(states)))
    return out


def _replicated_tables(model: Any) -> set[str]:
    """Tables every rank holds whole (data_parallel, or all tables of an unsharded model)."""
    from dlrmctl.distributed.types import ShardingType

    sa = _dlrm(model).sparse_arch
    plan = getattr(sa, "plan", None) if hasattr(sa, "local_shards") else None
    if plan is None:
        return {t.name for t in sa.embedding_bag_configs()}
    return {n for n, ps in plan.plan.items() if ps.sharding_type == ShardingType.DATA_PARALLEL}


def embedding_state(model: Any, emb_dense_opt: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """This rank's embedding entries of a checkpoint: ``key -> Tensor | Blocks`` (live views, no copies).

    * ``emb/<t>/weight [rows, dim]``: sharded tables as :class:`~dlrmctl.train.checkpoint.Blocks`
      (this rank's shards at their offsets); replicated tables (data_parallel, unsharded)
      as plain tensors, which DCP writes once.
    * ``emb/<t>/state<i>``: the i-th optimizer moment, per element (``[rows, dim]``,
      sharded like the weight) or per row (``[rows]``).  A row-wise moment is one value
      per row for the whole row; under column-wise sharding each column shard keeps its
      own, so those are saved twice: the column shard at column 0 gives ``state<i>``
      and every column shard ``[a, b)`` gives ``state<i>@cols<a>-<b>``.
    """
    out, blocks, row_states = _embedding_entries(model, emb_dense_opt, skip_empty=False)
    for key, (r0, c0), (nr, nc), (R, D), m in row_states:
        if c0 == 0:
            blocks[(key, (R,))].append(((r0,), m))
        if nc != D:
            blocks[(f"{key}@cols{c0}-{c0 + nc}", (R,))].append(((r0,), m))
    for (key, size), bl in blocks.items():
        out[key] = ckpt.Blocks(size, bl)
    return out


def _embedding_entries(model: Any, emb_dense_opt: Any, skip_empty: bool):
    """Checkpoint keys shared by save and load: ``(plain, blocks, row_states)``.

    ``plain``: replicated tables' weights / moments as whole tensors; ``blocks``:
    ``(key, global shape) -> [(offsets, view)]`` for sharded weights and per-element
    moments; ``row_states``: the per-row moments of sharded tables as
    ``(key, (r0, c0), (rows, cols), (R, D), view)``, whose mapping differs between
    save and load (column-wise shards, see :func:`embedding_load_request`).
    """
    from collections import defaultdict

    sa = _dlrm(model).sparse_arch
    dims = {t.name: (t.num_embeddings, t.embedding_dim) for t in sa.embedding_bag_configs()}
    repl = _replicated_tables(model)
    plain: dict[str, Any] = {}
    blocks: dict[tuple[str, tuple[int, ...]], list] = defaultdict(list)
    row_states = []
    for name, (r0, c0), (nr, nc), w, states in local_embedding_shards(model, emb_dense_opt):
        if skip_empty and (nr == 0 or nc == 0):
            continue
        R, D = dims[name]
        if name in repl:
            plain[f"emb/{name}/weight"] = w.detach()
            for i, m in enumerate(states):
                plain[f"emb/{name}/state{i}"] = m.detach()
            continue
        blocks[(f"emb/{name}/weight", (R, D))].append(((r0, c0), w.detach()))
        for i, m in enumerate(states):
            key = f"emb/{name}/state{i}"
            if m.dim() == 2:
                blocks[(key, (R, D))].append(((r0, c0), m.detach()))
            else:
                row_states.append((key, (r0, c0), (nr, nc), (R, D), m.detach()))
    return plain, blocks, row_states


def embedding_load_request(model: Any, md: Any, emb_dense_opt: Any = None) -> tuple[dict[str, Any], Any]:
    """What this rank reads to fill its embedding shards from a checkpoint (metadata ``md``).

    Returns ``(request, finish)``: ``request`` maps keys to live views of the
    weights / moments (:class:`Blocks` or full tensors), filled in place by
    :func:`~dlrmctl.train.checkpoint.load_checkpoint`; call ``finish()`` afterwards.

    Moment mapping across plans: weights, per-element moments and row-wise moments of
    row-wise / table-wise / table_row_wise / data_parallel tables are exact under any
    resharding.  A column shard ``[a, b)`` takes ``state<i>@cols<a>-<b>`` when the
    checkpoint has it (same column split: exact, e.g. resuming with the same plan),
    else the table's row-wise moment ``state<i>`` copied into each column shard
    (exact at save time if the source was not column-wise; from a column-wise source
    ``state<i>`` is the column-0 shard's moment).
    """
    saved = md.state_dict_metadata
    req, blocks, row_states = _embedding_entries(model, emb_dense_opt, skip_empty=True)
    first: dict[tuple[str, int, int], torch.Tensor] = {}
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    for key, (r0, c0), (nr, nc), (R, D), m in row_states:
        exact = f"{key}@cols{c0}-{c0 + nc}"
        if nc != D and exact in saved:
            blocks[(exact, (R,))].append(((r0,), m))
            continue
        prev = first.get((key, r0, nr))
        if prev is not None:  # another column shard of the same rows on this rank
            copies.append((prev, m))
            continue
        first[(key, r0, nr)] = m
        blocks[(key, (R,))].append(((r0,), m))
    for (key, size), bl in blocks.items():
        req[key] = ckpt.Blocks(size, bl)

    @torch.no_grad()
    def finish() -> None:
        for src, dst in copies:
            dst.copy_(src)

    return req, finish


@torch.no_grad()
def check_tables(meta: dict[str, Any], tables: list, ckpt_dir: str) -> None:
    """Refuse a checkpoint whose tables differ from the model's (names the table and both shapes).

    Raises:
        CheckpointError
    """
    where = os.path.join(ckpt_dir, "meta.json")
    saved = meta.get("tables") or {}
    have = {t.name: [t.num_embeddings, t.embedding_dim] for t in tables}
    for n, shape in have.items():
        if n not in saved:
            raise ckpt.CheckpointError(f"{where}: has no table '{n}' (saved tables: {sorted(saved)[:8]}...)")
        if list(saved[n]) != shape:
            raise ckpt.CheckpointError(
                f"{where}: table '{n}' was saved as {saved[n][0]} x {saved[n][1]} (rows x dim), "
                f"the model's is {shape[0]} x {shape[1]}"
            )
    extra = sorted(set(saved) - set(have))
    if extra:
        raise ckpt.CheckpointError(f"{where}: holds table(s) {extra} that the model does not have")


def dense_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """State of everything but the embeddings (MLPs, interaction): identical on every rank (live views)."""
    return {k: v for k, v in _dlrm(model).state_dict().items() if not k.startswith("sparse_arch.")}


def load_dense_state_dict(model: Any, state: dict[str, torch.Tensor], where: str) -> None:
    """Load :func:`dense_state_dict` output.

    Raises:
        CheckpointError: keys or shapes do not match the model.
    """
    m = _dlrm(model)
    try:
        missing, unexpected = m.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shape mismatch
        raise ckpt.CheckpointError(f"{where}: dense state does not match the model: {e}") from e
    bad = [k for k in missing if not k.startswith("sparse_arch.")]
    if bad or unexpected:
        raise ckpt.CheckpointError(f"{where}: dense state does not match the model: missing {bad}, unexpected {unexpected}")


#: torch optimizer param_group keys that pick an implementation, not hyper-parameters or state
_OPTIMIZER_IMPL_KEYS = ("foreach", "fused", "capturable", "differentiable")


def _param_names(model: Any, opt: torch.optim.Optimizer) -> list[str]:
    names = {id(p): n for n, p in _dlrm(model).named_parameters()}
    return [names.get(id(p), f"param{i}") for i, p in enumerate(p for g in opt.param_groups for p in g["params"])]


def _optimizer_entries(model: Any, opt: torch.optim.Optimizer, prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Replicated torch optimizer -> (``prefix/<param>/<key>`` tensors, param_groups + scalars for :func:`ckpt.pack`)."""
    names = _param_names(model, opt)
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{prefix}/{names[idx]}/{k}"] = v
            else:
                scalars.setdefault(names[idx], {})[k] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def checkpoint_state(model: Any, dense_opt: torch.optim.Optimizer, emb_dense_opt: torch.optim.Optimizer | None,
                     fused_opt: Any, rank: int, trainer: dict[str, Any], lr_schedule: Any = None) -> dict[str, Any]:
    """Everything one rank contributes to a checkpoint, as a flat DCP state dict (format:
    :mod:`dlrmctl.train.checkpoint`).  Tensors are live views: no copy of a table is made.

    ``meta/fused_optimizer`` holds ``{type, lr, eps, weight_decay, step}``; ``step`` is the
    trainer's step for every embedding optimizer (restored into each TBE's ``iter``)."""
    state: dict[str, Any] = embedding_state(model, emb_dense_opt)
    state.update({f"dense/{k}": v for k, v in dense_state_dict(model).items()})
    opt_t, opt_o = _optimizer_entries(model, dense_opt, "dense_opt")
    state.update(opt_t)
    spec = fused_opt.spec
    # the trainer's step, for every optimizer: FBGEMM's own counter (TBE ``iter``) is not it
    # (exact_adagrad / exact_sgd never advance it; exact_rowwise_adagrad counts every forward,
    # evaluation batches included)
    fused = {"type": spec.type, "lr": fused_opt.lr, "eps": spec.eps, "weight_decay": spec.weight_decay,
             "step": int(trainer["step"])}
    emb_groups = None
    scalars: dict[str, Any] = {}
    if emb_dense_opt is not None:
        emb_groups = [{k: v for k, v in g.items() if k != "params"} for g in emb_dense_opt.param_groups]
        names = {id(p): n for n, p in _dlrm(model).named_parameters()}
        for p, st in emb_dense_opt.state.items():
            sc = {k: (v.item() if torch.is_tensor(v) else v) for k, v in st.items() if not (torch.is_tensor(v) and v.dim() > 0)}
            if sc:
                scalars[names.get(id(p), "?")] = sc
    state.update({
        "meta/trainer": ckpt.pack(trainer, "meta/trainer"),
        "meta/fused_optimizer": ckpt.pack(fused, "meta/fused_optimizer"),
        "meta/dense_optimizer": ckpt.pack(opt_o, "meta/dense_optimizer"),
        "meta/embedding_dense_optimizer": ckpt.pack(emb_groups, "meta/embedding_dense_optimizer"),
        "meta/lr_schedule": ckpt.pack({"step": trainer["step"], "config": lr_schedule}, "meta/lr_schedule"),
        f"rank/{rank}": ckpt.pack({"rng": ckpt.rng_state(), "embedding_dense_scalars": scalars}, f"rank/{rank}"),
    })
    return state


def checkpoint_meta(model: Any, plan: Any, fused_opt: Any) -> dict[str, Any]:
    """Descriptive fields of meta.json: table shapes, plan, embedding optimizer type."""
    tables = _dlrm(model).sparse_arch.embedding_bag_configs()
    return {"tables": {t.name: [t.num_embeddings, t.embedding_dim] for t in tables},
            "plan": None if plan is None else plan.to_dict(),
            "embedding_optimizer": fused_opt.spec.type}


def restore_checkpoint(path: str, model: Any, dense_opt: torch.optim.Optimizer | None,
                       emb_dense_opt: torch.optim.Optimizer | None, fused_opt: Any, rank: int = 0,
                       world_size: int = 1, process_group: Any = None, plan: Any = None) -> dict[str, Any]:
    """Load a checkpoint (saved by any world size / plan) into this rank's model and optimizers.  Collective.

    Restores weights and moments (see :func:`embedding_load_request` for the
    column-wise moment rule), dense layers, the dense optimizer, the fused
    optimizer's lr and step, the embedding-dense optimizer's hyper-parameters and
    this rank's RNG states (rank ``r`` of the saving job; rank 0's when the job
    had fewer ranks).

    Returns:
        ``{"trainer": {step, epoch, best, data}, "world_size": saving job's ranks}``.

    Raises:
        CheckpointError: damaged files (named), different tables / shapes / optimizer type.
    """
    meta = ckpt.load_checkpoint_meta(path)
    check_tables(meta, _dlrm(model).sparse_arch.embedding_bag_configs(), path)
    saved_type = meta.get("embedding_optimizer")
    if fused_opt is not None and saved_type and saved_type != fused_opt.spec.type:
        raise ckpt.CheckpointError(
            f"{os.path.join(path, 'meta.json')}: saved with embedding optimizer {saved_type}, the model uses "
            f"{fused_opt.spec.type}; their moments are not interchangeable"
        )
    md = ckpt.read_metadata(path, meta)
    req, finish = embedding_load_request(model, md, emb_dense_opt)
    dense = dense_state_dict(model)
    saved_dense = {k[len("dense/"):] for k in md.state_dict_metadata if k.startswith("dense/")}
    if saved_dense != set(dense):
        raise ckpt.CheckpointError(
            f"{path}: dense layers do not match the model: missing {sorted(set(dense) - saved_dense)}, "
            f"unexpected {sorted(saved_dense - set(dense))}"
        )
    req.update({f"dense/{k}": v for k, v in dense.items()})
    opt_state: dict[str, dict[str, torch.Tensor]] = {}
    if dense_opt is not None:
        for k, m in md.state_dict_metadata.items():
            if k.startswith("dense_opt/"):
                pname, skey = k[len("dense_opt/"):].rsplit("/", 1)
                t = torch.empty(tuple(m.size), dtype=m.properties.dtype)
                opt_state.setdefault(pname, {})[skey] = t
                req[k] = t
    src_rank = rank if rank < int(meta["world_size"]) else 0
    objs = ["meta/trainer", "meta/fused_optimizer", "meta/dense_optimizer", "meta/embedding_dense_optimizer", f"rank/{src_rank}"]
    req.update({k: None for k in objs})
    ckpt.load_checkpoint(path, req, process_group, world_size, meta, metadata=md)
    finish()
    fused = ckpt.unpack(req["meta/fused_optimizer"], "meta/fused_optimizer")
    if fused_opt is not None:
        fused_opt.set_lr(float(fused["lr"]))
        for tbe, _ in getattr(fused_opt, "_tbes", []):
            if hasattr(tbe, "set_optimizer_step"):
                tbe.set_optimizer_step(int(fused["step"]))
        if (fused["eps"], fused["weight_decay"]) != (fused_opt.spec.eps, fused_opt.spec.weight_decay):
            log.warning("checkpoint's embedding optimizer eps / weight_decay %s differ from the config's %s; using the config's",
                        (fused["eps"], fused["weight_decay"]), (fused_opt.spec.eps, fused_opt.spec.weight_decay))
    if dense_opt is not None:
        o = ckpt.unpack(req["meta/dense_optimizer"], "meta/dense_optimizer")
        names = _param_names(model, dense_opt)
        idx = {n: i for i, n in enumerate(names)}
        unknown = sorted(set(opt_state) - set(idx))
        if unknown:
            raise ckpt.CheckpointError(f"{path}: dense optimizer state for parameters the model lacks: {unknown}")
        st = {idx[n]: dict(v) for n, v in opt_state.items()}
        for n, sc in o["scalars"].items():
            if n in idx:
                st.setdefault(idx[n], {}).update(sc)
        # how the update runs (foreach / fused) is this process's choice, not state: a checkpoint
        # written with torch's per-parameter loop resumes on the multi-tensor form (bit-identical)
        impl = [{k: g[k] for k in _OPTIMIZER_IMPL_KEYS if k in g} for g in dense_opt.param_groups]
        try:
            dense_opt.load_state_dict({"state": st, "param_groups": o["param_groups"]})
        except (ValueError, KeyError) as e:
            raise ckpt.CheckpointError(f"{path}: dense optimizer state does not match the model: {e}") from e
        for g, keep in zip(dense_opt.param_groups, impl):
            g.update(keep)
    groups = ckpt.unpack(req["meta/embedding_dense_optimizer"], "meta/embedding_dense_optimizer")
    per_rank = ckpt.unpack(req[f"rank/{src_rank}"], f"rank/{src_rank}")
    if emb_dense_opt is not None:
        for g, sg in zip(emb_dense_opt.param_groups, groups or []):
            # eps / weight_decay come from the config (as for the fused tables, see the warning above)
            g.update({k: v for k, v in sg.items() if k not in ("params", "eps", "weight_decay")})
        same_layout = int(meta["world_size"]) == world_size and meta.get("plan") == (None if plan is None else plan.to_dict())
        if same_layout:
            names = {id(p): n for n, p in _dlrm(model).named_parameters()}
            for p, st in emb_dense_opt.state.items():
                for k, v in per_rank["embedding_dense_scalars"].get(names.get(id(p), "?"), {}).items():
                    if torch.is_tensor(st.get(k)):
                        st[k].fill_(v)
                    else:
                        st[k] = v
    trainer = ckpt.unpack(req["meta/trainer"], "meta/trainer")
    if emb_dense_opt is not None and hasattr(emb_dense_opt, "set_step"):
        # the Adam family's bias-correction step is the global step: one optimizer step per trainer step
        emb_dense_opt.set_step(int(trainer["step"]))
    ckpt.set_rng_state(per_rank["rng"])
    return {"trainer": trainer, "world_size": int(meta["world_size"])}


def resolve_plan(cfg: ExperimentConfig, tables: list, env: RunEnv, meta: dict | None) -> Any:
    """The sharding plan for this job: ``sharding.plan_file``, else the planner on rank 0, broadcast."""
    from dlrmctl.distributed.types import ShardingPlan

    if cfg.sharding.plan_file:
        return ShardingPlan.load(cfg.sharding.plan_file)
    obj: Any = None
    if env.is_main:
        from dlrmctl.planner.planner import plan_for_config

        obj = plan_for_config(cfg, env.world_size, env.local_world_size, meta).to_dict()
    return ShardingPlan.from_dict(comm.broadcast_object(obj, 0, env.pg))


def check_run_dir(cfg: ExperimentConfig, resume: bool, overwrite: bool) -> str:
    """The run directory ``train.run_dir/<name>``, checked (nothing is written) for use by a new run.

    Args:
        cfg: the experiment config.
        resume: the run continues the directory's newest checkpoint.
        overwrite: the run replaces whatever the directory holds.

    Returns:
        The run directory's path (it may not exist yet).

    Raises:
        TrainError: the run directory holds checkpoints and neither flag was given.
        OutputPathError: the run directory is a file, lies under one, or cannot be written (read-only).
        RunInUseError: another running dlrmctl holds the run directory's lock (:mod:`dlrmctl.run_lock`).
        DataMismatchError: resuming on other data than the run was trained on (fingerprints differ).
    """
    run_dir = os.path.join(cfg.train.run_dir, cfg.name)
    # a file, under a file, read-only or not writable: one line before anything is written
    check_output_dir(cfg.train.run_dir, "train.run_dir")
    check_output_dir(run_dir, "the run directory")
    run_lock.check_not_in_use(run_dir)  # another dlrmctl is training it: refuse before anything else
    if not resume and not overwrite and os.path.exists(os.path.join(run_dir, ckpt.CKPT_DIR)):
        raise TrainError(
            f"{run_dir} already holds a run; pass --resume to continue it, --overwrite to replace it, "
            "or --set name=<other>"
        )
    recorded = os.path.join(run_dir, "data_meta.json")
    if (resume and os.path.exists(os.path.join(run_dir, ckpt.CKPT_DIR)) and os.path.exists(recorded)
            and os.path.exists(os.path.join(cfg.data.path, "meta.json"))):
        from dlrmctl.data.fingerprint import check_run_data

        check_run_data(recorded, cfg.data.path, hint="Resume on the data the run was trained on, or start a new run "
                                                     "(--set name=<other>)")
    return run_dir


def check_train_splits(cfg: ExperimentConfig, meta: dict) -> None:
    """The train and validation splits exist and have rows (one error line naming the split otherwise)."""
    from dlrmctl.data.fingerprint import split_rows

    split_rows(meta, cfg.data.path, cfg.data.train_split, "data.train_split")
    split_rows(meta, cfg.data.path, cfg.data.val_split, "data.val_split")


def prepare_run_dir(cfg: ExperimentConfig, resume: bool, overwrite: bool, config_path: str | None = None) -> str:
    """``train.run_dir/<name>``, set up for this attempt (its ``.dlrmctl`` marker, attempt marker,
    config.yaml, data_meta.json); refuses to clobber an existing run unless resuming or overwriting.

    With ``overwrite`` an existing run is not deleted: its files are moved into
    ``<run_dir>/.dlrmctl_replaced`` (:data:`REPLACED_DIR`) and deleted only once this run has its
    first complete checkpoint or ends successfully (:func:`finish_replacement`); a replacement that
    fails or is cancelled before that gets the old run back (:func:`clear_unsaved_attempt`, or
    :func:`settle_replacement` at the next ``train`` after a kill).

    Raises:
        TrainError: the run directory holds checkpoints and neither flag was given; with
            ``overwrite``, the directory holds files that are not a dlrmctl run's.
    """
    run_dir = check_run_dir(cfg, resume, overwrite)
    settle_replacement(run_dir)  # an --overwrite attempt killed before its first checkpoint: the old run is back
    clear_unsaved_attempt(run_dir)  # a failed attempt's files must not mix into this run's
    if overwrite and not resume and os.path.exists(run_dir):
        _set_aside(run_dir)  # kept until this run's first complete checkpoint (finish_replacement)
    cpath = os.path.join(run_dir, "config.yaml")
    if (os.path.exists(cpath) and not os.path.exists(os.path.join(run_dir, ATTEMPT_MARKER))
            and not os.path.exists(os.path.join(run_dir, ckpt.CKPT_DIR))):
        raise TrainError(f"{cpath} exists and was not written by dlrmctl; keep experiment configs outside the run "
                         "directory (it is replaced by the resolved config), or --set name=<other>")
    os.makedirs(run_dir, exist_ok=True)
    if outputs.read_marker(run_dir) is None:
        outputs.write_marker(run_dir, "run")
    with open(os.path.join(run_dir, ATTEMPT_MARKER), "w") as f:  # what this attempt writes is newer than this
        f.write(f"{os.getpid()}\n")
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
    meta = read_data_meta(cfg)
    if meta is not None:
        with open(os.path.join(run_dir, "data_meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
    return run_dir


#: written when a run attempt starts: clear_unsaved_attempt removes only outputs newer than it
ATTEMPT_MARKER = ".dlrmctl_attempt"

#: what a run writes besides checkpoints/ and logs/ (removed by clear_unsaved_attempt)
RUN_OUTPUTS = ("config.yaml", "data_meta.json", "plan.yaml", "plan.txt", "metrics.jsonl", "summary.json",
               "tensorboard", "loss.png", "auc.png", "throughput.png")


#: where ``--overwrite`` keeps the run it replaces until the replacement has a complete checkpoint
REPLACED_DIR = ".dlrmctl_replaced"
#: entries of a run directory that never move with the run (the lock of the live attempt, the aside dir)
_STAYS = (run_lock.LOCK_NAME, REPLACED_DIR)


def _set_aside(run_dir: str) -> None:
    """Move the run in ``run_dir`` (everything but the lock) into ``run_dir/.dlrmctl_replaced``.

    Raises:
        TrainError: ``run_dir`` holds files that are not a dlrmctl run's (``--overwrite`` replaces
            only what dlrmctl made), or is the working directory, home or ``/``.
    """
    names = [n for n in os.listdir(run_dir) if n not in _STAYS]
    if not names:
        return
    if not set(names) <= {"logs", outputs.MARKER_NAME, ATTEMPT_MARKER}:  # more than a cleared attempt's logs
        try:
            outputs.check_replaceable(run_dir, "run", "--overwrite", "--set name=<other> for a new run")
        except outputs.OutputError as e:
            raise TrainError(str(e)) from None
    aside = os.path.join(run_dir, REPLACED_DIR)
    os.makedirs(aside)
    for n in names:
        os.rename(os.path.join(run_dir, n), os.path.join(aside, n))
    if os.path.exists(os.path.join(aside, outputs.MARKER_NAME)):
        shutil.copy2(os.path.join(aside, outputs.MARKER_NAME), os.path.join(run_dir, outputs.MARKER_NAME))


def finish_replacement(run_dir: str, done: bool = False) -> bool:
    """Delete the run an ``--overwrite`` set aside once the new run has a complete checkpoint
    (call after a save, rank 0) or is ``done`` (it ended successfully).  Returns True when deleted."""
    aside = os.path.join(run_dir, REPLACED_DIR)
    if not os.path.isdir(aside):
        return False
    try:
        if not done and ckpt.latest_checkpoint(run_dir) is None:
            return False
    except ckpt.CheckpointError:
        return False
    shutil.rmtree(aside, ignore_errors=True)
    return True


def _restore_replaced(run_dir: str) -> bool:
    """Put back the run an ``--overwrite`` attempt set aside: the attempt's own files (all but the
    lock) go, the old run's come back as they were.  Returns True when restored."""
    aside = os.path.join(run_dir, REPLACED_DIR)
    if not os.path.isdir(aside):
        return False
    for n in os.listdir(run_dir):
        if n not in _STAYS:
            p = os.path.join(run_dir, n)
            shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)
    for n in os.listdir(aside):
        os.rename(os.path.join(aside, n), os.path.join(run_dir, n))
    os.rmdir(aside)
    return True


def settle_replacement(run_dir: str) -> None:
    """Resolve an ``--overwrite`` left half-way by a killed attempt: with a complete new checkpoint
    the old run is deleted (:func:`finish_replacement`), else it is restored."""
    if os.path.isdir(os.path.join(run_dir, REPLACED_DIR)) and not finish_replacement(run_dir):
        _restore_replaced(run_dir)


def clear_unsaved_attempt(run_dir: str) -> bool:
    """Remove what a run attempt that saved no checkpoint left in ``run_dir`` (config, data meta,
    plan, metrics, summary, plots), so that a retry starts clean; ``logs/`` (the failure's record),
    files dlrmctl does not write, and files older than the attempt's marker (:data:`ATTEMPT_MARKER`,
    e.g. a plan kept there by the user) stay.  A run directory with checkpoints is not touched.

    An ``--overwrite`` attempt's set-aside run (:data:`REPLACED_DIR`) comes back unless the attempt
    has a complete checkpoint.

    Returns:
        True when something was removed.
    """
    if os.path.isdir(os.path.join(run_dir, REPLACED_DIR)):
        if finish_replacement(run_dir):
            return False
        return _restore_replaced(run_dir)
    if not os.path.isdir(run_dir) or os.path.exists(os.path.join(run_dir, ckpt.CKPT_DIR)):
        return False
    marker = os.path.join(run_dir, ATTEMPT_MARKER)
    if not os.path.exists(marker):  # not an attempt of dlrmctl's: nothing here is ours to remove
        return False
    since = os.path.getmtime(marker)
    removed = False
    for n in RUN_OUTPUTS:
        p = os.path.join(run_dir, n)
        if os.path.exists(p) and os.path.getmtime(p) < since:
            continue  # there before the attempt (e.g. a plan the user keeps here): not the attempt's
        if os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
            removed = True
        elif os.path.exists(p):
            os.remove(p)
            removed = True
    os.remove(marker)
    left = set(os.listdir(run_dir)) - {run_lock.LOCK_NAME}
    if outputs.MARKER_NAME in left and left <= {outputs.MARKER_NAME, "logs"}:  # no run left: the failure's logs at most
        os.remove(os.path.join(run_dir, outputs.MARKER_NAME))
    if not os.listdir(run_dir):
        os.rmdir(run_dir)
    return removed


def load_trained_model(run_dir: str, device: str = "cpu", compute_kernel: str | None = "dense",
                       checkpoint: str | None = "last", materialize: bool = True):
    """``(cfg, model, meta)`` of :func:`load_trained_model_with_checkpoint` (same arguments, errors)."""
    return load_trained_model_with_checkpoint(run_dir, device, compute_kernel, checkpoint, materialize)[:3]


def load_trained_model_with_checkpoint(run_dir: str, device: str = "cpu", compute_kernel: str | None = "dense",
                                       checkpoint: str | None = "last", materialize: bool = True):
    """Rebuild a trained model (unsharded) from a run directory's checkpoint: ``checkpoint`` is
    ``last`` (the newest), ``best`` (``train.keep_best``), a step, or None (best if any, else last).

    The model is built on the meta device (``build_model(device="meta")``: no table storage,
    no table init) and its dense part loaded; with ``materialize`` the tables are then
    allocated empty on ``device`` and loaded from the checkpoint (no random-init pass).

    Args:
        materialize: False: leave the tables on the meta device (the dense part is loaded, on
            the CPU); read them one at a time with :func:`load_table_weight` (what export does).

    Returns:
        ``(cfg, model, meta, checkpoint_meta, metadata)``: the resolved config, a DLRM with all
        tables assembled from the saved shards (float32, also from an fp16-table run), the
        training data's meta.json, and the checkpoint's verified meta.json and DCP ``.metadata``
        (read once: :func:`load_table_weight` takes them).

    Raises:
        CheckpointError / TrainError: no config, meta or checkpoint in ``run_dir``; tables that
            differ from the checkpoint's.
    """
    from dlrmctl.train.factory import materialize_model

    cfg = run_config(run_dir)
    mpath = os.path.join(run_dir, "data_meta.json")
    if not os.path.exists(mpath):
        raise TrainError(f"{mpath}: missing; the run directory is incomplete")
    with open(mpath) as f:
        meta = json.load(f)
    path, _ = ckpt.resolve_checkpoint(run_dir, checkpoint)
    # the fp32 view of the tables whatever model.embedding_precision trained them in (fp16 weights
    # widen exactly): what evaluation, prediction and export (which quantizes from fp32) start from
    tables = [dataclasses.replace(t, data_type=DataType.FP32) for t in resolve_tables(cfg, meta)]
    model = build_model(cfg, tables, len(meta["dense_features"]), device="meta", compute_kernel=compute_kernel)
    cmeta = ckpt.load_checkpoint_meta(path)
    check_tables(cmeta, tables, path)
    req: dict[str, Any] = {}
    finish = None
    md = ckpt.read_metadata(path, cmeta)
    if materialize:
        materialize_model(model, device)
        req, finish = embedding_load_request(model, md)  # full tables, assembled from every saved shard
    dense = dense_state_dict(model)
    req.update({f"dense/{k}": v for k, v in dense.items()})
    ckpt.load_checkpoint(path, req, meta=cmeta, metadata=md)
    if finish is not None:
        finish()
    model.eval()
    return cfg, model, meta, cmeta, md


@torch.no_grad()
def load_table_weight(ckpt_dir: str, table: Any, meta: dict[str, Any] | None = None,
                      metadata: Any = None) -> torch.Tensor:
    """One table's weights ``[num_embeddings, embedding_dim]`` float32 (CPU), assembled from
    every saved shard of checkpoint ``ckpt_dir`` (any sharding); only that table's chunks are
    read.  Memory: the table, plus one read slab (``checkpoint.READ_SLAB_BYTES``).

    Args:
        table: the table's config (``name``, ``num_embeddings``, ``embedding_dim``).
        meta: the checkpoint's meta.json (:func:`~dlrmctl.train.checkpoint.load_checkpoint_meta`).
        metadata: its DCP metadata (:func:`~dlrmctl.train.checkpoint.read_metadata`), so a caller
            loading table after table reads and verifies ``.metadata`` once.

    Raises:
        CheckpointError: no such table, another shape, or a damaged file (named).
    """
    w = torch.empty(table.num_embeddings, table.embedding_dim)
    ckpt.load_checkpoint(ckpt_dir, {f"emb/{table.name}/weight": w}, meta=meta, metadata=metadata)
    return w


def run_config(run_dir: str) -> ExperimentConfig:
    """The resolved config a run recorded (``run_dir/config.yaml``).

    Raises:
        TrainError: no config.yaml (not a run directory).
    """
    from dlrmctl.config import config_from_dict
    from dlrmctl.yaml_file import read_yaml

    cpath = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(cpath):
        raise TrainError(f"{run_dir}: no config.yaml; not a dlrmctl run directory")
    return config_from_dict(read_yaml(cpath, TrainError, "run's recorded config"), source=cpath)


@torch.no_grad()
def evaluate_run(run_dir: str, split: str = "val", data_dir: str | None = None, batch_size: int | None = None,
                 checkpoint: str | None = None, any_split: bool = False, progress: bool = False) -> dict[str, float]:
    """Metrics of a run's checkpoint on ``split`` of its data (or ``data_dir``), from the logits
    (:func:`~dlrmctl.train.metrics.compute_metrics_from_logits`, as ``Trainer.evaluate``).

    The data must be the data the run was trained on: its fingerprint (schema, vocabularies and
    split; without the split with ``any_split``) must equal the one of ``run_dir/data_meta.json``
    (:mod:`dlrmctl.data.fingerprint`).

    Args:
        checkpoint: ``best``, ``last`` or a step; None: best if the run kept one, else last.
        any_split: accept data whose split differs (same schema and vocabularies).
        progress: show evaluation progress (:class:`dlrmctl.console.Progress`).

    Returns:
        ``{"auc", "logloss", "ne", "calibration", "accuracy", "ctr", "num_samples"}``.

    Raises:
        DataMismatchError: other data than the run's; DataError: ``split`` missing or empty.
    """
    return compute_metrics_from_logits(*run_logits(run_dir, split, data_dir, batch_size, checkpoint=checkpoint,
                                                   any_split=any_split, progress=progress))


def run_logits(run_dir: str, split: str = "val", data_dir: str | None = None, batch_size: int | None = None,
               checkpoint: str | None = None, any_split: bool = False,
               progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The logits and labels of a run's checkpoint on ``split``, in the split's row order (what
    :func:`evaluate_run` computes its metrics from; e.g. to pool the rows of several runs).

    Same arguments, data check and errors as :func:`evaluate_run`.

    Returns:
        ``(logits [n] float32, labels [n] float32)``.
    """
    from dlrmctl.data.fingerprint import PARTS, check_run_data, read_meta_json, split_rows
    from dlrmctl.data.loader import BatchLoader

    data = data_dir or run_config(run_dir).data.path
    check_run_data(os.path.join(run_dir, "data_meta.json"), data, PARTS[:2] if any_split else PARTS,
                   hint="Evaluate on the data the run was trained on (--data DIR), or train on this data"
                        + ("" if any_split else "; --any-split accepts other rows with the same schema and vocabularies"))
    split_rows(read_meta_json(os.path.join(data, "meta.json")), data, split)
    cfg, model, meta = load_trained_model(run_dir, checkpoint=checkpoint)
    feats = model.sparse_arch.feature_names()  # each input feature once (the model applies on_invalid_id)
    loader = BatchLoader(data, split, batch_size or cfg.data.eval_batch_size, shuffle=False,
                         features=feats, require_labels=True, **multi_hot_kwargs(cfg, meta))
    logits, labels = [], []
    with Progress(len(loader), f"eval {split}", "batch", enabled=progress, every_s=cfg.train.progress_every_s,
                  final_line=False, leave=False) as bar, torch.no_grad():
        for batch in loader:
            logits.append(model(batch.dense_features, batch.sparse_features).squeeze(1).float().numpy())
            labels.append(batch.labels.numpy())
            bar.update(1)
    return np.concatenate(logits), np.concatenate(labels)
