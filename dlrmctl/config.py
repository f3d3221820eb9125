"""Experiment configuration: one YAML per experiment mapped onto typed dataclasses.

Loading is strict (in the spirit of nanoGPT / torchtune overrides): an unknown
key, a missing required key or a value of the wrong type is a
:class:`ConfigError` naming the full key path, e.g.
``configs/x.yaml: model.tables[3].embedding_dim: expected int, got 'abc'``.
``--set a.b=value`` overrides are parsed as YAML scalars and type-checked the
same way.

Top-level sections: ``name``, ``data``, ``model``, ``optimizer``, ``train``,
``sharding``.  See ``README.md`` ("Configuration") for every key.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import yaml

from dlrmctl.errors import UserError


class ConfigError(ValueError, UserError):
    """Invalid configuration; the message names the file and the key path."""


# --------------------------------------------------------------------- schema
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


# ------------------------------------------------------------------ conversion
_MISSING = object()


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    if origin is dict:
        return f"mapping of {_type_name(typing.get_args(tp)[1])}"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Convert a YAML value to ``tp``, raising ConfigError naming ``path``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, path)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{path}: expected one of {list(allowed)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")
        (et,) = typing.get_args(tp)
        return [_convert(v, et, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")
        _, vt = typing.get_args(tp)
        return {str(k): _convert(v, vt, f"{path}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return _build_dataclass(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected bool (true/false), got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected int, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            # YAML 1.1 reads "1e-8" as a string; accept numeric strings for floats.
            if isinstance(value, str):
                try:
                    return float(value)
                except ValueError:
                    pass
            raise ConfigError(f"{path}: expected float, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected str, got {value!r}")
        return value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(f"{path}: expected one of {[e.value for e in tp]}, got {value!r}") from None
    raise ConfigError(f"{path}: unsupported type {tp}")  # pragma: no cover


def _build_dataclass(cls: Any, value: Any, path: str) -> Any:
    where = path or "<root>"
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping, got {value!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in value if k not in fields]
    if unknown:
        k = unknown[0]
        raise ConfigError(
            f"{path + '.' if path else ''}{k}: unknown key; expected one of {sorted(fields)}"
        )
    kwargs = {}
    for name, f in fields.items():
        p = f"{path}.{name}" if path else name
        if name in value:
            kwargs[name] = _convert(value[name], hints[name], p)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:  # type: ignore[misc]
            raise ConfigError(f"{p}: required key is missing")
    return cls(**kwargs)


def to_dict(cfg: Any) -> Any:
    """Dataclass tree -> plain dicts/lists (for YAML dumps of the resolved config)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, list):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, enum.Enum):
        return cfg.value
    return cfg


_PATH_TOKEN = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def _split_path(key: str) -> list[str | int]:
    parts: list[str | int] = []
    pos = 0
    for m in _PATH_TOKEN.finditer(key):
        parts.append(m.group(1) if m.group(1) is not None else int(m.group(2)))
        pos = m.end()
    if not parts or pos != len(key.rstrip(".")):
        raise ConfigError(f"--set {key}: cannot parse key path")
    return parts


def apply_override(raw: dict, assignment: str) -> str:
    """Apply one ``a.b[2].c=value`` override to the raw YAML dict in place; returns the key
    path as written (``a.b[2].c``).

    The value is parsed as YAML (``32`` -> int, ``[1, 2]`` -> list,
    ``true`` -> bool).  Type checking happens when the dataclasses are built.

    Raises:
        ConfigError: no ``=``, bad path, or a list index out of range.
    """
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, e.g. model.embedding_dim=32")
    key, _, text = assignment.partition("=")
    key = key.strip()
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {key}: cannot parse value {text!r}: {e}") from e
    parts = _split_path(key)
    node: Any = raw
    for i, p in enumerate(parts[:-1]):
        nxt = parts[i + 1]
        if isinstance(p, int):
            if not isinstance(node, list) or p >= len(node):
                raise ConfigError(f"--set {key}: index [{p}] out of range")
            node = node[p]
        else:
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: '{p}' is not inside a mapping")
            if p not in node or node[p] is None:
                node[p] = [] if isinstance(nxt, int) else {}
            node = node[p]
    last = parts[-1]
    if isinstance(last, int):
        if not isinstance(node, list) or last >= len(node):
            raise ConfigError(f"--set {key}: index [{last}] out of range")
        node[last] = value
    else:
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: '{last}' is not inside a mapping")
        node[last] = value
    return key


