"""The schema of the experiment YAML: one dataclass per section.

Each key is documented once, by the attribute docstring under its field (the string literal
right after it, :func:`field_docs`); each section's docstring holds what spans its keys.
``scripts/gen_config_docs.py`` generates the key reference of ``docs/configuration.md`` from
both.  In a docstring, ``docs/<page>.md#<anchor>`` becomes a link on that page.

The checks of each section are :mod:`dlrmctl.config.validation`'s; reading files, ``--set``
overrides and the YAML-to-dataclass conversion are :mod:`dlrmctl.config.loading`'s; the tables a
config resolves to are :mod:`dlrmctl.config.tables`'; the ``sharding`` section is
:mod:`dlrmctl.config.sharding_schema`'s (its classes re-exported here).  Nothing here imports torch.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from dataclasses import dataclass, field
from typing import Literal, Optional

from dlrmctl.config.sharding_schema import ShardingConfig, TableConstraintsConfig, TableShardingConfig
from dlrmctl.errors import UserError
from dlrmctl.optim.registry import DENSE_OPTIMIZERS, EMBEDDING_OPTIMIZERS

#: ``optimizer.embedding.type``'s values: the registry's names
EMBEDDING_OPTIMIZER_NAMES = tuple(EMBEDDING_OPTIMIZERS)
#: ``optimizer.dense.type``'s values: the registry's names
DENSE_OPTIMIZER_NAMES = tuple(DENSE_OPTIMIZERS)


class ConfigError(ValueError, UserError):
    """Invalid configuration; the message names the file and the key path."""


def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstring of each field of the dataclass ``cls`` (field name -> text,
    :func:`inspect.cleandoc`-ed); a field without one is absent.  Reads the class's source.

    Raises:
        OSError / TypeError: the source of ``cls`` cannot be found.
    """
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    fields = {f.name for f in dataclasses.fields(cls)}
    out = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in fields
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            out[node.target.id] = inspect.cleandoc(nxt.value.value)
    return out


@dataclass
class ManagedCollisionConfig:
    """A managed-collision table (``model.managed_collision``, ``model.tables[].managed_collision``):
    a table of ``size`` rows (plus one default row) and a remapper from raw 64-bit ids to rows,
    so no vocabulary pass is needed (:mod:`dlrmctl.modules.managed_collision`; see
    docs/training.md#ids-that-change-every-day)."""

    size: int = 0
    """Rows the ids can own, ``N``. An id the remapper holds keeps its row; a new id takes a free
    row or evicts the least valuable held id. Every distinct id of one batch must fit a bucket:
    ``size / buckets >= batch_size x features of the table x their max_pooling_factor``."""
    eviction: Literal["lfu", "lru"] = "lfu"
    """Which held id a new one evicts: ``lfu`` the least frequently seen (ties: least recently),
    ``lru`` the least recently seen. The evicted row's embedding and optimizer state are reset."""
    buckets: int = 1
    """The rows are split into this many equal blocks and an id takes rows of block
    ``id % buckets`` only; a divisor of ``size``."""


@dataclass
class TableConfig:
    """One embedding table (``model.tables[i]``).

    A feature may be listed under several tables: it is read once and looked up in each
    (outputs ``feature@table``, TorchRec's naming; see docs/modules.md#shared-features).
    """

    name: str
    """The table's name (unique in ``model.tables``; ``sharding.tables`` and
    ``sharding.constraints`` refer to it)."""
    num_embeddings: Optional[int] = None
    """Rows. null: from the data's meta.json, the largest cardinality among the table's features.
    A number below that cardinality is an error before training (naming the table, the feature and
    meta.json's size); with ``model.on_invalid_id: zero`` it is a warning and the larger ids pool to zero."""
    embedding_dim: Optional[int] = None
    """Columns. null: ``model.embedding_dim``."""
    feature_names: list[str] = field(default_factory=list)
    """The sparse features looked up in this table; ``[]``: ``[name]``."""
    pooling: Literal["sum", "mean"] = "sum"
    """How a bag's embeddings are pooled: ``sum`` or ``mean`` (divided by the bag length)."""
    weighted: bool = False
    """Each id of the table's features carries a weight (the data's ``<feature>__weight``
    column) and pooling is ``sum_i w_i e_{id_i}`` (mean: divided by the bag length). The
    model's EmbeddingBagCollection is then weighted (one flag for the collection, as in
    TorchRec) and the features of the other tables get weight 1.0 from the loader. A feature
    shared by several tables carries one weight per id, so those tables must agree on
    ``weighted``. See docs/modules.md#weighted-features."""
    managed_collision: Optional[ManagedCollisionConfig] = None
    """A managed-collision table over raw-id features (keys as ``model.managed_collision``);
    null: ``model.managed_collision`` when the table's features hold raw ids."""


