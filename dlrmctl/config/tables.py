"""What a config resolves to with the data: the data's ``meta.json``, the embedding tables
(:func:`resolve_tables`, sized by :func:`auto_embedding_dim` for ``model.embedding_dim: auto``)
and the weighted features.  Imports torch only inside :func:`resolve_tables` (for the
EmbeddingBagConfig it returns).
"""

from __future__ import annotations

import math
import os

from dlrmctl.config.schema import ConfigError, ExperimentConfig, ManagedCollisionConfig


def weighted_features(cfg: ExperimentConfig, meta: dict | None = None) -> list[str]:
    """The features whose ids carry per-id weights, in order (empty: the model is unweighted).

    * ``model.tables`` given: the features of its ``weighted: true`` tables, in table order.
    * ``model.tables`` empty (tables derived from the data): the sparse features meta.json marks
      ``"weighted": true``, in meta.json order (none without ``meta``).
    """
    if not cfg.model.tables:
        return [f["name"] for f in (meta or {}).get("sparse_features", []) if f.get("weighted")]
    out: list[str] = []
    for t in cfg.model.tables:
        if t.weighted:
            out.extend(f for f in t.feature_names or [t.name] if f not in out)
    return out


def recorded_weighted_features(cfg: ExperimentConfig, recorded: list[str] | None, meta: dict | None = None,
                               source: str = "the checkpoint's meta.json") -> list[str]:
    """The weighted features of a trained run, in order (empty: it trained unweighted).

    * ``recorded`` (the ``weighted_features`` list its checkpoint's meta.json holds) when it is
      there: that list.
    * No record (checkpoints written before it was kept), hand-written ``model.tables``: the
      features of its ``weighted: true`` tables (that key was always read).
    * No record, tables derived from the data, ``meta`` (the run's data meta.json) marking no
      sparse feature ``"weighted": true``: none.
    * No record, tables derived from the data, ``meta`` marking features weighted: ambiguous.
      Such runs were trained unweighted by the versions that ignored meta.json's marks and
      weighted by the later ones that read them before the record was written; nothing else in a
      checkpoint tells the two apart, so this refuses rather than guess.

    Args:
        source: the checkpoint meta.json's path, named in the error.

    Raises:
        ConfigError: the ambiguous case; names ``source``, the marked features and the two
            records to add (``docs/checkpoints.md#weighted-features-of-older-checkpoints``).
    """
    if recorded is not None:
        return list(recorded)
    if cfg.model.tables:
        return weighted_features(cfg, None)
    marked = weighted_features(cfg, meta)
    if not marked:
        return []
    names = ", ".join(f'"{n}"' for n in marked)
    raise ConfigError(
        f"{source}: no \"weighted_features\" record, the tables are derived from the data and its meta.json "
        f"marks {names} weighted: the checkpoint does not say whether the run trained with their per-id weights; "
        f"add \"weighted_features\": [{names}] (trained weighted) or \"weighted_features\": [] (unweighted) "
        "to that file (see docs/checkpoints.md, 'Weighted features of older checkpoints')"
    )


def meta_as_trained(meta: dict, weighted: list[str]) -> dict:
    """A copy of meta.json in which exactly the sparse features in ``weighted`` are marked
    ``"weighted": true``, so :func:`weighted_features` over tables derived from the data gives a
    run's recorded list (:func:`recorded_weighted_features`).  Only the marks change: the copy is
    for building a run's model and loaders, never for fingerprints."""
    out = dict(meta)
    out["sparse_features"] = [{**f, "weighted": f["name"] in weighted} for f in meta.get("sparse_features", [])]
    return out


