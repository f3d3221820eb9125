"""ONE container over a trainer's optimizers (TorchRec's ``CombinedOptimizer`` idea):

* the fused optimizer of the FBGEMM tables (:class:`~dlrmctl.modules.embedding_modules.FusedOptimizer`,
  its update runs inside the lookup's backward),
* the torch optimizer of the dense-kernel embedding shards (data_parallel replicas, dense-kernel
  tables; :func:`~dlrmctl.optim.dense.embedding_optimizer_for_dense`), absent when there are none,
* the dense optimizer of the MLPs / interaction (:func:`~dlrmctl.optim.dense.dense_optimizer`),

and the LR schedule (``optimizer.lr_schedule``) that sets all of them.  The container hands out
and takes back plain state (:meth:`TrainOptimizers.state_dict`); which checkpoint keys it is
written under is :mod:`dlrmctl.train.checkpoint.layout`'s, as for the embedding moments, which
travel with the table shards.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from dlrmctl.config import ExperimentConfig, LRScheduleConfig, to_dict
from dlrmctl.distributed.model_parallel import TrainModel, unwrap_dlrm
from dlrmctl.train.checkpoint.format import CheckpointError
from dlrmctl.optim.dense import dense_optimizer, embedding_optimizer_for_dense

log = logging.getLogger("dlrmctl.train")

#: torch optimizer param_group keys that pick an implementation, not hyper-parameters or state
_OPTIMIZER_IMPL_KEYS = ("foreach", "fused", "capturable", "differentiable")


class WarmupPolyDecay:
    """LR factor schedule of the DLRM reference (``LRPolicyScheduler``).

    ``factor(step)``:

    * ``step < warmup_steps``: ``(step + 1) / warmup_steps`` (linear warmup);
    * ``decay_start_step <= step < decay_start_step + decay_steps``:
      ``max(end_lr_factor, ((decay_steps - (step - decay_start_step)) / decay_steps) ** decay_power)``;
    * after the decay window: ``end_lr_factor``;
    * otherwise 1.

    The factor multiplies each optimizer's base lr; :meth:`apply` sets them.
    """

    def __init__(self, cfg: LRScheduleConfig) -> None:
        self.cfg = cfg

    def factor(self, step: int) -> float:
        c = self.cfg
        if c.warmup_steps and step < c.warmup_steps:
            return (step + 1) / c.warmup_steps
        if c.decay_steps and step >= c.decay_start_step:
            s = step - c.decay_start_step
            if s >= c.decay_steps:
                return c.end_lr_factor
            return max(c.end_lr_factor, ((c.decay_steps - s) / c.decay_steps) ** c.decay_power)
        return 1.0

    def apply(self, step: int, optimizers: list[tuple[object, float]]) -> float:
        """Set lr = base * factor(step) on each ``(optimizer, base_lr)``; returns the factor.

        ``optimizer`` is a torch optimizer (its param groups) or anything with ``set_lr``.
        """
        f = self.factor(step)
        for opt, base in optimizers:
            if hasattr(opt, "set_lr"):
                opt.set_lr(base * f)  # type: ignore[attr-defined]
            else:
                for g in opt.param_groups:  # type: ignore[attr-defined]
                    g["lr"] = base * f
        return f


class _FusedMember:
    """The fused TBE optimizer; its state ``{type, lr, eps, weight_decay, step}`` (``step``: the
    trainer's, restored into each TBE's ``iter``)."""

    def __init__(self, opt: Any) -> None:
        self.opt = opt

    def state(self, step: int) -> dict[str, Any]:
        """``{type, lr, eps, weight_decay, step}``."""
        spec = self.opt.spec
        # the trainer's step, for every optimizer: FBGEMM's own counter (TBE ``iter``) is not it
        # (exact_adagrad / exact_sgd never advance it; exact_rowwise_adagrad counts every forward,
        # evaluation batches included)
        return {"type": spec.type, "lr": self.opt.lr, "eps": spec.eps, "weight_decay": spec.weight_decay,
                "step": int(step)}

    def check_saved_type(self, meta: dict[str, Any], path: str) -> None:
        """Raises CheckpointError when the checkpoint's embedding optimizer type differs."""
        saved_type = meta.get("embedding_optimizer")
        if saved_type and saved_type != self.opt.spec.type:
            raise CheckpointError(
                f"{os.path.join(path, 'meta.json')}: saved with embedding optimizer {saved_type}, the model uses "
                f"{self.opt.spec.type}; their moments are not interchangeable"
            )

    def load(self, fused: dict[str, Any]) -> None:
        """lr and step from a saved :meth:`state`; eps / weight_decay stay the config's (a warning if they differ)."""
        self.opt.set_lr(float(fused["lr"]))
        self.opt.set_optimizer_step(int(fused["step"]))
        if (fused["eps"], fused["weight_decay"]) != (self.opt.spec.eps, self.opt.spec.weight_decay):
            log.warning("checkpoint's embedding optimizer eps / weight_decay %s differ from the config's %s; using the config's",
                        (fused["eps"], fused["weight_decay"]), (self.opt.spec.eps, self.opt.spec.weight_decay))


