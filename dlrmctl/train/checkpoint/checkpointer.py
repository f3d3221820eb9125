"""The :class:`Checkpointer`: when a trainer saves and what it restores."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from dlrmctl.train.checkpoint.format import CheckpointError, LATEST
from dlrmctl.train.checkpoint.save import save_checkpoint
from dlrmctl.train.checkpoint.store import best_checkpoint, latest_checkpoint, load_checkpoint_meta, mark_best, resolve_checkpoint
from dlrmctl.train.checkpoint.layout import checkpoint_meta, checkpoint_state, restore_checkpoint

if TYPE_CHECKING:
    from dlrmctl.config import ExperimentConfig
    from dlrmctl.distributed.env import RunEnv
    from dlrmctl.distributed.model_parallel import TrainModel
    from dlrmctl.train.optimizers import TrainOptimizers

log = logging.getLogger("dlrmctl.train")


class ResumePoint(NamedTuple):
    """The checkpoint a resume restores, resolved once (:func:`resolve_resume`): ``path``; ``latest``,
    whether ``LATEST`` named it at that moment (then it IS the run's newest state)."""

    path: str
    latest: bool


def resolve_resume(run_dir: str, which: str | None = None) -> ResumePoint | None:
    """The checkpoint ``--resume [--checkpoint WHICH]`` restores, reading ``LATEST`` once: ``which``
    None, the newest (what ``LATEST`` names; None when the run has none); else ``best``, ``last``, a
    step or a name (:func:`~dlrmctl.train.checkpoint.resolve_checkpoint`).

    Raises:
        CheckpointError: ``which`` names no checkpoint of the run, or a marker file is damaged.
    """
    latest = latest_checkpoint(run_dir)
    if which is None or str(which).strip().lower() in ("last", "latest"):
        if latest is None and which is not None:
            from dlrmctl.outputs import set_aside_hint

            raise CheckpointError(f"{run_dir}: no checkpoint (checkpoints/{LATEST} is missing){set_aside_hint(run_dir)}")
        return None if latest is None else ResumePoint(latest, True)
    path, _ = resolve_checkpoint(run_dir, which)
    return ResumePoint(path, latest is not None and os.path.realpath(path) == os.path.realpath(latest))


class Checkpointer:
    """When a trainer saves (``train.checkpoint_every``, a new best under ``train.keep_best``,
    the end of the run; a step already saved is not written twice) and what it restores.

    Args:
        cfg: the experiment (``train.*``, the precision keys recorded in meta.json).
        env: this rank.
        run_dir: the run directory (``checkpoints/`` inside it).
        model / optimizers / plan: what is saved and restored.
        trainer_state: ``() -> {step, epoch, best, evals_since_best, data}`` at save time.
        after_save: called on rank 0 with the run directory after each complete save (the trainer
            passes :func:`dlrmctl.train.run_dir.finish_replacement`: an ``--overwrite``'s old run
            goes once the new one has a checkpoint).
        weighted_features: the features whose per-id weights the model uses, resolved
            (:func:`dlrmctl.config.weighted_features`); recorded in each checkpoint's meta.json.

    Attributes:
        saved_step / saved_path: the newest checkpoint this run wrote or resumed from
            (``-1`` / None: none yet).
    """

    def __init__(self, cfg: "ExperimentConfig", env: "RunEnv", run_dir: str, model: TrainModel,
                 optimizers: "TrainOptimizers", plan: Any, trainer_state: Callable[[], dict[str, Any]],
                 after_save: Callable[[str], Any] | None = None, weighted_features: list[str] | None = None) -> None:
        self.cfg = cfg
        #: the run's resolved weighted features, recorded in every checkpoint's meta.json
        self.weighted_features = list(weighted_features or [])
        self.env = env
        self.run_dir = run_dir
        self.model = model
        self.optimizers = optimizers
        self.plan = plan
        self.trainer_state = trainer_state
        self.after_save = after_save
        self.saved_step = -1
        self.saved_path: str | None = None

    def is_due(self, step: int) -> bool:
        """``train.checkpoint_every`` says step ``step`` is saved."""
        every = self.cfg.train.checkpoint_every
        return bool(every and step % every == 0)

    def keeps(self, new_best: bool) -> bool:
        """A new best evaluation is kept as checkpoint ``best`` (``train.keep_best`` not ``none``)."""
        return new_best and self.cfg.train.keep_best != "none"

    def save(self, step: int, new_best: bool = False, eval_record: dict[str, Any] | None = None) -> str:
        """Write a checkpoint of step ``step`` (collective: every rank writes its own shards); it
        becomes the run's best when ``new_best`` (this step's evaluation improved on the best) and
        :meth:`keeps` it.  ``eval_record``: the latest evaluation (recorded in meta.json when it is
        of this step).  Returns the checkpoint directory."""
        best = self.keeps(new_best)
        extra = checkpoint_meta(self.model, self.plan, self.optimizers)
        # what a reload builds the model with (read by dlrmctl.config.recorded_weighted_features)
        extra["weighted_features"] = self.weighted_features
        # what the run trained in (a resume may change any of them: tables are cast on load)
        extra["precision"] = {"train": self.cfg.train.precision, "embedding": self.cfg.model.embedding_precision,
                              "comm": self.cfg.sharding.comm_precision}
        if eval_record is not None and eval_record["step"] == step:
            extra["eval"] = eval_record
        path = save_checkpoint(
            self.run_dir, step,
            checkpoint_state(self.model, self.optimizers, self.env.rank, self.trainer_state(), self.env.device),
            rank=self.env.rank, world_size=self.env.world_size, process_group=self.env.pg,
            keep_last=self.cfg.train.keep_last_checkpoints, extra_meta=extra, best=best,
        )
        self.saved_step, self.saved_path = step, path
        if self.env.is_main and self.after_save is not None:
            self.after_save(self.run_dir)  # e.g. the first complete checkpoint: an --overwrite's old run goes
        return path

    def maybe_save(self, step: int, *, last_step: bool = False, new_best: bool = False,
                   eval_record: dict[str, Any] | None = None) -> str | None:
        """Save step ``step`` when it is due (:meth:`is_due`, or ``last_step``) or when its
        evaluation is a new best that :meth:`keeps` applies to.  A step saved already is not
        written twice: a new best then only points ``BEST`` at it (rank 0).  Returns the step's
        checkpoint, or None."""
        best = self.keeps(new_best)
        if not (last_step or self.is_due(step) or best):
            return None
        if self.saved_step != step:
            return self.save(step, best, eval_record)
        if best and self.env.is_main:
            mark_best(self.run_dir, self.saved_path, eval_record)
        return self.saved_path

    def load(self, which: "str | ResumePoint | None" = None) -> dict[str, Any] | None:
        """Restore ``which`` (``best``, ``last``, a step; None: the newest; or a :class:`ResumePoint`
        already resolved by :func:`resolve_resume`, not resolved again) into the model and
        optimizers: any world size / plan (DCP reads only this rank's slices).  Collective.

        Returns:
            None when the run has no checkpoint (``which`` None), else :func:`restore_checkpoint`'s
            dict (``eval``: the validation record meta.json holds, or None) plus ``path``.

        Raises:
            CheckpointError: no such checkpoint, damaged files, other tables / optimizer.
        """
        point = which if isinstance(which, ResumePoint) else resolve_resume(self.run_dir, which)
        if point is None:
            log.info("no checkpoint in %s: starting from scratch", self.run_dir)
            return None
        saved = restore_checkpoint(point.path, self.model, self.optimizers, self.env.rank, self.env.world_size,
                                   self.env.pg, plan=self.plan, device=self.env.device)
        if point.latest:
            # the newest checkpoint IS this state: a resume with nothing left to train (a finished or
            # early-stopped run) must not write it again as step_X.1 (the same on every rank: the
            # path was resolved from the same files)
            self.saved_step, self.saved_path = int(saved["trainer"]["step"]), point.path
        saved.update(path=point.path)
        return saved

    def best_kept_note(self, step: int) -> str:
        """What the end-of-run line says about the best step's checkpoint: only what ``BEST``
        really names (a run resumed from a resharded copy of a non-best checkpoint has found its
        best before the copy: no checkpoint of this directory holds it)."""
        try:  # a BEST naming a missing / incomplete checkpoint must not fail a finished run
            path = best_checkpoint(self.run_dir)
            best_step = None if path is None else int(load_checkpoint_meta(path)["step"])
        except CheckpointError as e:
            return f" (checkpoint 'best' is unusable: {e})"
        if best_step is not None and best_step == int(step):
            return ", kept as checkpoint 'best'"
        if best_step is not None:
            return f" (checkpoint 'best' is step {best_step})"
        return (f" (no checkpoint of {self.run_dir} holds step {step}: it was found before this run's "
                f"checkpoints were made, e.g. by the run a reshard --out copied; evaluate and export "
                f"take the last checkpoint)")