def check_tables_against_meta(cfg: ExperimentConfig, meta: dict) -> list[str]:
    """Hand-written ``model.tables`` against the data's meta.json, before training: the warnings
    to print (one line each, without the ``warning:`` prefix).

    * a table with ``num_embeddings`` below meta.json's ``num_embeddings`` of one of its features
      (ids ``0 .. n-1``): an error with ``model.on_invalid_id: error`` (the first batch holding a
      larger id would fail), a warning with ``zero`` (those ids pool to zero vectors).
    * an unweighted table over a feature meta.json marks ``"weighted": true``: a warning (its
      per-id weights are not read; every id weighs 1.0).

    Managed-collision tables (sized by ``size``) and tables derived from the data are not checked.

    Raises:
        ConfigError: naming the table, the feature, the table's rows and meta.json's size.
    """
    feats = {f["name"]: f for f in meta.get("sparse_features", [])}
    p = os.path.join(cfg.data.path, "meta.json")
    mc = managed_collision_tables(cfg, meta)
    warnings = []
    for i, t in enumerate(cfg.model.tables):
        fnames = t.feature_names or [t.name]
        for n in fnames if t.num_embeddings is not None and t.name not in mc else ():
            need = feats.get(n, {}).get("num_embeddings")
            if need is None or need <= t.num_embeddings:
                continue
            what = (f"model.tables[{i}].num_embeddings: table '{t.name}' has {t.num_embeddings} rows but {p} gives "
                    f"feature '{n}' {need} ids (0 .. {need - 1})")
            if cfg.model.on_invalid_id == "error":
                raise ConfigError(f"{what}; set num_embeddings >= {need}, or null to size it from the data")
            warnings.append(f"{what}: ids >= {t.num_embeddings} pool to zero vectors (model.on_invalid_id: zero)")
        if not t.weighted:
            for n in (n for n in fnames if feats.get(n, {}).get("weighted")):
                warnings.append(f"model.tables[{i}].weighted is false but {p} marks feature '{n}' of table '{t.name}' "
                                f"weighted: its per-id weights are ignored (each id weighs 1.0); set "
                                f"model.tables[{i}].weighted: true to train with them")
    return warnings


def managed_collision_tables(cfg: ExperimentConfig, meta: dict | None) -> dict[str, ManagedCollisionConfig]:
    """Table name -> its managed-collision config, for every table that has one: a table of
    ``model.tables`` with ``managed_collision``, and every table over a raw-id feature (meta.json
    ``"ids": "raw"``) otherwise given ``model.managed_collision``.

    Raises:
        ConfigError: a table over a raw-id feature without a managed-collision config (naming the
            feature and the key to set); a ``size`` whose buckets cannot hold the distinct ids of
            one batch (``data.batch_size`` x the table's features x their ``max_pooling_factor``),
            naming the key.
    """
    feats = {f["name"]: f for f in (meta or {}).get("sparse_features", [])}
    default = cfg.model.managed_collision
    if cfg.model.tables:
        specs = [(t.name, t.feature_names or [t.name], t.managed_collision, f"model.tables[{i}].managed_collision")
                 for i, t in enumerate(cfg.model.tables)]
    else:
        specs = [(f"t_{n}", [n], None, "model.managed_collision") for n in feats]
    out = {}
    for name, fnames, own, key in specs:
        raw = [n for n in fnames if feats.get(n, {}).get("ids") == "raw"]
        mc = own if own is not None else (default if raw else None)
        if mc is None:
            if raw:
                raise ConfigError(
                    f"{os.path.join(cfg.data.path, 'meta.json')}: feature '{raw[0]}' holds raw ids (\"ids\": \"raw\"), "
                    f"so table '{name}' needs a managed-collision table: set model.managed_collision"
                    + ("" if key == "model.managed_collision" else f" (or {key})") + ": {size: N, eviction: lfu}")
            continue
        where = key if own is not None else "model.managed_collision"
        need = cfg.data.batch_size * sum(int(feats.get(n, {}).get("max_pooling_factor", 1)) for n in fnames)
        per = mc.size // mc.buckets
        if per < need:
            raise ConfigError(
                f"{where}.size: {mc.size} rows ({mc.buckets} bucket(s) of {per}) cannot hold the distinct ids of "
                f"one batch of table '{name}': up to {need} (data.batch_size {cfg.data.batch_size} x its features' "
                f"max_pooling_factor); give size >= {need * mc.buckets}")
        out[name] = mc
    return out


