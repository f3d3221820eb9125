"""The optimizer registries: one :class:`EmbeddingOptimizer` record per embedding update rule, and
one :class:`DenseOptimizer` record per optimizer of the MLPs (:data:`DENSE_OPTIMIZERS`: the config
names, the ``torch.optim`` class, the keys it reads, its state for the planner).

Everything that depends on which embedding optimizer a table trains with reads its record
here instead of restating names: config validation (the names, which run on fp16 weights),
the lookup modules (FBGEMM's ``EmbOptimType`` member, what FBGEMM's fused TBE implements on
which device, whether the TBE's step counter matters), the sharded collection (whether a
data_parallel table's gradient sync must track the rows looked up), the planner (state
bytes per shard, column-sharding safety, the lighter variant to suggest, aliases) and the
dense-kernel torch optimizers (:mod:`dlrmctl.optim.dense`: the class implementing the rule).

A new embedding optimizer is one record in :data:`EMBEDDING_OPTIMIZERS` plus its update rule:
a :class:`torch.optim.Optimizer` subclass in :mod:`dlrmctl.optim` named by ``rule`` (see
docs/extending.md).  Nothing here imports torch (config validation reads it before torch
loads).
"""

from __future__ import annotations

from dataclasses import dataclass

#: bytes of one optimizer state value: FBGEMM and the dense-kernel rules keep state in fp32
STATE_VALUE_BYTES = 4


@dataclass(frozen=True)
class EmbeddingOptimizer:
    """What the rest of dlrmctl needs to know about one embedding update rule.

    Attributes:
        name: the config name (``optimizer.embedding.type``), FBGEMM's ``EmbOptimType`` member
            in lower case where FBGEMM has one.
        rule: the class in :mod:`dlrmctl.optim` that implements the rule for ``dense``-kernel
            tables (``"<module>.<Class>"``, relative to ``dlrmctl.optim``).
        fbgemm: the ``fbgemm_gpu.split_embedding_configs.EmbOptimType`` member that fuses the
            rule into the TBE backward; ``None``: no fused kernel (always the ``dense`` kernel).
        fused_on_cpu: FBGEMM 1.8's CPU TBE implements it (its CUDA TBE implements every
            ``fbgemm`` member listed here).
        fused_weight_decay: FBGEMM's CUDA TBE applies ``weight_decay`` for it (its CPU TBE
            never does; "EXACT_ADAGRAD, SGD, EXACT_SGD do not support weight decay").
        state_per_weight: fp32 state values per weight (``[rows, dim]`` tensors).
        state_per_row: fp32 state values per row (``[rows]`` tensors).
        row_coupled: the update of a row depends on the whole row (a per-row state value, or
            a per-row norm), so column shards do not train like the whole table.
        sparse_grads: the rule updates every row looked up, also one whose summed gradient is
            exactly zero (the Adam family's moments decay), so a data_parallel table's gradient
            sync tracks the rows looked up (``ShardedEmbeddingBagCollection.track_touched_rows``,
            one more fp32 per row in its all-reduce).
        global_step: bias correction with the global step (FBGEMM's TBE ``iter``, which its
            forward advances: evaluation forwards put it back).
        fp16: FBGEMM's TBE (and the dense rule) update fp16 weights
            (``model.embedding_precision: fp16``).
        uses_eps, uses_betas: which of ``eps`` / ``betas`` the rule reads.
        row_wise_variant: a registered rule with the same update and one second-moment value
            per row instead of per weight (the planner suggests it when a table does not fit).
        aliases: other names the planner's ``TableSpec.optimizer`` accepts.
        weight_decay_doc: how ``weight_decay`` enters the update (docs/configuration.md's table).
    """

    name: str
    rule: str
    fbgemm: str | None
    fused_on_cpu: bool
    fused_weight_decay: bool
    state_per_weight: int
    state_per_row: int
    row_coupled: bool
    sparse_grads: bool = False
    global_step: bool = False
    fp16: bool = False
    uses_eps: bool = True
    uses_betas: bool = False
    row_wise_variant: str | None = None
    aliases: tuple[str, ...] = ()
    weight_decay_doc: str = "L2 on the gradient"

    def state_bytes(self, rows: int, cols: int) -> int:
        """Bytes of optimizer state of a ``rows x cols`` shard (fp32 values; FBGEMM keeps its
        momentum in fp32 whatever the weight precision)."""
        return (self.state_per_weight * rows * cols + self.state_per_row * rows) * STATE_VALUE_BYTES


def _adam(name: str, rule: str, rowwise_v: bool, lighter: str | None = None) -> EmbeddingOptimizer:
    """A member of FBGEMM's Adam family (``momentum1`` per weight; ``momentum2`` per weight, or
    per row with ``rowwise_v``; bias correction with the global step; CUDA TBE only)."""
    return EmbeddingOptimizer(
        name, rule, fbgemm=name.upper(), fused_on_cpu=False, fused_weight_decay=True,
        state_per_weight=1 if rowwise_v else 2, state_per_row=1 if rowwise_v else 0,
        row_coupled=rowwise_v or "lamb" in name, sparse_grads=True, global_step=True, uses_betas=True,
        row_wise_variant=lighter,
        weight_decay_doc="inside the trust-ratio update" if "lamb" in name else "decoupled, `lr * wd * w`")