def config_from_dict(raw: dict, overrides: list[str] | None = None, source: str = "<dict>") -> ExperimentConfig:
    """Build and validate an :class:`ExperimentConfig` from a raw mapping.

    Raises:
        ConfigError: with ``source: key.path: problem`` (``source with --set KEY=VALUE: ...`` when
            the bad value came from an override).
    """
    raw = copy.deepcopy(raw) if raw is not None else {}
    keys = []  # (key path, the --set as given)
    for ov in overrides or []:
        try:
            keys.append((apply_override(raw, ov), ov))
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
    try:
        cfg = _build_dataclass(ExperimentConfig, raw, "")
        validate(cfg)
    except ConfigError as e:
        msg = str(e)
        # name the --set that gave the bad value (the file may not even have the key)
        given = [ov for key, ov in keys if msg.startswith(tuple(key + c for c in ":.["))]
        where = f"{source} with --set {given[-1]}" if given else source
        raise ConfigError(f"{where}: {msg}") from None
    return cfg


def load_config(path: str | os.PathLike, overrides: list[str] | None = None) -> ExperimentConfig:
    """Read a YAML experiment file, apply ``--set`` overrides, validate.

    Relative ``data.path`` / ``train.run_dir`` / ``sharding.plan_file`` are
    kept as written (relative to the working directory, like the CLI's paths).

    Raises:
        ConfigError: unreadable file, invalid YAML (with line), unknown key,
            wrong type, or inconsistent values.
    """
    from dlrmctl.yaml_file import read_yaml

    path = os.fspath(path)
    raw = read_yaml(path, ConfigError, "config")
    if raw is None:  # an empty file (or comments only) is a mistake, not "all defaults"
        raise ConfigError(f"{path}: empty config file (write `{{}}` for all defaults; see configs/demo.yaml)")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level of the config, got {type(raw).__name__}")
    return config_from_dict(raw, overrides, source=path)