class _DenseMember:
    """The replicated dense optimizer; its state: per parameter name its state tensors, the
    param_groups and the per-parameter scalars."""

    def __init__(self, opt: torch.optim.Optimizer, names: dict[int, str]) -> None:
        self.opt = opt
        self._names = names

    def param_names(self) -> list[str]:
        """The model's name of each parameter, in the optimizer's order (``param<i>`` if unnamed)."""
        return [self._names.get(id(p), f"param{i}")
                for i, p in enumerate(p for g in self.opt.param_groups for p in g["params"])]

    def state(self) -> dict[str, Any]:
        """``{"tensors": {param: {key: tensor (live)}}, "param_groups": [...], "scalars": {param: {key: value}}}``."""
        names = self.param_names()
        sd = self.opt.state_dict()
        tensors: dict[str, dict[str, Any]] = {}
        scalars: dict[str, Any] = {}
        for idx, st in sd["state"].items():
            for k, v in st.items():
                if torch.is_tensor(v):
                    tensors.setdefault(names[idx], {})[k] = v
                else:
                    scalars.setdefault(names[idx], {})[k] = v
        return {"tensors": tensors, "param_groups": sd["param_groups"], "scalars": scalars}

    def load(self, o: dict[str, Any], path: str) -> None:
        """Load a saved :meth:`state` into the optimizer (its foreach / fused choice kept).

        Raises:
            CheckpointError: state for parameters the model lacks, or that does not fit.
        """
        opt_state = o["tensors"]
        idx = {n: i for i, n in enumerate(self.param_names())}
        unknown = sorted(set(opt_state) - set(idx))
        if unknown:
            raise CheckpointError(f"{path}: dense optimizer state for parameters the model lacks: {unknown}")
        st = {idx[n]: dict(v) for n, v in opt_state.items()}
        for n, sc in o["scalars"].items():
            if n in idx:
                st.setdefault(idx[n], {}).update(sc)
        # how the update runs (foreach / fused) is this process's choice, not state: a checkpoint
        # written with torch's per-parameter loop resumes on the multi-tensor form (bit-identical)
        impl = [{k: g[k] for k in _OPTIMIZER_IMPL_KEYS if k in g} for g in self.opt.param_groups]
        try:
            self.opt.load_state_dict({"state": st, "param_groups": o["param_groups"]})
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{path}: dense optimizer state does not match the model: {e}") from e
        for g, keep in zip(self.opt.param_groups, impl):
            g.update(keep)