#: every embedding optimizer, by config name (the order of the docs and error messages)
EMBEDDING_OPTIMIZERS: dict[str, EmbeddingOptimizer] = {r.name: r for r in (
    EmbeddingOptimizer("exact_rowwise_adagrad", "adagrad.RowWiseAdagrad", fbgemm="EXACT_ROWWISE_ADAGRAD",
                       fused_on_cpu=True, fused_weight_decay=True, state_per_weight=0, state_per_row=1,
                       row_coupled=True, fp16=True, aliases=("rowwise_adagrad",)),
    EmbeddingOptimizer("exact_adagrad", "adagrad.SparseAdagrad", fbgemm="EXACT_ADAGRAD", fused_on_cpu=True,
                       fused_weight_decay=False, state_per_weight=1, state_per_row=0, row_coupled=False, fp16=True,
                       aliases=("adagrad",)),
    EmbeddingOptimizer("exact_sgd", "adagrad.SparseSGD", fbgemm="EXACT_SGD", fused_on_cpu=True,
                       fused_weight_decay=False, state_per_weight=0, state_per_row=0, row_coupled=False, fp16=True,
                       uses_eps=False, aliases=("sgd",)),
    _adam("adam", "adam.EmbeddingAdam", rowwise_v=False, lighter="partial_rowwise_adam"),
    _adam("partial_rowwise_adam", "adam.PartialRowWiseAdam", rowwise_v=True),
    _adam("lamb", "adam.EmbeddingLamb", rowwise_v=False, lighter="partial_rowwise_lamb"),
    _adam("partial_rowwise_lamb", "adam.PartialRowWiseLamb", rowwise_v=True),
    EmbeddingOptimizer("rmsprop", "adagrad.RMSprop", fbgemm=None, fused_on_cpu=False, fused_weight_decay=False,
                       state_per_weight=1, state_per_row=0, row_coupled=False, sparse_grads=True, uses_betas=True),
)}

#: FBGEMM's Adam family (bias correction with the global step; CUDA TBE only)
ADAM_FAMILY: tuple[str, ...] = tuple(n for n, r in EMBEDDING_OPTIMIZERS.items() if r.global_step)

#: the embedding optimizers that train fp16 tables (``model.embedding_precision: fp16``)
FP16_EMBEDDING_OPTIMIZERS: tuple[str, ...] = tuple(n for n, r in EMBEDDING_OPTIMIZERS.items() if r.fp16)

#: every accepted spelling (names and aliases) -> the config name
OPTIMIZER_ALIASES: dict[str, str] = {a: r.name for r in EMBEDDING_OPTIMIZERS.values() for a in (r.name, *r.aliases)}


def find_embedding_optimizer(name: str) -> EmbeddingOptimizer | None:
    """The record of ``name`` (a config name or an alias), or ``None`` when none has it."""
    canonical = OPTIMIZER_ALIASES.get(name)
    return None if canonical is None else EMBEDDING_OPTIMIZERS[canonical]


def embedding_optimizer(name: str) -> EmbeddingOptimizer:
    """The record of ``name`` (a config name or an alias).

    Raises:
        ValueError: no such optimizer (the message lists the accepted names).
    """
    rec = find_embedding_optimizer(name)
    if rec is None:
        raise ValueError(f"unknown embedding optimizer {name!r}; expected {' | '.join(EMBEDDING_OPTIMIZERS)}")
    return rec


@dataclass(frozen=True)
class DenseOptimizer:
    """One optimizer of ``optimizer.dense`` (the MLPs): a ``torch.optim`` class.

    Attributes:
        name: the config name (``optimizer.dense.type``).
        torch_class: its class in ``torch.optim`` (built with ``lr``, ``weight_decay`` and
            ``foreach=True``, :func:`dlrmctl.optim.dense.dense_optimizer`).
        reads: the other ``optimizer.dense`` keys it takes, as its keyword arguments (``eps``,
            ``betas``, ``momentum``).
        state_per_param: fp32 state tensors of each parameter's shape it keeps (the planner's
            memory reservation for the dense part, :func:`dlrmctl.planner.storage.dense_model_bytes`).
    """

    name: str
    torch_class: str
    reads: tuple[str, ...]
    state_per_param: int


#: Every dense optimizer, by config name (``optimizer.dense.type``'s values, in this order).
DENSE_OPTIMIZERS: dict[str, DenseOptimizer] = {r.name: r for r in (
    DenseOptimizer("adagrad", "Adagrad", ("eps",), state_per_param=1),  # sum of squared gradients
    DenseOptimizer("adam", "Adam", ("eps", "betas"), state_per_param=2),  # exp_avg, exp_avg_sq
    DenseOptimizer("sgd", "SGD", ("momentum",), state_per_param=0),  # a momentum buffer only when momentum > 0
)}