def validate(cfg: ExperimentConfig) -> None:
    """Cross-field checks that types alone cannot express.

    Raises:
        ConfigError: naming the key path.
    """
    def pos(v: Any, p: str, allow_zero: bool = False) -> None:
        if v is not None and (v < 0 or (v == 0 and not allow_zero)):
            raise ConfigError(f"{p}: must be {'>= 0' if allow_zero else '> 0'}, got {v}")

    if not cfg.name or cfg.name in (".", "..") or "/" in cfg.name or "\\" in cfg.name or "\0" in cfg.name:
        raise ConfigError(f"name: must be one directory name (the run is train.run_dir/<name>), got {cfg.name!r}")
    pos(cfg.data.batch_size, "data.batch_size")
    pos(cfg.data.eval_batch_size, "data.eval_batch_size")
    pos(cfg.data.num_samples, "data.num_samples")
    for key in ("shuffle_window_rows", "shuffle_block_rows"):  # ints already (config_from_dict's type check)
        if getattr(cfg.data, key) < 1:
            raise ConfigError(f"data.{key}: must be an integer >= 1 (rows), got {getattr(cfg.data, key)!r}")
    if cfg.model.embedding_dim != "auto":
        pos(cfg.model.embedding_dim, "model.embedding_dim")
    if not (math.isfinite(cfg.model.embedding_dim_factor) and cfg.model.embedding_dim_factor > 0):
        raise ConfigError(f"model.embedding_dim_factor: must be a finite number > 0, got {cfg.model.embedding_dim_factor}")
    if not 0.0 <= cfg.model.dropout < 1.0:
        raise ConfigError(f"model.dropout: must be in [0, 1) (the probability of zeroing an activation), "
                          f"got {cfg.model.dropout}")
    a = cfg.model.embedding_init_max
    if a is not None and (isinstance(a, bool) or not isinstance(a, (int, float)) or not (math.isfinite(a) and a > 0)):
        raise ConfigError(f"model.embedding_init_max: must be a finite number > 0 (tables start U(-a, a)) or null "
                          f"(sqrt(1 / num_embeddings)), got {a!r}")
    # the bound must be a finite value of the tables' storage type (fp32 draws; fp16 stores)
    top = 65504.0 if cfg.model.embedding_precision == "fp16" else 3.4028234663852886e38
    if a is not None and a > top:
        raise ConfigError(f"model.embedding_init_max: {a!r} exceeds the largest finite "
                          f"{cfg.model.embedding_precision} value ({top:g}) of model.embedding_precision "
                          f"{cfg.model.embedding_precision}: the tables would start with inf")
    pos(cfg.train.early_stopping_patience, "train.early_stopping_patience", allow_zero=True)
    if cfg.train.early_stopping_patience and cfg.train.keep_best == "none":
        raise ConfigError("train.early_stopping_patience: stops on the keep_best metric, but train.keep_best is "
                          "'none'; set train.keep_best to auc or ne")
    pos(cfg.train.epochs, "train.epochs")
    pos(cfg.train.max_steps, "train.max_steps")
    pos(cfg.train.eval_every, "train.eval_every", allow_zero=True)
    pos(cfg.train.checkpoint_every, "train.checkpoint_every", allow_zero=True)
    pos(cfg.train.keep_last_checkpoints, "train.keep_last_checkpoints")
    pos(cfg.train.progress_every_s, "train.progress_every_s", allow_zero=True)
    for o, name in ((cfg.optimizer.embedding, "embedding"), (cfg.optimizer.dense, "dense")):
        for key in ("lr", "eps", "weight_decay"):
            v = getattr(o, key)
            if not math.isfinite(v):
                raise ConfigError(f"optimizer.{name}.{key}: must be a finite number, got {v}")
        pos(o.lr, f"optimizer.{name}.lr", allow_zero=True)
        pos(o.weight_decay, f"optimizer.{name}.weight_decay", allow_zero=True)
        # Adagrad-type updates divide by sqrt(G) + eps: eps 0 gives 0/0 = NaN for a zero gradient
        pos(o.eps, f"optimizer.{name}.eps")
    for i, n in enumerate(cfg.model.dense_arch_layer_sizes):
        pos(n, f"model.dense_arch_layer_sizes[{i}]")
    for i, n in enumerate(cfg.model.over_arch_layer_sizes):
        pos(n, f"model.over_arch_layer_sizes[{i}]")
    if not cfg.model.over_arch_layer_sizes or cfg.model.over_arch_layer_sizes[-1] != 1:
        raise ConfigError("model.over_arch_layer_sizes: the last layer must have size 1 (one logit)")
    if not cfg.model.dense_arch_layer_sizes:
        raise ConfigError("model.dense_arch_layer_sizes: needs at least one layer")
    if len(cfg.optimizer.dense.betas) != 2:
        raise ConfigError(f"optimizer.dense.betas: expected two floats, got {cfg.optimizer.dense.betas}")
    _validate_lr_schedule(cfg.optimizer.lr_schedule, "optimizer.lr_schedule")
    eb = cfg.optimizer.embedding.betas
    if len(eb) != 2 or not all(0.0 <= b < 1.0 for b in eb):
        raise ConfigError(f"optimizer.embedding.betas: expected two floats in [0, 1), got {eb}")
    names = set()
    feature_weighted: dict[str, tuple[bool, str]] = {}
    for i, t in enumerate(cfg.model.tables):
        p = f"model.tables[{i}]"
        if t.name in names:
            raise ConfigError(f"{p}.name: duplicate table name '{t.name}'")
        names.add(t.name)
        twice = sorted({f for f in t.feature_names if t.feature_names.count(f) > 1})
        if twice:
            raise ConfigError(f"{p}.feature_names: {twice} listed more than once in table '{t.name}'")
        pos(t.num_embeddings, f"{p}.num_embeddings")
        pos(t.embedding_dim, f"{p}.embedding_dim")
        for f in t.feature_names or [t.name]:
            other = feature_weighted.setdefault(f, (t.weighted, t.name))
            if other[0] != t.weighted:
                raise ConfigError(
                    f"{p}.weighted: feature '{f}' feeds the weighted and the unweighted tables "
                    f"{sorted([t.name, other[1]])}; one feature's ids carry one weight each, so set the same "
                    "`weighted` on both tables"
                )
    # every interaction stacks [dense, e_1..e_F] as F+1 vectors of one width d
    it = cfg.model.interaction
    if cfg.model.embedding_dim == "auto":
        if cfg.model.tables:
            raise ConfigError("model.embedding_dim: auto sizes the tables derived from the data; with model.tables "
                              "give each table's embedding_dim instead")
        dims = {cfg.model.dense_arch_layer_sizes[-1]}  # narrower tables are projected to d
    else:
        dims = {t.embedding_dim or cfg.model.embedding_dim for t in cfg.model.tables} or {cfg.model.embedding_dim}
    if len(dims) != 1:
        raise ConfigError(f"model.tables: the {it} interaction needs one embedding dim for all tables, got {sorted(dims)}")
    (d,) = dims
    if cfg.model.dense_arch_layer_sizes[-1] != d:
        raise ConfigError(
            f"model.dense_arch_layer_sizes: the last layer ({cfg.model.dense_arch_layer_sizes[-1]}) must equal "
            f"the embedding dim ({d}) for the {it} interaction"
        )
    if it == "projection":
        for key in ("interaction_branch1_layer_sizes", "interaction_branch2_layer_sizes"):
            sizes = getattr(cfg.model, key)
            if not sizes or sizes[-1] % d:
                raise ConfigError(f"model.{key}: the last layer must be a multiple of the embedding dim {d}, got {sizes}")
    if it == "dcn":
        pos(cfg.model.dcn_num_layers, "model.dcn_num_layers")
        pos(cfg.model.dcn_low_rank_dim, "model.dcn_low_rank_dim")
    for tname, ts in cfg.sharding.tables.items():
        p = f"sharding.tables.{tname}"
        if ts.column_sizes is not None and (not ts.column_sizes or any(c < 1 for c in ts.column_sizes)):
            raise ConfigError(f"{p}.column_sizes: every column shard needs a width >= 1, got {ts.column_sizes}")
        if ts.ranks is not None and any(r < 0 for r in ts.ranks):
            raise ConfigError(f"{p}.ranks: ranks are >= 0, got {ts.ranks}")
    if cfg.model.tables:
        for tname in cfg.sharding.tables:
            if tname not in names:
                raise ConfigError(f"sharding.tables.{tname}: no such table in model.tables ({sorted(names)})")
    if cfg.train.precision == "fp16" and cfg.train.device == "cpu":
        raise ConfigError("train.precision: fp16 autocast needs CUDA (a GradScaler on a GPU); on the CPU use bf16")
    if cfg.model.embedding_precision == "fp16" and cfg.optimizer.embedding.type not in (
            "exact_rowwise_adagrad", "exact_adagrad", "exact_sgd"):
        raise ConfigError(
            f"model.embedding_precision: fp16 tables train with exact_rowwise_adagrad, exact_adagrad or exact_sgd "
            f"(what FBGEMM's TBE runs on fp16 weights), not optimizer.embedding.type {cfg.optimizer.embedding.type!r}"
        )
    if cfg.data.multi_hot_sizes is not None and any(s <= 0 for s in cfg.data.multi_hot_sizes):
        raise ConfigError(f"data.multi_hot_sizes: every size must be > 0, got {cfg.data.multi_hot_sizes}")