class _EmbeddingDenseMember:
    """The dense-kernel embedding shards' torch optimizer (may be None: no such shards).
    Its state: the param_groups without params, and per rank the per-parameter scalar state
    (:meth:`rank_scalars`); its moments travel with the shards."""

    def __init__(self, opt: torch.optim.Optimizer | None, names: dict[int, str]) -> None:
        self.opt = opt
        self._names = names

    def state(self) -> list[dict[str, Any]] | None:
        """The param_groups without params, or None (no such optimizer)."""
        if self.opt is None:
            return None
        return [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]

    def rank_scalars(self) -> dict[str, Any]:
        """Parameter name -> its scalar (0-d) state entries on this rank."""
        scalars: dict[str, Any] = {}
        if self.opt is not None:
            for p, st in self.opt.state.items():
                sc = {k: (v.item() if torch.is_tensor(v) else v) for k, v in st.items()
                      if not (torch.is_tensor(v) and v.dim() > 0)}
                if sc:
                    scalars[self._names.get(id(p), "?")] = sc
        return scalars

    def load(self, groups: list[dict[str, Any]] | None, scalars: dict[str, Any], same_layout: bool,
             step: int) -> None:
        """Hyper-parameters (eps / weight_decay stay the config's), this rank's ``scalars``
        (:meth:`rank_scalars` of the saving rank) when the layout is the same, and the Adam family's
        step = ``step``."""
        if self.opt is None:
            return
        for g, sg in zip(self.opt.param_groups, groups or []):
            # eps / weight_decay come from the config (as for the fused tables, see the warning above)
            g.update({k: v for k, v in sg.items() if k not in ("params", "eps", "weight_decay")})
        if same_layout:
            for p, st in self.opt.state.items():
                for k, v in scalars.get(self._names.get(id(p), "?"), {}).items():
                    if torch.is_tensor(st.get(k)):
                        st[k].fill_(v)
                    else:
                        st[k] = v
        if hasattr(self.opt, "set_step"):
            # the Adam family's bias-correction step is the global step: one optimizer step per trainer step
            self.opt.set_step(int(step))