@dataclass
class DataConfig:
    """``data``: where the preprocessed columnar data lives and how it is batched.

    A ``--resume`` inside an epoch needs the saved ``batch_size``, ``drop_last``,
    ``num_samples``, ``shuffle``, seed and shuffle sizes (they fix which rows batch k holds);
    at an epoch boundary they may change.
    """

    path: str = "data/demo"
    """Directory of the preprocessed data (``dlrmctl preprocess ... --out``): its splits and
    ``meta.json``. A relative path is relative to the working directory."""
    train_split: str = "train"
    """The split trained on."""
    val_split: str = "val"
    """The split evaluated on (``train.eval_every``, epoch ends, ``train.keep_best``)."""
    batch_size: int = 1024
    """The GLOBAL training batch in samples, split over ranks."""
    eval_batch_size: int = 8192
    """The GLOBAL evaluation batch in samples, split over ranks."""
    shuffle: bool = True
    """Read the train split in a per-epoch windowed block shuffle (:mod:`dlrmctl.data.loader`),
    seeded by ``train.seed`` and the epoch: blocks of ``shuffle_block_rows`` contiguous rows in
    a random order, rows mixed inside consecutive windows of ``shuffle_window_rows`` rows;
    memory grows with the window, not the split. false: the rows in file order. See
    docs/data.md#shuffling."""
    shuffle_window_rows: int = 262_144
    """Consecutive windows of this many rows of the block stream are each permuted. Memory per
    rank is about 8 bytes x window, one window of rows read, and this rank's rows of up to three
    windows (one is read ahead while batches are made). A value >= the split's rows is an exact
    full permutation (O(rows) memory). Integer >= 1."""
    shuffle_block_rows: int = 8_192
    """Rows of a shuffled block (contiguous rows inside one record batch, read with one
    ``pread`` per column). The block order is permuted per epoch (16 bytes per block).
    Integer >= 1."""
    drop_last: bool = False
    """Drop the train split's last partial global batch each epoch. Evaluation never drops rows."""
    num_samples: Optional[int] = None
    """Row cap per epoch; null: all rows."""
    prefetch: int = 2
    """Loader prefetch depth (>= 0): batches assembled ahead of the step."""
    workers: int | Literal["auto"] = "auto"
    """Processes per rank making batches (bit-identical to 0: a thread, starved by a GIL-holding GPU
    step); ``auto``: 0 on CPU, on CUDA the rank's CPUs less one, <= 4. docs/data.md#loader-workers."""
    multi_hot_sizes: Optional[list[int]] = None
    """One size per sparse feature of meta.json: the 1-hot ids are expanded into
    MLPerf-DLRMv2-style multi-hot bags of that many ids on the fly (also a planner input).
    null: the ids as stored."""
    multi_hot_distribution: Literal["uniform", "pareto"] = "uniform"
    """The random offsets of the multi-hot expansion (:func:`dlrmctl.data.multi_hot.multi_hot_expand`):
    ``uniform`` in ``[0, N)`` or ``pareto`` (MLPerf DLRMv2's two choices)."""


