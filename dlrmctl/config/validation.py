"""The checks of a config that types alone cannot express, one function per section.

Each section's function (:func:`validate_data`, :func:`validate_model`, :func:`validate_optimizer`,
:func:`validate_train`, :func:`validate_sharding`) checks the bounds of its integer keys
(:data:`INT_LIMITS`, else int64) and that its floats are finite, then its ranges and the
consistency inside the section; :func:`validate` runs them all and adds the checks that span
sections.  Every error is a :class:`~dlrmctl.config.schema.ConfigError` naming the key path.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from dlrmctl.config import schema
from dlrmctl.config.schema import ConfigError
from dlrmctl.optim.registry import FP16_EMBEDDING_OPTIMIZERS

#: largest value of any integer key (int64: tensors of sizes, steps and counts are int64)
INT64_MAX = 2**63 - 1

#: upper bounds of the integer keys whose size is memory (key name -> (limit, what it is));
#: every other integer key is bounded by :data:`INT64_MAX`.  Each bound is far above any real
#: configuration and far below what would overflow int64 arithmetic (rows x dim x bytes) or
#: ask for more memory than any machine has.
INT_LIMITS: dict[str, tuple[int, str]] = {
    "batch_size": (2**24, "samples per global batch; a batch's dense features alone are 52 bytes a sample"),
    "eval_batch_size": (2**24, "samples per evaluation batch"),
    "num_embeddings": (2**44, "rows of one table; 2**44 rows x 4 bytes is 70 TB a column"),
    "embedding_dim": (2**14, "columns of one table"),
    "dense_arch_layer_sizes": (2**16, "units of one MLP layer"),
    "over_arch_layer_sizes": (2**16, "units of one MLP layer"),
    "interaction_branch1_layer_sizes": (2**16, "units of one MLP layer"),
    "interaction_branch2_layer_sizes": (2**16, "units of one MLP layer"),
    "dcn_low_rank_dim": (2**16, "the rank of a cross layer"),
    "dcn_num_layers": (2**10, "cross layers"),
    "multi_hot_sizes": (2**16, "ids per sample of one feature"),
    "prefetch": (2**10, "batches held in memory ahead of the step"),
    "workers": (2**8, "loader worker processes per rank"),
    "shuffle_window_rows": (2**40, "rows held in memory for the shuffle"),
    "shuffle_block_rows": (2**40, "rows of a shuffle block"),
    "column_sizes": (2**14, "columns of one shard (<= embedding_dim)"),
    "min_column_shard_dim": (2**14, "columns of one shard (<= embedding_dim)"),
    "ranks": (2**20, "a rank number"),
    "local_world_size": (2**20, "ranks per host"),
}


def check_bounds(value: Any, path: str) -> None:
    """Every integer of the config tree within its :data:`INT_LIMITS` bound (else ``INT64_MAX``),
    every float finite.

    Raises:
        ConfigError: naming the key path, the value and the limit.
    """
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            check_bounds(getattr(value, f.name), f"{path}.{f.name}" if path else f.name)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            check_bounds(v, f"{path}.{k}")
        return
    if isinstance(value, list):
        for i, v in enumerate(value):
            check_bounds(v, f"{path}[{i}]")
        return
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        key = re.sub(r"\[\d+\]$", "", path).rsplit(".", 1)[-1]
        limit, what = INT_LIMITS.get(key, (INT64_MAX, "the int64 range"))
        if abs(value) > limit:
            raise ConfigError(f"{path}: {value:,} is beyond the limit of {limit:,} ({what}); give a smaller value")
    elif isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{path}: must be a finite number, got {value}")




def _positive(v: Any, path: str, allow_zero: bool = False) -> None:
    """``v`` (None: unset, accepted) is > 0, or >= 0 with ``allow_zero``.

    Raises:
        ConfigError: ``path: must be > 0, got v``.
    """
    if v is not None and (v < 0 or (v == 0 and not allow_zero)):
        raise ConfigError(f"{path}: must be {'>= 0' if allow_zero else '> 0'}, got {v}")


def _check_section(section: Any, path: str, positive: tuple[str, ...] = (), at_least_zero: tuple[str, ...] = ()) -> None:
    """The checks every section starts with: :func:`check_bounds` of the whole section, then each key
    of ``positive`` > 0 and each key of ``at_least_zero`` >= 0 (a key set to None is unset, accepted).

    Raises:
        ConfigError: naming ``path.<key>``.
    """
    check_bounds(section, path)
    for key in positive:
        _positive(getattr(section, key), f"{path}.{key}")
    for key in at_least_zero:
        _positive(getattr(section, key), f"{path}.{key}", allow_zero=True)


def _validate_rates(o: Any, path: str) -> None:
    """An optimizer's ``lr`` and ``weight_decay`` finite and >= 0, ``eps`` finite and > 0.

    Raises:
        ConfigError: naming ``path.lr`` / ``.eps`` / ``.weight_decay``.
    """
    for key in ("lr", "eps", "weight_decay"):
        v = getattr(o, key)
        if not math.isfinite(v):
            raise ConfigError(f"{path}.{key}: must be a finite number, got {v}")
    _positive(o.lr, f"{path}.lr", allow_zero=True)
    _positive(o.weight_decay, f"{path}.weight_decay", allow_zero=True)
    # Adagrad-type updates divide by sqrt(G) + eps: eps 0 gives 0/0 = NaN for a zero gradient
    _positive(o.eps, f"{path}.eps")


# ------------------------------------------------------------------ sections
def validate_table(t: schema.TableConfig, path: str) -> None:
    """Checks of one table (``path``: ``model.tables[i]``); the checks across tables are
    :func:`validate_model`'s.

    Raises:
        ConfigError: a feature listed twice, a size not > 0.
    """
    twice = sorted({f for f in t.feature_names if t.feature_names.count(f) > 1})
    if twice:
        raise ConfigError(f"{path}.feature_names: {twice} listed more than once in table '{t.name}'")
    _positive(t.num_embeddings, f"{path}.num_embeddings")
    _positive(t.embedding_dim, f"{path}.embedding_dim")
    if t.managed_collision is not None:
        validate_managed_collision(t.managed_collision, f"{path}.managed_collision")


def validate_managed_collision(mc: schema.ManagedCollisionConfig, path: str) -> None:
    """``size >= 1`` and ``buckets`` a divisor of it (the batch's needs are checked with the data,
    :func:`dlrmctl.config.tables.resolve_tables`).

    Raises:
        ConfigError: naming ``path.size`` or ``path.buckets``.
    """
    if mc.size < 1:
        raise ConfigError(f"{path}.size: the rows of the managed-collision table, an integer >= 1; got {mc.size}")
    if mc.buckets < 1 or mc.size % mc.buckets:
        raise ConfigError(f"{path}.buckets: must be >= 1 and divide {path}.size ({mc.size}); got {mc.buckets}")


def validate_data(d: schema.DataConfig, path: str = "data") -> None:
    """Bounds (:func:`check_bounds`), positive batch sizes and row counts.

    Raises:
        ConfigError: naming the key under ``path``.
    """
    # prefetch 0: no background thread; workers 0: a thread of the rank
    _check_section(d, path, positive=("batch_size", "eval_batch_size", "num_samples"),
                   at_least_zero=("prefetch",) if d.workers == "auto" else ("prefetch", "workers"))
    for key in ("shuffle_window_rows", "shuffle_block_rows"):  # ints already (config_from_dict's type check)
        if getattr(d, key) < 1:
            raise ConfigError(f"{path}.{key}: must be an integer >= 1 (rows), got {getattr(d, key)!r}")
    if d.multi_hot_sizes is not None and any(s <= 0 for s in d.multi_hot_sizes):
        raise ConfigError(f"{path}.multi_hot_sizes: every size must be > 0, got {d.multi_hot_sizes}")


def validate_model(m: schema.ModelConfig, path: str = "model") -> None:
    """Bounds, value ranges, layer sizes, the tables (:func:`validate_table`, unique
    names, one ``weighted`` per feature) and the one embedding width every interaction needs.

    Raises:
        ConfigError: naming the key under ``path``.
    """
    check_bounds(m, path)
    if m.embedding_dim != "auto":
        _positive(m.embedding_dim, f"{path}.embedding_dim")
    if not (math.isfinite(m.embedding_dim_factor) and m.embedding_dim_factor > 0):
        raise ConfigError(f"{path}.embedding_dim_factor: must be a finite number > 0, got {m.embedding_dim_factor}")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"{path}.dropout: must be in [0, 1) (the probability of zeroing an activation), "
                          f"got {m.dropout}")
    _validate_model_init_max(m, path)
    if m.managed_collision is not None:
        validate_managed_collision(m.managed_collision, f"{path}.managed_collision")
    for i, n in enumerate(m.dense_arch_layer_sizes):
        _positive(n, f"{path}.dense_arch_layer_sizes[{i}]")
    for i, n in enumerate(m.over_arch_layer_sizes):
        _positive(n, f"{path}.over_arch_layer_sizes[{i}]")
    if not m.over_arch_layer_sizes or m.over_arch_layer_sizes[-1] != 1:
        raise ConfigError(f"{path}.over_arch_layer_sizes: the last layer must have size 1 (one logit)")
    if not m.dense_arch_layer_sizes:
        raise ConfigError(f"{path}.dense_arch_layer_sizes: needs at least one layer")
    _validate_model_tables(m, path)
    _validate_model_interaction(m, path)


#: the largest ``model.embedding_init_max``: the DLRM reference's own bound sqrt(1 / num_embeddings)
#: is at most 1 (a one-row table); beyond, the dot interaction of two rows starts at up to
#: embedding_dim * a^2 and the over-arch saturates (a = 1e15 trained to NaN with fp32 still finite)
EMBEDDING_INIT_MAX = 1.0


def _validate_model_init_max(m: schema.ModelConfig, path: str) -> None:
    a = m.embedding_init_max
    if a is None:
        return
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not (math.isfinite(a) and 0 < a <= EMBEDDING_INIT_MAX):
        raise ConfigError(f"{path}.embedding_init_max: must be a number in (0, {EMBEDDING_INIT_MAX:g}] (tables start "
                          f"U(-a, a); the DLRM reference's default sqrt(1 / num_embeddings) is at most 1, typical "
                          f"values are 0.01-0.1) or null (that default), got {a!r}")


def _validate_model_tables(m: schema.ModelConfig, path: str) -> None:
    names: set[str] = set()
    feature_weighted: dict[str, tuple[bool, str]] = {}
    for i, t in enumerate(m.tables):
        p = f"{path}.tables[{i}]"
        if t.name in names:
            raise ConfigError(f"{p}.name: duplicate table name '{t.name}'")
        names.add(t.name)
        validate_table(t, p)
        for f in t.feature_names or [t.name]:
            other = feature_weighted.setdefault(f, (t.weighted, t.name))
            if other[0] != t.weighted:
                raise ConfigError(
                    f"{p}.weighted: feature '{f}' feeds the weighted and the unweighted tables "
                    f"{sorted([t.name, other[1]])}; one feature's ids carry one weight each, so set the same "
                    "`weighted` on both tables"
                )


def _validate_model_interaction(m: schema.ModelConfig, path: str) -> None:
    # every interaction stacks [dense, e_1..e_F] as F+1 vectors of one width d
    it = m.interaction
    if m.embedding_dim == "auto":
        if m.tables:
            raise ConfigError(f"{path}.embedding_dim: auto sizes the tables derived from the data; with "
                              f"{path}.tables give each table's embedding_dim instead")
        dims = {m.dense_arch_layer_sizes[-1]}  # narrower tables are projected to d
    else:
        dims = {t.embedding_dim or m.embedding_dim for t in m.tables} or {m.embedding_dim}
    if len(dims) != 1:
        raise ConfigError(f"{path}.tables: the {it} interaction needs one embedding dim for all tables, "
                          f"got {sorted(dims)}")
    (d,) = dims
    if m.dense_arch_layer_sizes[-1] != d:
        raise ConfigError(
            f"{path}.dense_arch_layer_sizes: the last layer ({m.dense_arch_layer_sizes[-1]}) must equal "
            f"the embedding dim ({d}) for the {it} interaction"
        )
    if it == "projection":
        for key in ("interaction_branch1_layer_sizes", "interaction_branch2_layer_sizes"):
            sizes = getattr(m, key)
            for i, n in enumerate(sizes or ()):
                _positive(n, f"{path}.{key}[{i}]")
            if not sizes or sizes[-1] % d:
                raise ConfigError(f"{path}.{key}: the last layer must be a multiple of the embedding dim {d}, "
                                  f"got {sizes}")
    if it == "dcn":
        _positive(m.dcn_num_layers, f"{path}.dcn_num_layers")
        _positive(m.dcn_low_rank_dim, f"{path}.dcn_low_rank_dim")


def validate_embedding_optimizer(o: schema.EmbeddingOptimizerConfig, path: str = "optimizer.embedding") -> None:
    """Finite rates (lr, weight_decay >= 0; eps > 0) and two betas in [0, 1).

    Raises:
        ConfigError: naming the key under ``path`` (``optimizer.embedding``).
    """
    _validate_rates(o, path)
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        raise ConfigError(f"{path}.betas: expected two floats in [0, 1), got {o.betas}")


def validate_dense_optimizer(o: schema.DenseOptimizerConfig, path: str = "optimizer.dense") -> None:
    """Finite rates (lr, weight_decay >= 0; eps > 0), two betas in [0, 1) and a momentum in [0, 1].

    Raises:
        ConfigError: naming the key under ``path`` (``optimizer.dense``).
    """
    _validate_rates(o, path)
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):  # torch.optim.Adam's own bounds
        raise ConfigError(f"{path}.betas: expected two floats in [0, 1), got {o.betas}")
    if not 0.0 <= o.momentum <= 1.0:  # torch.optim.SGD refuses < 0; above 1 the velocity grows without bound
        raise ConfigError(f"{path}.momentum: must be in [0, 1], got {o.momentum}")


def validate_lr_schedule(s: schema.LRScheduleConfig, path: str = "optimizer.lr_schedule") -> None:
    """What the DLRM reference's ``LRPolicyScheduler`` refuses, plus the values its formula
    cannot take.

    Raises:
        ConfigError: naming the key under ``path``: a negative step count; ``decay_power``
            not > 0; ``end_lr_factor`` outside [0, 1]; decay starting before warmup ends
            ("warmup must finish before decay starts", the reference's rule: the factor
            would jump from 1 to the middle of the decay curve); ``decay_start_step`` set
            while ``decay_steps`` is 0 (decay disabled: the start would be ignored).
    """
    for key in ("warmup_steps", "decay_start_step", "decay_steps"):
        v = getattr(s, key)
        if v < 0:
            raise ConfigError(f"{path}.{key}: must be >= 0, got {v}")
    if not s.decay_power > 0 or s.decay_power == float("inf"):
        raise ConfigError(f"{path}.decay_power: must be a finite number > 0 (the exponent of the decay), "
                          f"got {s.decay_power}")
    if not 0 <= s.end_lr_factor <= 1:
        raise ConfigError(f"{path}.end_lr_factor: must be in [0, 1] (the final fraction of the base lr), "
                          f"got {s.end_lr_factor}")
    if (s.decay_steps > 0 or s.decay_start_step > 0) and s.decay_start_step < s.warmup_steps:
        raise ConfigError(
            f"{path}.decay_start_step: warmup must finish before decay starts: decay_start_step "
            f"{s.decay_start_step} < warmup_steps {s.warmup_steps}"
        )
    if s.decay_steps == 0 and s.decay_start_step > 0:
        raise ConfigError(
            f"{path}.decay_start_step: {s.decay_start_step} but decay_steps is 0 (no decay); "
            "set decay_steps > 0 or remove decay_start_step"
        )


def validate_optimizer(o: schema.OptimizerConfig, path: str = "optimizer") -> None:
    """Bounds, then each subsection's check.

    Raises:
        ConfigError: naming the key under ``path``.
    """
    check_bounds(o, path)
    validate_embedding_optimizer(o.embedding, f"{path}.embedding")
    validate_dense_optimizer(o.dense, f"{path}.dense")
    validate_lr_schedule(o.lr_schedule, f"{path}.lr_schedule")


def validate_train(t: schema.TrainConfig, path: str = "train") -> None:
    """Bounds, positive counts, early stopping with a ``keep_best`` metric, no fp16 autocast
    on ``device: cpu``.

    Raises:
        ConfigError: naming the key under ``path``.
    """
    _check_section(t, path, positive=("epochs", "max_steps", "keep_last_checkpoints"),
                   at_least_zero=("early_stopping_patience", "eval_every", "checkpoint_every", "progress_every_s"))
    if t.early_stopping_patience and t.keep_best == "none":
        raise ConfigError(f"{path}.early_stopping_patience: stops on the keep_best metric, but {path}.keep_best "
                          f"is 'none'; set {path}.keep_best to auc or ne")
    if t.precision == "fp16" and t.device == "cpu":
        raise ConfigError(f"{path}.precision: fp16 autocast needs CUDA (a GradScaler on a GPU); on the CPU use bf16")


def validate_table_sharding(ts: schema.TableShardingConfig, path: str) -> None:
    """Column shards at least 1 wide, ranks >= 0 (``path``: ``sharding.tables.<name>``).

    Raises:
        ConfigError: naming the key under ``path``.
    """
    if ts.column_sizes is not None and (not ts.column_sizes or any(c < 1 for c in ts.column_sizes)):
        raise ConfigError(f"{path}.column_sizes: every column shard needs a width >= 1, got {ts.column_sizes}")
    if ts.ranks is not None and any(r < 0 for r in ts.ranks):
        raise ConfigError(f"{path}.ranks: ranks are >= 0, got {ts.ranks}")


def validate_sharding(s: schema.ShardingConfig, path: str = "sharding") -> None:
    """Bounds, positive memory sizes and host size, each :func:`validate_table_sharding`.  That
    the tables named exist is :func:`validate`'s (a cross-section check).

    Raises:
        ConfigError: naming the key under ``path``.
    """
    _check_section(s, path, positive=("hbm_gb", "ddr_gb", "local_world_size"))
    for name, ts in s.tables.items():
        validate_table_sharding(ts, f"{path}.tables.{name}")


# ------------------------------------------------------------ whole config

def validate(cfg: schema.ExperimentConfig) -> None:
    """Check a whole config: the top-level ``name``, each section (its ``validate_<section>``:
    bounds of every integer key, :data:`INT_LIMITS` else int64, finite floats, then the section's
    ranges and consistency), then the checks that span sections: ``sharding.tables`` names tables
    of ``model.tables``; fp16 tables train with an optimizer FBGEMM runs on fp16 weights.

    Raises:
        ConfigError: naming the key path.
    """
    if not cfg.name or cfg.name in (".", "..") or "/" in cfg.name or "\\" in cfg.name or "\0" in cfg.name:
        raise ConfigError(f"name: must be one directory name (the run is train.run_dir/<name>), got {cfg.name!r}")
    validate_data(cfg.data, "data")
    validate_model(cfg.model, "model")
    validate_optimizer(cfg.optimizer, "optimizer")
    validate_train(cfg.train, "train")
    validate_sharding(cfg.sharding, "sharding")
    # across sections
    names = sorted(t.name for t in cfg.model.tables)
    if names:
        for tname in cfg.sharding.tables:
            if tname not in names:
                raise ConfigError(f"sharding.tables.{tname}: no such table in model.tables ({names})")
    if cfg.model.embedding_precision == "fp16" and cfg.optimizer.embedding.type not in FP16_EMBEDDING_OPTIMIZERS:
        raise ConfigError(
            f"model.embedding_precision: fp16 tables train with {', '.join(FP16_EMBEDDING_OPTIMIZERS[:-1])} or "
            f"{FP16_EMBEDDING_OPTIMIZERS[-1]} "
            f"(what FBGEMM's TBE runs on fp16 weights), not optimizer.embedding.type {cfg.optimizer.embedding.type!r}"
        )