def check_managed_collision_sharding(cfg: ExperimentConfig, meta: dict | None, world_size: int,
                                     trained: bool = False) -> None:
    """Managed-collision tables on ``world_size > 1`` ranks shard row_wise by zone of their
    buckets (:mod:`dlrmctl.distributed.sharded_mc`): every such table needs ``buckets`` a
    multiple of the world size, and no other hand-given sharding type.  Checked before any rank
    starts.

    Args:
        trained: ``cfg`` is a trained run's config (``checkpoint reshard``): its buckets cannot
            change, so the error names the world sizes they allow and says to train a new run,
            instead of the ``--set`` that fixes a config about to train.

    Raises:
        ConfigError: naming the table and the key (``sharding.tables.<t>.sharding_type``, or the
            table's ``managed_collision.buckets``).
    """
    if world_size <= 1:
        return
    own = {t.name: i for i, t in enumerate(cfg.model.tables or []) if t.managed_collision is not None}
    for name, mc in managed_collision_tables(cfg, meta).items():
        hand = cfg.sharding.tables.get(name)
        if hand is not None and hand.sharding_type != "row_wise":
            raise ConfigError(
                f"sharding.tables.{name}.sharding_type: '{name}' is a managed-collision table, sharded row_wise only "
                f"(each rank owns a zone of its raw-id buckets and their rows); got {hand.sharding_type}")
        if mc.buckets % world_size:
            key = f"model.tables[{own[name]}].managed_collision" if name in own else "model.managed_collision"
            raise ConfigError(
                f"{key}.buckets: managed-collision table '{name}' on {world_size} ranks needs buckets a multiple of "
                f"{world_size} (each rank owns buckets / {world_size} of them); got {mc.buckets}; "
                + (_trained_buckets_advice(key, mc.buckets, world_size) if trained
                   else _buckets_advice(key, mc.size, mc.buckets, world_size)))