@dataclass
class ModelConfig:
    """``model``: DLRM architecture (Naumov et al. 2019).

    Every interaction stacks the dense arch's output and the pooled embeddings as vectors of one
    width ``d = dense_arch_layer_sizes[-1]``: each table is ``d`` wide, or (with
    ``embedding_dim: auto``) narrower and followed by a learned bias-free ``Linear(dim, d)``
    (mixed-dimension embeddings, Ginart et al., arXiv:1909.11810), so ``dot``, ``dcn`` and
    ``projection`` all work.  See docs/modules.md#interactions-and-model-options.
    """

    arch: Literal["dlrm"] = "dlrm"
    """The model family; only ``dlrm`` (with the interactions of ``interaction``)."""
    embedding_dim: int | Literal["auto"] = 16
    """The width of tables that do not give one. ``auto`` gives each table derived from the data
    ``min(d, 4 * ceil(k * n ** 0.25 / 4))`` columns for ``n`` rows (:func:`dlrmctl.config.auto_embedding_dim`),
    with ``k = embedding_dim_factor`` and ``d = dense_arch_layer_sizes[-1]``: the fourth-root
    rule of "Introducing TensorFlow Feature Columns" (Google Developers Blog, 2017, where
    ``k = 1``), rounded up to a multiple of 4. Not with ``tables``."""
    embedding_dim_factor: float = 6.0
    """``k`` of ``embedding_dim: auto`` (``6 * n ** 0.25`` is the rule's common variant); > 0."""
    dropout: float = 0.0
    """Probability of zeroing each hidden activation of the dense (bottom) and over (top) MLPs in
    training (after every ReLU that feeds another layer; not the embeddings, not the logit). Off
    in evaluation and export; parameter names do not change. Each rank draws the masks of its own
    rows, so a sharded run with dropout matches one process statistically, not bit for bit. In
    [0, 1)."""
    first_order: bool = False
    """Add a linear ("wide") term ``w_dense^T x + sum_f w_f^T e_f`` over the raw dense features
    and every pooled embedding to the logit (:class:`~dlrmctl.modules.dlrm.FirstOrder`): the
    linear part of FM (Rendle 2010), DeepFM (Guo et al. 2017) and Wide & Deep (Cheng et al.
    2016). The per-id scalar is read from the id's own row through one weight vector per
    feature. Zero-initialised, trained by the dense optimizer and exported."""
    embedding_init_max: Optional[float] = None
    """Every table starts ``U(-a, a)`` with ``a`` this value, in (0, 1] (the reference's default
    below is at most 1; larger bounds make the first dot interactions up to ``embedding_dim * a**2``
    and the model train to NaN). null: the DLRM reference's ``a = sqrt(1 / num_embeddings)`` per
    table (dlrm_s_pytorch.py ``create_emb``). A small ``a`` starts every id near zero, so an id
    seen a few times moves little from a neutral vector (as an L2-penalised per-id weight of a
    logistic regression does)."""
    over_arch_bias_init: Literal["random", "ctr"] = "random"
    """``random`` (the MLP init) or ``ctr``: the over arch's output bias starts at
    ``logit(train CTR)`` (meta.json ``ctr.train``), so step 0 predicts the base rate instead of
    fitting it (Karpathy, "A Recipe for Training Neural Networks", 2019: "init well"). ``ctr``
    is a TrainError when meta.json has no train CTR in (0, 1)."""
    dense_standardize: bool = False
    """The dense features enter the model (dense arch and ``first_order`` term) as
    ``(x - mean) / std`` with the train split's per-column statistics, computed when a run is
    built, in float64 with Chan et al.'s pairwise merge: the whole train split up to
    ``columnar.DENSE_STATS_MAX_ROWS`` (4,194,304) rows, above that as many rows in evenly spaced
    blocks; std is 1 for a constant column. Held in the model as buffers
    (:class:`~dlrmctl.modules.dlrm.DenseStandardize`), so checkpoints, ``evaluate`` and
    ``export`` carry them."""
    managed_collision: Optional[ManagedCollisionConfig] = None
    """The managed-collision table of every raw-id feature (meta.json ``"ids": "raw"``, e.g.
    ``preprocess criteo --raw-ids``) whose table gives none: ``{size: N, eviction: lfu | lru,
    buckets: 1}``. null: a raw-id feature is an error."""
    tables: list[TableConfig] = field(default_factory=list)
    """The embedding tables (``model.tables[]`` below). ``[]``: one table ``t_<feature>`` per
    sparse feature of meta.json, ``embedding_dim`` wide, with the feature's cardinality."""
    dense_arch_layer_sizes: list[int] = field(default_factory=lambda: [512, 256, 64, 16])
    """The bottom MLP over the dense features; the last size is the embedding width ``d`` every
    interaction needs."""
    over_arch_layer_sizes: list[int] = field(default_factory=lambda: [512, 256, 1])
    """The top MLP over the interaction's output; the last size is 1 (the logit)."""
    interaction: Literal["dot", "dcn", "projection"] = "dot"
    """``dot`` (DLRM's pairwise dot products), ``dcn`` (DCN-v2's low-rank cross net,
    ``dcn_num_layers`` x ``dcn_low_rank_dim``) or ``projection`` (two MLP branches,
    ``interaction_branch{1,2}_layer_sizes``)."""
    dcn_num_layers: int = 3
    """Cross layers of the ``dcn`` interaction."""
    dcn_low_rank_dim: int = 512
    """The rank of each ``dcn`` cross layer."""
    interaction_branch1_layer_sizes: list[int] = field(default_factory=lambda: [128, 128])
    """The first MLP branch of the ``projection`` interaction; the last size is a multiple of the
    embedding width."""
    interaction_branch2_layer_sizes: list[int] = field(default_factory=lambda: [128, 128])
    """The second MLP branch of the ``projection`` interaction; the last size is a multiple of
    the embedding width."""
    compute_kernel: Literal["fused", "dense"] = "fused"
    """``fused`` (FBGEMM TBE, the optimizer in the backward) or ``dense``
    (``nn.EmbeddingBag(sparse=True)`` and a torch optimizer); ``dense`` is the planner's only
    choice then."""
    on_invalid_id: Literal["error", "zero"] = "error"
    """What an id outside its table does on every path: ``error`` (EmbeddingIdError naming
    table, feature, id and range) or ``zero`` (the id is dropped from its bag, see
    :mod:`dlrmctl.sparse.validation`). See docs/modules.md#invalid-ids."""
    embedding_precision: Literal["fp32", "fp16"] = "fp32"
    """Storage of every table's weights (TorchRec's ``EmbeddingBagConfig.data_type``). ``fp16``
    halves the table bytes: FBGEMM TBE ``weights_precision=SparseType.FP16``; the ``dense``
    kernel stores fp16 and updates in fp32, rounding once per step. Pooled outputs, optimizer
    state and optimizer math stay fp32. fp16 needs ``exact_rowwise_adagrad``, ``exact_adagrad``
    or ``exact_sgd`` (what FBGEMM's CPU TBE runs on fp16 weights). The planner counts 2 bytes a
    weight. Checkpoints resume across precisions (cast on load); export and evaluation start
    from the fp32 view."""