def _validate_lr_schedule(s: LRScheduleConfig, p: str) -> None:
    """What the DLRM reference's ``LRPolicyScheduler`` refuses, plus the values its formula
    cannot take (see :class:`LRScheduleConfig`).

    Raises:
        ConfigError: naming the key: a negative step count; ``decay_power`` not > 0;
            ``end_lr_factor`` outside [0, 1]; decay starting before warmup ends
            ("warmup must finish before decay starts", the reference's rule: the factor
            would jump from 1 to the middle of the decay curve); ``decay_start_step`` set
            while ``decay_steps`` is 0 (decay disabled: the start would be ignored).
    """
    for key in ("warmup_steps", "decay_start_step", "decay_steps"):
        v = getattr(s, key)
        if v < 0:
            raise ConfigError(f"{p}.{key}: must be >= 0, got {v}")
    if not s.decay_power > 0 or s.decay_power == float("inf"):
        raise ConfigError(f"{p}.decay_power: must be a finite number > 0 (the exponent of the decay), got {s.decay_power}")
    if not 0 <= s.end_lr_factor <= 1:
        raise ConfigError(f"{p}.end_lr_factor: must be in [0, 1] (the final fraction of the base lr), got {s.end_lr_factor}")
    if (s.decay_steps > 0 or s.decay_start_step > 0) and s.decay_start_step < s.warmup_steps:
        raise ConfigError(
            f"{p}.decay_start_step: warmup must finish before decay starts: decay_start_step "
            f"{s.decay_start_step} < warmup_steps {s.warmup_steps}"
        )
    if s.decay_steps == 0 and s.decay_start_step > 0:
        raise ConfigError(
            f"{p}.decay_start_step: {s.decay_start_step} but decay_steps is 0 (no decay); "
            "set decay_steps > 0 or remove decay_start_step"
        )