def _trained_buckets_advice(key: str, buckets: int, world_size: int) -> str:
    """What a trained run's ``buckets`` allow (the world sizes dividing it) and how to get
    ``world_size`` (a new run)."""
    small = [k for k in range(1, math.isqrt(buckets) + 1) if buckets % k == 0]
    divs = sorted(set(small + [buckets // k for k in small]))
    shown = ", ".join(map(str, divs[:12])) + (", ..." if len(divs) > 12 else "")
    return (f"this run's {buckets} buckets split over {shown} rank(s) (the divisors of {buckets}); to run on "
            f"{world_size} ranks, train a new run with {key}.buckets a multiple of {world_size}")


def _buckets_advice(key: str, size: int, buckets: int, world_size: int) -> str:
    """``e.g. --set KEY.buckets=B``: the smallest multiple of ``world_size`` at or above
    ``buckets`` that divides ``size`` (as buckets must), or what to change when none does."""
    fit = None
    if size % world_size == 0:  # buckets = world_size x k, k a divisor of m (trial division: O(sqrt m))
        m, k_min = size // world_size, -(-buckets // world_size)
        small = [k for k in range(1, math.isqrt(m) + 1) if m % k == 0]
        fit = world_size * min(k for k in small + [m // k for k in small] if k >= k_min)
    if fit is not None:
        return f"e.g. --set {key}.buckets={fit}"
    return (f"no multiple of {world_size} divides {key}.size ({size}): set a size that one does, e.g. --set "
            f"{key}.size={world_size * -(-size // world_size)} --set {key}.buckets={world_size}")


def read_data_meta(cfg: ExperimentConfig) -> dict | None:
    """The preprocessed data's ``meta.json`` at ``data.path``, or None if there is none.

    Raises:
        ConfigError: meta.json exists but is not valid JSON, or names files outside the dataset
            (:func:`dlrmctl.data.checksums.check_meta_paths`).
    """
    import json

    p = os.path.join(cfg.data.path, "meta.json")
    if not os.path.exists(p):
        return None
    try:
        with open(p) as f:
            text = f.read()
    except (OSError, ValueError) as e:  # ValueError: UnicodeDecodeError
        raise ConfigError(f"{p}: cannot read data meta: {e}") from None
    if not text.strip():
        raise ConfigError(f"{p}: empty file; re-run `dlrmctl preprocess ... --out {cfg.data.path}`")
    try:
        meta = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"{p}: cannot read data meta: {e}") from None
    missing = [k for k in ("dense_features", "sparse_features") if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise ConfigError(f"{p}: not a dlrmctl dataset meta.json (no {' / '.join(missing)}); re-run "
                          f"`dlrmctl preprocess ... --out {cfg.data.path}`")
    for f in meta["sparse_features"]:
        n = f.get("num_embeddings") if isinstance(f, dict) else None
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ConfigError(f"{p}: sparse feature {f.get('name')!r}: num_embeddings must be an int > 0, got {n!r}; "
                              f"re-run `dlrmctl preprocess ... --out {cfg.data.path}`")
    if "splits" in meta:  # the files it names stay inside the dataset (an edited meta.json reads nothing else)
        from dlrmctl.data.checksums import check_meta_paths

        why = check_meta_paths(meta)
        if why is not None:
            raise ConfigError(f"{p}: corrupt meta.json: {why}; re-run `dlrmctl preprocess ... --out {cfg.data.path}`")
    return meta


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
    * a managed-collision table (:func:`managed_collision_tables`): ``size + 1`` rows (the last
      is the default row of ids the remapper does not hold).
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
    if not cfg.model.tables and meta is None:  # before torch (embedding_configs): a config error answers at once
        where = "" if os.path.isabs(cfg.data.path) else f" (relative to the working directory {os.getcwd()})"
        raise ConfigError(
            f"model.tables is empty, so tables are derived from the data, but {cfg.data.path}/meta.json{where} "
            "does not exist: run `dlrmctl preprocess` first or list model.tables"
        )
    from dlrmctl.modules.embedding_configs import DataType, EmbeddingBagConfig

    data_type = DataType.FP16 if cfg.model.embedding_precision == "fp16" else DataType.FP32
    a = cfg.model.embedding_init_max  # None: each table's sqrt(1 / num_embeddings)
    init = {} if a is None else {"weight_init_min": -float(a), "weight_init_max": float(a)}
    feats = {f["name"]: f for f in (meta or {}).get("sparse_features", [])}
    mc = managed_collision_tables(cfg, meta)
    out = []
    if not cfg.model.tables:
        for f in meta["sparse_features"]:
            t_mc = mc.get(f"t_{f['name']}")
            rows = t_mc.size + 1 if t_mc is not None else int(f["num_embeddings"])
            dim = (auto_embedding_dim(rows, cfg.model.embedding_dim_factor, cfg.model.dense_arch_layer_sizes[-1])
                   if cfg.model.embedding_dim == "auto" else cfg.model.embedding_dim)
            out.append(EmbeddingBagConfig(name=f"t_{f['name']}", num_embeddings=rows,
                                          embedding_dim=dim, feature_names=[f["name"]],
                                          data_type=data_type, **init))
        return out
    for i, t in enumerate(cfg.model.tables):
        fnames = t.feature_names or [t.name]
        rows = t.num_embeddings
        if t.name in mc:
            if rows is not None and rows != mc[t.name].size + 1:
                raise ConfigError(f"model.tables[{i}].num_embeddings: a managed-collision table has size + 1 rows "
                                  f"({mc[t.name].size + 1}); got {rows} (leave it null)")
            rows = mc[t.name].size + 1
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