@dataclass
class EmbeddingOptimizerConfig:
    """``optimizer.embedding``: fused into the TBE backward (FBGEMM names).

    State per table: row-wise Adagrad one float per row; Adagrad one per weight; SGD none;
    ``adam`` / ``lamb`` two per weight; ``partial_rowwise_adam`` / ``partial_rowwise_lamb``
    one per weight + one per row.  FBGEMM 1.8's CPU TBE implements only the Adagrads and SGD:
    on CPU the Adam family runs on the ``dense`` kernel with the same update rules
    (:mod:`dlrmctl.optim`).  See docs/configuration.md#embedding-optimizers.
    """

    type: Literal[EMBEDDING_OPTIMIZER_NAMES] = "exact_rowwise_adagrad"
    """The update rule, by FBGEMM's name (a record of :mod:`dlrmctl.optim.registry`); the same on
    both compute kernels. `exact_rowwise_adagrad`, the default, is the fastest (one fp32 of state
    per row). FBGEMM marks its fused CUDA Adam / LAMB kernels experimental: a `fused` table on
    CUDA with one of them says so in a warning when it is built."""
    lr: float = 0.1
    """Learning rate (>= 0), times the ``lr_schedule`` factor."""
    eps: float = 1e-8
    """Added to the denominator of the Adagrad / Adam updates (> 0: ``eps`` 0 gives 0/0 = NaN
    for a zero gradient)."""
    weight_decay: float = 0.0
    """L2 added to the gradient for the Adagrads and SGD, FBGEMM's decoupled
    ``lr * weight_decay * w`` for the Adam family, inside the trust-ratio update for LAMB; on the
    rows in the batch only. >= 0."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """The Adam family's (beta1, beta2), each in [0, 1)."""