def weighted_features(cfg: ExperimentConfig) -> list[str]:
    """Features of the ``weighted: true`` tables of ``model.tables``, in table order (empty:
    the model is unweighted; tables derived from the data are never weighted)."""
    out: list[str] = []
    for t in cfg.model.tables:
        if t.weighted:
            out.extend(f for f in t.feature_names or [t.name] if f not in out)
    return out


def read_data_meta(cfg: ExperimentConfig) -> dict | None:
    """The preprocessed data's ``meta.json`` at ``data.path``, or None if there is none.

    Raises:
        ConfigError: meta.json exists but is not valid JSON.
    """
    import json

    p = os.path.join(cfg.data.path, "meta.json")
    if not os.path.exists(p):
        return None
    try:
        with open(p) as f:
            text = f.read()
        if not text.strip():
            raise ConfigError(f"{p}: empty file; re-run `dlrmctl preprocess ... --out {cfg.data.path}`")
        return json.loads(text)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{p}: cannot read data meta: {e}") from e


def auto_embedding_dim(num_embeddings: int, factor: float, max_dim: int) -> int:
    """``model.embedding_dim: auto``: the width of a table of ``num_embeddings`` rows.

    ``min(max_dim, 4 * ceil(factor * num_embeddings ** 0.25 / 4))``: the fourth-root rule of
    thumb for embedding widths (Google's TensorFlow feature-column guidance, "Introducing
    TensorFlow Feature Columns", Google Developers Blog, Nov 2017: ``embedding_dimensions =
    number_of_categories ** 0.25``, i.e. ``factor`` 1; the default ``factor`` 6 is the widely
    quoted ``6 * n ** 0.25`` variant, a tunable constant), rounded up to a multiple of 4 (FBGEMM's
    int8 TBE needs it for ``dlrmctl export --int8``) and capped at ``max_dim``
    (``dense_arch_layer_sizes[-1]``, the width every table is projected to).  Mixed-dimension
    embeddings (Ginart et al., "Mixed Dimension Embeddings with Application to Memory-Efficient
    Recommendation Systems", ISIT 2021, arXiv:1909.11810) motivate smaller widths for rarer /
    smaller features with a projection to a common width.

    Examples (factor 6): 5 rows -> 12, 100 -> 20, 685 -> 32, 10**6 -> 192 (before the cap).

    Raises:
        ConfigError: ``num_embeddings`` < 1, ``factor`` <= 0 or ``max_dim`` < 1.
    """
    if num_embeddings < 1 or not factor > 0 or max_dim < 1:
        raise ConfigError(f"model.embedding_dim auto: needs num_embeddings >= 1, embedding_dim_factor > 0 and "
                          f"dense_arch_layer_sizes[-1] >= 1, got {num_embeddings}, {factor}, {max_dim}")
    return int(min(max_dim, 4 * math.ceil(factor * num_embeddings ** 0.25 / 4)))


