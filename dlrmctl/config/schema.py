"""The schema of the experiment YAML: one dataclass per section.

The checks of each section are :mod:`dlrmctl.config.validation`'s; reading files, ``--set``
overrides and the YAML-to-dataclass conversion are :mod:`dlrmctl.config.loading`'s; the tables a
config resolves to are :mod:`dlrmctl.config.tables`'.  Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional


class ConfigError(ValueError):
    """Invalid configuration; the message names the file and the key path."""


@dataclass
class TableConfig:
    """One embedding table (``model.tables[i]``).

    ``num_embeddings: null`` takes the cardinality from the data's meta.json;
    ``embedding_dim: null`` takes ``model.embedding_dim``; ``feature_names``
    defaults to ``[name]``.  A feature may be listed under several tables: it
    is read once and looked up in each (outputs ``feature@table``, TorchRec's naming).
    ``weighted: true``: each id of the table's features
    carries a weight (the data's ``<feature>__weight`` column) and pooling is
    ``sum_i w_i e_{id_i}`` (mean: divided by the bag length).  The model's
    EmbeddingBagCollection is then weighted (one flag for the collection, as in
    TorchRec) and the features of the other tables get weight 1.0 from the loader.
    A feature shared by several tables carries one weight per id, so those tables
    must agree on ``weighted``.
    """

    name: str
    num_embeddings: Optional[int] = None
    embedding_dim: Optional[int] = None
    feature_names: list[str] = field(default_factory=list)
    pooling: Literal["sum", "mean"] = "sum"
    weighted: bool = False


@dataclass
class DataConfig:
    """``data``: where the preprocessed columnar data lives and how it is batched.

    ``batch_size`` is the GLOBAL batch (split over ranks).  ``num_samples`` caps
    rows per epoch (null: all).  ``multi_hot_sizes`` (one int per sparse
    feature) expands 1-hot ids into MLPerf-DLRMv2-style multi-hot bags on the fly.
    ``drop_last`` drops the train split's final partial global batch each epoch
    (evaluation never drops rows).  ``shuffle`` reads the train split in a windowed
    block shuffle (:mod:`dlrmctl.data.loader`): blocks of ``shuffle_block_rows``
    contiguous rows in a random order per epoch, rows mixed inside consecutive windows
    of ``shuffle_window_rows`` rows; memory grows with the window, not the split
    (a window >= the split's rows is an exact full permutation, O(rows) memory).
    A ``--resume`` inside an epoch needs the saved ``batch_size``, ``drop_last``,
    ``num_samples``, ``shuffle``, seed and shuffle sizes (they fix which rows batch k holds);
    at an epoch boundary they may change.
    """

    path: str = "data/demo"
    train_split: str = "train"
    val_split: str = "val"
    batch_size: int = 1024
    eval_batch_size: int = 8192
    shuffle: bool = True
    shuffle_window_rows: int = 262_144
    shuffle_block_rows: int = 8_192
    drop_last: bool = False
    num_samples: Optional[int] = None
    prefetch: int = 2
    multi_hot_sizes: Optional[list[int]] = None
    multi_hot_distribution: Literal["uniform", "pareto"] = "uniform"


@dataclass
class ModelConfig:
    """``model``: DLRM architecture.

    ``tables`` empty -> one table per sparse feature of the data, named
    ``t_<feature>``, with ``embedding_dim`` columns and meta.json's cardinality.
    ``dense_arch_layer_sizes[-1]`` must equal the embedding dim for the dot
    interaction (DLRM, Naumov et al. 2019).  ``on_invalid_id``: what an id outside
    its table does on every path (``error``: EmbeddingIdError; ``zero``: the id is
    dropped from its bag, see :mod:`dlrmctl.sparse.validation`).
    ``embedding_precision``: storage of every table's weights (TorchRec's
    ``EmbeddingBagConfig.data_type``): ``fp16`` halves the table bytes (FBGEMM TBE
    ``weights_precision=SparseType.FP16``; the dense kernel stores fp16 and updates in
    fp32); pooled outputs, optimizer state and optimizer math stay fp32.  fp16 tables
    train with ``exact_rowwise_adagrad`` / ``exact_adagrad`` / ``exact_sgd`` (the optimizers
    FBGEMM's CPU TBE runs on fp16 weights).

    ``embedding_dim: auto`` sizes each table derived from the data by its rows ``n``
    (:func:`auto_embedding_dim`: ``k * n ** 0.25`` with ``k = embedding_dim_factor``, rounded up
    to a multiple of 4, capped at ``dense_arch_layer_sizes[-1]``); every interaction needs
    vectors of one width ``d = dense_arch_layer_sizes[-1]``, so a table narrower than ``d`` is
    followed by a learned linear projection to ``d`` (as in mixed-dimension embeddings,
    Ginart et al. 2021).  ``dropout``: probability of zeroing each hidden activation of the
    dense (bottom) and over (top) MLPs during training (after every ReLU that feeds
    another layer; none on the embeddings or the logit); evaluation and export run without it.
    ``first_order``: add a linear ("wide") term of the raw dense features and of every pooled
    embedding to the logit, ``w_dense^T x + sum_f w_f^T e_f``
    (:class:`~dlrmctl.modules.dlrm.FirstOrder`: the first-order part of FM / DeepFM / Wide &
    Deep, zero-initialised, trained by the dense optimizer).

    ``embedding_init_max``: every table starts as
    ``U(-a, a)`` with ``a = embedding_init_max``; null: the DLRM reference's ``a =
    sqrt(1 / num_embeddings)`` (dlrm_s_pytorch.py ``create_emb``).  A small ``a`` starts every id
    near zero, so an id seen a few times moves little from a neutral vector (as an L2-penalised
    per-id weight of a logistic regression does).  ``over_arch_bias_init``: ``random`` (the MLP
    init, ``N(0, 1)`` for the last layer) or ``ctr``: the over arch's output bias starts at
    ``logit(train CTR)`` from meta.json, so the first steps predict the base rate instead of
    fitting it (Karpathy, "A Recipe for Training Neural Networks", 2019: "init well").
    ``dense_standardize``: the dense features enter the model as ``(x - mean) / std`` with the
    train split's per-column mean and std (computed by the trainer from the train split's dense
    columns, at most ``columnar.DENSE_STATS_MAX_ROWS`` rows in evenly spaced blocks, float64;
    std 1 where a column is constant), held in the model
    (:class:`~dlrmctl.modules.dlrm.DenseStandardize`: checkpointed and exported with it), as the
    logistic-regression baseline's dense columns are.
    """

    arch: Literal["dlrm"] = "dlrm"
    embedding_dim: int | Literal["auto"] = 16
    embedding_dim_factor: float = 6.0
    dropout: float = 0.0
    first_order: bool = False
    embedding_init_max: Optional[float] = None
    over_arch_bias_init: Literal["random", "ctr"] = "random"
    dense_standardize: bool = False
    tables: list[TableConfig] = field(default_factory=list)
    dense_arch_layer_sizes: list[int] = field(default_factory=lambda: [512, 256, 64, 16])
    over_arch_layer_sizes: list[int] = field(default_factory=lambda: [512, 256, 1])
    interaction: Literal["dot", "dcn", "projection"] = "dot"
    dcn_num_layers: int = 3
    dcn_low_rank_dim: int = 512
    interaction_branch1_layer_sizes: list[int] = field(default_factory=lambda: [128, 128])
    interaction_branch2_layer_sizes: list[int] = field(default_factory=lambda: [128, 128])
    compute_kernel: Literal["fused", "dense"] = "fused"
    on_invalid_id: Literal["error", "zero"] = "error"
    embedding_precision: Literal["fp32", "fp16"] = "fp32"


@dataclass
class EmbeddingOptimizerConfig:
    """``optimizer.embedding``: fused into the TBE backward (FBGEMM names).

    State per table: row-wise Adagrad one float per row; Adagrad one per weight; SGD none;
    ``adam`` / ``lamb`` two per weight; ``partial_rowwise_adam`` / ``partial_rowwise_lamb``
    one per weight + one per row.  ``betas`` are the Adam family's (beta1, beta2);
    ``weight_decay`` is L2 added to the gradient for the Adagrads and SGD, FBGEMM's
    decoupled ``lr * weight_decay * w`` for the Adam family, on the rows in the batch
    only.  FBGEMM 1.8's CPU TBE implements only the Adagrads and SGD: on CPU the Adam
    family runs on the ``dense`` kernel with the same update rules
    (:mod:`dlrmctl.train.optim`).
    """

    type: Literal["exact_rowwise_adagrad", "exact_adagrad", "exact_sgd", "adam", "partial_rowwise_adam", "lamb",
                  "partial_rowwise_lamb"] = "exact_rowwise_adagrad"
    lr: float = 0.1
    eps: float = 1e-8
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])


@dataclass
class DenseOptimizerConfig:
    """``optimizer.dense``: a torch optimizer for the MLPs (and dense-kernel tables)."""

    type: Literal["adagrad", "adam", "sgd"] = "adagrad"
    lr: float = 0.1
    eps: float = 1e-8
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    momentum: float = 0.0
    weight_decay: float = 0.0


@dataclass
class LRScheduleConfig:
    """``optimizer.lr_schedule``: linear warmup then polynomial decay.

    As in the DLRM reference's ``LRPolicyScheduler`` (facebookresearch/dlrm,
    ``dlrm_s_pytorch.py``): for ``step < warmup_steps`` the factor is
    ``(step + 1) / warmup_steps`` (DLRM: ``1 - (warmup - step)/warmup``);
    between warmup and ``decay_start_step`` it is 1; from ``decay_start_step``
    for ``decay_steps`` steps it is ``((decay_steps - s) / decay_steps) ** decay_power``
    (s = steps since decay start), floored at ``end_lr_factor``.  ``decay_steps: 0``
    disables decay.  The factor multiplies both the dense and the embedding lr.

    Checked at load (errors name the key): steps >= 0, ``decay_power > 0``,
    ``0 <= end_lr_factor <= 1``, ``decay_start_step >= warmup_steps`` when decay is on
    ("warmup must finish before decay starts", as the reference), and no
    ``decay_start_step`` without ``decay_steps``.
    """

    warmup_steps: int = 0
    decay_start_step: int = 0
    decay_steps: int = 0
    decay_power: float = 2.0
    end_lr_factor: float = 0.0


@dataclass
class OptimizerConfig:
    """``optimizer``: ``embedding`` (fused), ``dense`` (MLPs) and the shared ``lr_schedule``."""

    embedding: EmbeddingOptimizerConfig = field(default_factory=EmbeddingOptimizerConfig)
    dense: DenseOptimizerConfig = field(default_factory=DenseOptimizerConfig)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)


@dataclass
class TrainConfig:
    """``train``: the loop.

    ``max_steps`` (null: no cap) stops early; ``eval_every`` / ``checkpoint_every``
    are in steps (0: only at the end of each epoch); ``log_every`` in steps.
    ``keep_best``: keep the checkpoint of the best validation ``auc`` (highest) or ``ne``
    (lowest) as ``checkpoints/BEST`` (saved when an evaluation improves on it, never pruned);
    ``none``: only the newest ``keep_last_checkpoints``.
    ``early_stopping_patience`` (0: off): stop training once this many evaluations in a row
    (``eval_every`` steps and epoch ends) have not improved on the best ``keep_best`` metric;
    the best checkpoint is kept, the run ends with a checkpoint of its last step.  Needs
    ``keep_best`` ``auc`` or ``ne``.
    ``progress``: rank 0 shows progress (a bar on a terminal; without one, a line every
    ``progress_every_s`` seconds with step, samples/s and the latest loss read).
    ``precision``: the dense arch, interaction and over arch run under ``torch.autocast``
    (``bf16``: CPU and CUDA; ``fp16``: CUDA only, with a ``torch.amp.GradScaler``); the
    loss, the metrics, the parameters and the optimizers stay fp32; embeddings follow
    ``model.embedding_precision``.
    ``cpu_linear`` (default ``aten``): the GEMM library of the MLPs' Linear layers and of DCN's
    cross net when training on the CPU in fp32: ``aten`` (``F.linear``: MKL's sgemm on x86 builds) or ``onednn``
    (oneDNN's fp32 GEMM with the bias and ReLU fused, :class:`dlrmctl.modules.dlrm._OneDNNLinear`:
    2.0-2.4x MKL's rate on this project's AMD CPU; fp32-accurate, not the same bits).  Evaluation,
    bf16 autocast, CUDA and the export always use ``F.linear``.
    ``malloc_tuning`` (default true): on Linux with glibc, freed tensors below 32 MiB are kept
    for reuse instead of being unmapped and page-faulted in again every step
    (:mod:`dlrmctl.train.malloc_tuning`; no effect with another C library).
    """

    epochs: int = 1
    max_steps: Optional[int] = None
    eval_every: int = 0
    checkpoint_every: int = 0
    keep_last_checkpoints: int = 2
    keep_best: Literal["auc", "ne", "none"] = "auc"
    log_every: int = 50
    early_stopping_patience: int = 0
    seed: int = 0
    run_dir: str = "runs"
    pipeline: Literal["none", "base", "sparse_dist"] = "sparse_dist"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    progress: bool = True
    progress_every_s: float = 10.0
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    malloc_tuning: bool = True
    cpu_linear: Literal["aten", "onednn"] = "aten"


@dataclass
class TableShardingConfig:
    """``sharding.tables.<name>``: a hand-given sharding for one table.

    ``ranks``: for table_wise one rank; for column kinds one per column shard;
    for row kinds the ranks sharing rows (default: all ranks, or one host for
    table_row_wise).  ``column_sizes``: widths of column shards.
    """

    sharding_type: Literal[
        "data_parallel", "table_wise", "row_wise", "table_row_wise", "column_wise", "table_column_wise"
    ] = "table_wise"
    compute_kernel: Literal["fused", "dense"] = "fused"
    ranks: Optional[list[int]] = None
    column_sizes: Optional[list[int]] = None


@dataclass
class TableConstraintsConfig:
    """``sharding.constraints.<table>``: what the planner may choose for a table."""

    sharding_types: Optional[list[str]] = None
    compute_kernels: Optional[list[str]] = None
    ranks: Optional[list[int]] = None
    min_column_shard_dim: Optional[int] = None


@dataclass
class ShardingConfig:
    """``sharding``: how tables are placed when training with several ranks.

    ``tables`` gives an explicit plan per table (tables not listed are planned
    by the planner); ``plan_file`` points at a plan written by ``dlrmctl plan``;
    ``local_world_size`` (null: all ranks on one host) lets one machine pretend
    to be several hosts (4 ranks = 2 hosts x 2) for table_row_wise /
    table_column_wise; ``constraints`` restrict the planner per table.
    ``topology_file`` (a file written by ``dlrmctl plan --calibrate``) replaces the
    ``device`` preset for the planner.  ``force: true`` runs the sharded path (DistributedModelParallel, every
    collective, the sparse_dist pipeline) even with ONE process, on a one-rank
    process group (gloo on CPU, nccl on CUDA): one GPU then exercises all the
    code a multi-GPU job uses.
    ``comm_precision``: the pooled embeddings' output_dist (forward all-to-all /
    reduce-scatter) and its gradient (backward) travel in this precision and are cast
    back to fp32 on arrival (TorchRec's qcomm codecs); ``fp32``: no cast.
    ``overlap_output_dist`` (default true): the pooled embeddings' all-to-all is launched
    asynchronously and waited on after the dense arch (TorchRec's ``LazyAwaitable``), so the
    bottom MLP's forward and backward run while it travels; bit-identical results either way.
    """

    plan_file: Optional[str] = None
    force: bool = False
    local_world_size: Optional[int] = None
    tables: dict[str, TableShardingConfig] = field(default_factory=dict)
    constraints: dict[str, TableConstraintsConfig] = field(default_factory=dict)
    device: str = "cpu"
    comm_precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    overlap_output_dist: bool = True
    hbm_gb: Optional[float] = None
    ddr_gb: Optional[float] = None
    topology_file: Optional[str] = None


@dataclass
class ExperimentConfig:
    """The whole YAML file."""

    name: str = "experiment"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