@dataclass
class DenseOptimizerConfig:
    """``optimizer.dense``: a torch optimizer for the MLPs (and dense-kernel tables).

    Always torch's multi-tensor (``foreach``) form, also on the CPU where torch would default
    to its per-parameter loop (bit-identical updates).
    """

    type: Literal[DENSE_OPTIMIZER_NAMES] = "adagrad"
    """``adagrad``, ``adam`` (with ``betas``) or ``sgd`` (with ``momentum``)."""
    lr: float = 0.1
    """Learning rate (>= 0), times the ``lr_schedule`` factor."""
    eps: float = 1e-8
    """Added to the denominator of the Adagrad / Adam updates; > 0."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """``adam``'s (beta1, beta2), each in [0, 1)."""
    momentum: float = 0.0
    """``sgd``'s momentum, in [0, 1]."""
    weight_decay: float = 0.0
    """torch's ``weight_decay`` (L2 added to the gradient); >= 0."""


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
    """Steps of the linear warmup; 0: none."""
    decay_start_step: int = 0
    """The step the decay starts at (>= ``warmup_steps``); needs ``decay_steps``."""
    decay_steps: int = 0
    """Steps of the decay; 0: no decay."""
    decay_power: float = 2.0
    """The exponent of the decay; finite and > 0."""
    end_lr_factor: float = 0.0
    """The factor's floor during and after the decay, in [0, 1]."""


@dataclass
class OptimizerConfig:
    """``optimizer``: ``embedding`` (fused), ``dense`` (MLPs) and the shared ``lr_schedule``."""

    embedding: EmbeddingOptimizerConfig = field(default_factory=EmbeddingOptimizerConfig)
    """The tables' optimizer."""
    dense: DenseOptimizerConfig = field(default_factory=DenseOptimizerConfig)
    """The MLPs' optimizer."""
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    """The learning-rate factor of both."""