class TrainOptimizers:
    """The fused, dense-kernel embedding and dense optimizers of one model, and their LR schedule.

    Args:
        model: the DLRM or its DistributedModelParallel (parameter names for the checkpoint keys).
        fused: the fused TBE optimizer (``model.fused_optimizer()``).
        dense: the dense optimizer.
        embedding_dense: the dense-kernel embedding shards' optimizer, or None.
        schedule: the LR schedule; each member's base lr is its configured lr.
        dense_lr / embedding_lr: the base lrs.
        schedule_config: ``optimizer.lr_schedule`` as a dict (recorded in checkpoints).
    """

    def __init__(self, model: TrainModel, fused: Any, dense: torch.optim.Optimizer,
                 embedding_dense: torch.optim.Optimizer | None, schedule: WarmupPolyDecay,
                 dense_lr: float, embedding_lr: float, schedule_config: Any = None) -> None:
        names = {id(p): n for n, p in unwrap_dlrm(model).named_parameters()}
        self._fused = _FusedMember(fused)
        self._dense = _DenseMember(dense, names)
        self._embedding_dense = _EmbeddingDenseMember(embedding_dense, names)
        self.schedule = schedule
        self._schedule_config = schedule_config
        self._lr_targets: list[tuple[Any, float]] = [(fused, embedding_lr), (dense, dense_lr)]
        if embedding_dense is not None:
            self._lr_targets.append((embedding_dense, embedding_lr))

    @classmethod
    def for_model(cls, model: TrainModel, cfg: ExperimentConfig) -> "TrainOptimizers":
        """The optimizers ``cfg.optimizer`` gives ``model`` (sharded or not)."""
        fused = model.fused_optimizer()
        emb_dense = model.embedding_dense_parameters()
        dense = dense_optimizer(model.dense_parameters(), cfg.optimizer.dense)
        e = cfg.optimizer.embedding
        emb_opt = (embedding_optimizer_for_dense(emb_dense, e.type, e.lr, e.eps, e.weight_decay, tuple(e.betas))
                   if emb_dense else None)
        return cls(model, fused, dense, emb_opt, WarmupPolyDecay(cfg.optimizer.lr_schedule),
                   cfg.optimizer.dense.lr, e.lr, to_dict(cfg.optimizer.lr_schedule))

    # ------------------------------------------------------------ members
    @property
    def fused(self) -> Any:
        """The fused TBE optimizer (:class:`~dlrmctl.modules.embedding_modules.FusedOptimizer`)."""
        return self._fused.opt

    @property
    def dense(self) -> torch.optim.Optimizer:
        """The dense (MLP / interaction) optimizer."""
        return self._dense.opt

    @property
    def embedding_dense(self) -> torch.optim.Optimizer | None:
        """The dense-kernel embedding shards' optimizer, or None."""
        return self._embedding_dense.opt

    # ----------------------------------------------------------- stepping
    def set_lr(self, step: int) -> float:
        """lr = base * schedule factor(``step``) on every member; returns the factor."""
        return self.schedule.apply(step, self._lr_targets)

    def lr_factor(self, step: int) -> float:
        """The schedule's factor at ``step`` (nothing is set)."""
        return self.schedule.factor(step)

    def zero_grad(self) -> None:
        """Clear the gradients (to None) of the dense and dense-kernel embedding parameters
        (fused tables have none)."""
        self.dense.zero_grad(set_to_none=True)
        if self.embedding_dense is not None:
            self.embedding_dense.zero_grad(set_to_none=True)

    def step(self, dense: bool = True, embedding_dense: bool = True) -> None:
        """Step the members (the fused one is a no-op: its update ran in backward); ``dense`` /
        ``embedding_dense`` False: skip that member (fp16 overflow, :mod:`dlrmctl.train.amp`)."""
        self.fused.step()
        if dense:
            self.dense.step()
        if embedding_dense and self.embedding_dense is not None:
            self.embedding_dense.step()

    # --------------------------------------------------------- checkpoint
    def state_dict(self, step: int) -> dict[str, Any]:
        """Every member's state at trainer step ``step`` (tensors are live views; the checkpoint
        keys are :mod:`dlrmctl.train.checkpoint.layout`'s)::

            {"fused": {type, lr, eps, weight_decay, step},
             "dense": {"tensors": {param: {key: tensor}}, "param_groups": [...], "scalars": {...}},
             "embedding_dense": param_groups without params, or None,
             "lr_schedule": {"step": step, "config": optimizer.lr_schedule}}
        """
        return {"fused": self._fused.state(step), "dense": self._dense.state(),
                "embedding_dense": self._embedding_dense.state(),
                "lr_schedule": {"step": step, "config": self._schedule_config}}

    def rank_state(self) -> dict[str, Any]:
        """What the members keep per rank: the dense-kernel embedding optimizer's per-parameter
        scalar state (parameter name -> its 0-d entries)."""
        return self._embedding_dense.rank_scalars()

    def check_saved_type(self, meta: dict[str, Any], path: str) -> None:
        """Refuse a checkpoint whose embedding optimizer type differs (moments not interchangeable).

        Raises:
            CheckpointError
        """
        self._fused.check_saved_type(meta, path)

    def load_state_dict(self, state: dict[str, Any], rank_state: dict[str, Any], step: int,
                        same_layout: bool, path: str) -> None:
        """Restore every member from a saved :meth:`state_dict` (``lr_schedule`` is not read back: the
        config's schedule runs from ``step``) and the saving rank's :meth:`rank_state`
        (``same_layout``: same world size and plan, so those per-parameter scalars are this rank's own).

        Raises:
            CheckpointError: dense optimizer state that does not match the model (named).
        """
        self._fused.load(state["fused"])
        self._dense.load(state["dense"], path)
        self._embedding_dense.load(state["embedding_dense"], rank_state, same_layout, step)