def resolve_tables(cfg: ExperimentConfig, meta: dict | None = None) -> list:
    """Turn ``model.tables`` (+ the data's meta.json) into EmbeddingBagConfigs.

    * ``model.tables`` empty: one table ``t_<feature>`` per sparse feature of
      meta.json, ``model.embedding_dim`` wide, rows = the feature's ``num_embeddings``.
    * a table with ``num_embeddings: null``: the largest cardinality among its
      features in meta.json.
    * every table's ``data_type`` is ``model.embedding_precision`` (FP32 / FP16), its init
      bounds ``+-model.embedding_init_max`` when set (else the EBC's ``+-sqrt(1 / rows)``).

    Args:
        meta: parsed meta.json (``sparse_features: [{name, num_embeddings, ...}]``).

    Returns:
        list of :class:`dlrmctl.modules.embedding_configs.EmbeddingBagConfig`.

    Raises:
        ConfigError: tables must come from data but there is no meta.json, or a
            feature/table cannot be sized.
    """
    from dlrmctl.modules.embedding_configs import DataType, EmbeddingBagConfig

    data_type = DataType.FP16 if cfg.model.embedding_precision == "fp16" else DataType.FP32
    a = cfg.model.embedding_init_max  # None: each table's sqrt(1 / num_embeddings)
    init = {} if a is None else {"weight_init_min": -float(a), "weight_init_max": float(a)}
    feats = {f["name"]: f for f in (meta or {}).get("sparse_features", [])}
    out = []
    if not cfg.model.tables:
        if meta is None:
            raise ConfigError(
                f"model.tables is empty, so tables are derived from the data, but {cfg.data.path}/meta.json "
                "does not exist: run `dlrmctl preprocess` first or list model.tables"
            )
        for f in meta["sparse_features"]:
            rows = int(f["num_embeddings"])
            dim = (auto_embedding_dim(rows, cfg.model.embedding_dim_factor, cfg.model.dense_arch_layer_sizes[-1])
                   if cfg.model.embedding_dim == "auto" else cfg.model.embedding_dim)
            out.append(EmbeddingBagConfig(name=f"t_{f['name']}", num_embeddings=rows,
                                          embedding_dim=dim, feature_names=[f["name"]],
                                          data_type=data_type, **init))
        return out
    for i, t in enumerate(cfg.model.tables):
        fnames = t.feature_names or [t.name]
        rows = t.num_embeddings
        if rows is None:
            missing = [n for n in fnames if n not in feats]
            if meta is None or missing:
                raise ConfigError(
                    f"model.tables[{i}].num_embeddings: null means 'from the data', but "
                    f"{'there is no meta.json at ' + cfg.data.path if meta is None else 'features ' + str(missing) + ' are not in meta.json'}"
                )
            rows = max(int(feats[n]["num_embeddings"]) for n in fnames)
        out.append(EmbeddingBagConfig(name=t.name, num_embeddings=rows,
                                      embedding_dim=t.embedding_dim or cfg.model.embedding_dim,
                                      feature_names=list(fnames), pooling=t.pooling, data_type=data_type, **init))
    return out