@dataclass
class TrainConfig:
    """``train``: the loop.

    Steps count global batches.  The run directory is ``run_dir/<name>``.
    """

    epochs: int = 1
    """Passes over the train split (an upper bound with ``max_steps`` or early stopping)."""
    max_steps: Optional[int] = None
    """Stop after this many steps; null: no cap."""
    eval_every: int = 0
    """Evaluate on ``data.val_split`` every this many steps; 0: only at the end of each epoch."""
    checkpoint_every: int = 0
    """Checkpoint every this many steps; 0: only at the end of each epoch."""
    keep_last_checkpoints: int = 2
    """The newest checkpoints kept; the best one is kept besides."""
    keep_best: Literal["auc", "ne", "none"] = "auc"
    """Keep the checkpoint of the best validation ``auc`` (highest) or ``ne`` (lowest) as
    ``checkpoints/BEST`` (saved when an evaluation improves on it, never pruned); ``none``:
    only the newest ``keep_last_checkpoints``. See docs/checkpoints.md#best-checkpoint."""
    log_every: int = 50
    """metrics.jsonl cadence in steps (0: only at the end of each epoch). The loss is read from
    the device only then (see docs/distributed.md#host-sync-budget), so progress shows the
    latest loss read and its step."""
    early_stopping_patience: int = 0
    """Stop once this many evaluations in a row (``eval_every`` steps and epoch ends) have not
    improved on the best ``keep_best`` metric; 0: off. The best checkpoint stays ``BEST``, the
    last step is checkpointed and ``summary.json`` says ``early_stopped``; ``--resume`` of a
    stopped run trains no further. Needs ``keep_best`` ``auc`` or ``ne``."""
    seed: int = 0
    """Seeds the initialisation (MLPs via ``torch.manual_seed``, tables per row), the shuffle
    (with the epoch) and the multi-hot offsets."""
    run_dir: str = "runs"
    """Parent of the run directory ``run_dir/<name>`` (relative: to the working directory)."""
    pipeline: Literal["none", "base", "sparse_dist"] = "sparse_dist"
    """``none`` (load, copy, step), ``base`` (the next batch's host-to-device copy overlaps the
    step) or ``sparse_dist`` (also the next batch's id all-to-all; ``base`` without a sharded
    model). Bit-identical losses. See docs/distributed.md#stream-ordering."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``cuda`` (an error without a GPU), ``cpu``, or ``auto``: CUDA when torch sees a GPU."""
    tf32: bool = True
    """Training on CUDA: fp32 GEMMs (the MLPs, DCN's cross net) and cuDNN run on TF32 tensor cores
    (``torch.set_float32_matmul_precision("high")``, ``torch.backends.cudnn.allow_tf32``); false:
    plain fp32 (``"highest"``). The evaluation during training, ``dlrmctl evaluate`` and the export
    run at full fp32 either way; ignored on the CPU. See docs/training.md#tf32-on-cuda."""
    progress: bool = True
    """Rank 0 shows progress: a tqdm bar on a terminal; without one, a line every
    ``progress_every_s`` seconds with step, samples/s and the latest loss read."""
    progress_every_s: float = 10.0
    """Seconds between progress lines without a terminal; 0: only at the end."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """The dense arch, interaction and over arch run under ``torch.autocast`` (``bf16``: CPU and
    CUDA; ``fp16``: CUDA only, with a ``torch.amp.GradScaler``); the loss, the metrics, the
    parameters and the optimizers stay fp32; embeddings follow ``model.embedding_precision``.
    See docs/training.md#precision."""
    malloc_tuning: bool = True
    """On Linux with glibc, ``mallopt`` ``M_MMAP_THRESHOLD`` 32 MiB and ``M_TRIM_THRESHOLD`` 1 GiB
    for the training process (:mod:`dlrmctl.train.malloc_tuning`): freed step tensors are reused
    instead of being unmapped and page-faulted in again every step (bench model: about 3,000
    minor faults per step -> 140). The resident set stays at the peak step working set instead
    of shrinking between steps. No effect with another C library."""
    cpu_linear: Literal["auto", "aten", "onednn"] = "auto"
    """The GEMM library of the MLPs' Linear layers and of DCN's cross net when training on the
    CPU in fp32: ``aten`` (``F.linear``: MKL's sgemm on x86 builds), ``onednn`` (oneDNN's fp32
    GEMM with the bias fused, :class:`dlrmctl.modules.mlp.OneDNNLinear`: 2.0-2.4x
    MKL's rate on an AMD EPYC, the same rate on an Intel Xeon; fp32-accurate, not the same bits)
    or ``auto``: ``onednn`` on x86 CPUs other than Intel's, ``aten`` on Intel's and elsewhere
    (by the CPU's vendor, never a timing: :func:`dlrmctl.modules.mlp.resolve_cpu_linear`;
    the environment variable ``DLRMCTL_CPU_LINEAR=aten|onednn`` decides ``auto`` instead).
    Evaluation, bf16 autocast, CUDA and the export always use ``F.linear``. See
    docs/training.md#the-cpu-gemm-library-traincpu_linear."""
    tensorboard: bool | Literal["auto"] = "auto"
    """Rank 0 also writes every metrics.jsonl record as TensorBoard scalars under
    ``<run_dir>/tensorboard`` (``train/<key>``, ``eval_<split>/<key>`` by step): ``auto`` when the
    ``tensorboard`` package is installed, ``true`` always (a run without the package is refused
    before it starts), ``false`` never."""


@dataclass
class ExperimentConfig:
    """The whole YAML file."""

    name: str = "experiment"
    """The experiment's name: one directory name, the run directory is ``train.run_dir/<name>``."""
    data: DataConfig = field(default_factory=DataConfig)
    """The data and its batching."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The optimizers and the learning-rate schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The training loop."""
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    """The placement of the tables over ranks."""
