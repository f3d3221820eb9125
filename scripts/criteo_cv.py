"""DLRM against the logistic regression over K row-hash splits of one Criteo file: the paired
test-AUC difference DLRM - LR with its standard error.

    python scripts/criteo_cv.py --input ../shared/data/criteo/criteo_kaggle_sample_10k.tsv \\
        --config configs/criteo_sample.yaml [--splits 5] [--set model.dropout=0.3 ...] [--out cv.md] [--verbose]

``--input`` may be repeated (or a glob): the files are preprocessed together, as ``dlrmctl
preprocess criteo --input A --input B`` does, e.g. the 18k-line recipe of ``configs/criteo_18k.yaml``::

    python scripts/criteo_cv.py --input ../shared/data/criteo/criteo_kaggle_sample_10k.tsv \\
        --input ../shared/data/criteo/criteo_kaggle_train_lines2000_10000.tsv --config configs/criteo_18k.yaml

For each split seed ``s = first_seed .. first_seed + K - 1``:

1. ``dlrmctl preprocess criteo --input FILE --out WORK/data_s --val-ratio R --test-ratio R --seed s``
   (:func:`dlrmctl.data.criteo.preprocess.preprocess_criteo`; the seed moves every row's hash
   split, so each split has other train / val / test rows);
2. ``dlrmctl train CONFIG --set data.path=WORK/data_s ...`` with the ``--set`` overrides
   (:func:`dlrmctl.train.worker.run_training`; ``train.keep_best`` keeps the best-on-val
   checkpoint, early stopping reads val);
3. the best-on-val checkpoint scored once on test (:func:`dlrmctl.train.reload.run_logits`, what
   ``dlrmctl evaluate RUN --split test`` computes);
4. the logistic regression of ``scripts/criteo_baselines.py`` on the same split (C chosen on val,
   :func:`baselines_common.run_baselines`).

``--ensemble N`` (default 1): steps 2-3 train N DLRMs per split (``train.seed`` = the config's +
0..N-1, run directories ``split_<s>_m<i>``) and score the mean of their logits on val and test
(the ensemble's val AUC is then that of the mean logits at the members' best-on-val checkpoints).

``--train-rows N[,N...]`` (repeatable; ``all`` = the split's whole train part, the default): a
learning curve.  Each split is preprocessed once; for each size N, steps 2-4 run on
``WORK/data_<s>_n<N>``, the split's directory with N of its train rows
(:func:`derive_train_subsample`: the first N of a permutation seeded by the split seed, so the
2,500 rows are a subset of the 5,000; the vocabulary rebuilt on the kept rows with the same
frequency threshold, as preprocessing only them would build it; val and test rows unchanged).
DLRM and LR both read that directory; the runs are ``split_<s>_n<N>``.  Every size is checked
against each split's train rows (counted by the split rule) before any work.  The output then
has one section per size and a learning-curve table: train rows, DLRM and LR mean test AUC ± SE,
the paired difference ± SE, splits::

    python scripts/criteo_cv.py --input ../shared/data/criteo/criteo_kaggle_sample_10k.tsv \\
        --input ../shared/data/criteo/criteo_kaggle_train_lines2000_10000.tsv --config configs/criteo_18k.yaml \\
        --splits 10 --train-rows 2500,5000,10000,all

The script sets ``data.path``, ``name``, ``train.run_dir`` and ``train.progress`` of every run
itself (and ``train.seed`` with ``--ensemble`` > 1): a ``--set`` of one of them is refused.

While it works the script prints one progress line per split (on stderr); each training run's
console output (its epoch, evaluation and best-checkpoint lines, warnings) goes to
``WORK/logs/<run name>.log`` instead, next to the run directory ``WORK/runs/<run name>``
(``--verbose``: to the console as well as before).

Printed (and written to ``--out`` as Markdown, and as JSON next to it, each through a temp file
renamed into place): one row per split (rows, DLRM val / test AUC, LR val / test AUC, test
difference; a section per train size), then

* the mean paired difference ``mean_s(DLRM_s - LR_s)`` and its standard error
  ``std_s(.) / sqrt(K)`` (sample std, ddof 1): both models see the same rows of a split, so the
  split's difficulty cancels in the difference (a paired design; the SE says how far the mean
  can be trusted, about +-2 SE for a 95% interval with K >= 5);
* the mean val AUC of both models over the splits (what settings are chosen on; never the test);
* the pooled test AUC of each model: one AUC over the test rows of all splits together (a row
  can be a test row of several splits; the models of different splits are scored on one scale,
  so it also measures their calibration across splits).

With ``--out`` the table of the splits done so far is written after each split from the second
on (marked **partial**, ``"partial": true`` in the JSON), so a run stopped early leaves the
table of its finished splits; the last split replaces it with the whole one.

Errors (one ``error: ...`` line on stderr, exit status 2), all arguments checked before any split
is preprocessed: a missing input file or config, ``--splits`` < 2 (no standard error from one
split), ``--ensemble`` / ``--threads`` < 1, ``--first-seed`` < 0, ``--val-ratio`` or ``--test-ratio``
not in (0, 1) or summing to >= 1 (both splits are needed: val chooses, test scores), a bad ``--C``,
a bad ``--set`` (the config's own error) or one of the keys the script sets, an ``--out`` ending
``.json``, a ``--train-rows`` entry that is not an integer >= 1 or ``all``, or a size above the
train rows of one of the splits.  An error the
preprocessing, the trainer or the evaluator raises for the data or the configuration
(``ConfigError``, ``TrainError``, ``PlanError``, ``DataError``, ...) is one line naming the split
and the ``--set`` overrides, exit status 2.  Needs scikit-learn.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from dlrmctl.fileio import write_text_atomic  # noqa: E402

import baselines_common as bc  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
#: the real sample next to this checkout (``$DLRMCTL_SHARED_DATA`` or ``../shared/data``), whatever the cwd
DEFAULT_INPUT = str(Path(os.environ.get("DLRMCTL_SHARED_DATA") or REPO.parent / "shared" / "data")
                    / "criteo" / "criteo_kaggle_sample_10k.tsv")

#: the default experiment, the repository's (not the working directory's) configs/criteo_sample.yaml
DEFAULT_CONFIG = "configs/criteo_sample.yaml"

#: config keys the script sets for every run (a ``--set`` of one would be silently overridden)
CONTROLLED_KEYS = {
    "data.path": "each split's preprocessed directory WORK/data_<seed>",
    "name": "the run name split_<seed>[_m<i>]",
    "train.run_dir": "WORK/runs",
    "train.progress": "false (one progress line per split instead)",
}
#: set by the script only with ``--ensemble`` > 1 (the members' seeds)
ENSEMBLE_KEYS = {"train.seed": "the config's train.seed + 0..N-1 with --ensemble N"}


class SplitError(Exception):
    """A split's preprocessing, training or scoring refused its data or configuration (one line)."""


def _controlled_key(assignment: str, keys: dict) -> str | None:
    """The key of ``keys`` that the ``--set`` ``assignment`` would set, or None.

    A dotted key matches itself; a section (``--set train={seed: 3}``) matches when its YAML
    value holds the controlled key (``train.seed``).  An unparsable value is left to the config's
    own error."""
    import yaml

    key, _, text = assignment.partition("=")
    key = key.strip()
    for k in keys:
        if key == k:
            return k
        if k.startswith(key + "."):
            try:
                node = yaml.safe_load(text) if text.strip() else None
            except yaml.YAMLError:
                return None
            for part in k[len(key) + 1:].split("."):
                if not isinstance(node, dict) or part not in node:
                    break
                node = node[part]
            else:
                return k
    return None


def check_args(input_file: str | list[str], config: str, overrides: list[str], splits: int, first_seed: int,
               val_ratio: float, test_ratio: float, cs, ensemble: int, threads: int = 1,
               out: str | None = None, train_rows: list[int | None] | None = None) -> Any:
    """Every argument checked before any work (nothing is preprocessed or trained before this).
    Returns the loaded config (with the overrides): its ``train.seed`` is the ensemble's first.
    ``train_rows``: the ``--train-rows`` sizes (:func:`parse_train_rows`; None = all); each must
    fit every split's train rows, counted by the split rule (:func:`expected_train_rows`).

    Raises:
        ValueError: ``splits`` < 2, ``ensemble`` or ``threads`` < 1, ``first_seed`` < 0, a ratio
            not in (0, 1) or ``val_ratio + test_ratio`` >= 1, ``cs`` empty or not all finite > 0,
            an override of a key the script sets (:data:`CONTROLLED_KEYS`, plus ``train.seed``
            with ``ensemble`` > 1), an ``out`` ending ``.json`` (its JSON copy's name), a
            ``train_rows`` size < 1 or above the train rows of one of the splits.
        FileNotFoundError: ``input_file`` or ``config`` missing.
        dlrmctl.config.ConfigError: a bad config or override.
    """
    from dlrmctl.config import load_config

    if splits < 2:
        raise ValueError(f"--splits must be >= 2 (a standard error needs two paired differences), got {splits}")
    if ensemble < 1:
        raise ValueError(f"--ensemble must be >= 1 (DLRMs per split), got {ensemble}")
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    if first_seed < 0:
        raise ValueError(f"--first-seed must be >= 0 (split seeds), got {first_seed}")
    for name, r in (("--val-ratio", val_ratio), ("--test-ratio", test_ratio)):
        if not (math.isfinite(r) and 0 < r < 1):
            raise ValueError(f"{name} must be in (0, 1), got {r} (val chooses the DLRM checkpoint and the LR's C, "
                             "test scores both: each split needs both)")
    if val_ratio + test_ratio >= 1:
        raise ValueError(f"--val-ratio + --test-ratio must be < 1 (rows are left to train on), got "
                         f"{val_ratio + test_ratio:g}")
    bc.check_cs(cs)
    if out and Path(out).suffix == ".json":  # its JSON copy goes to out.with_suffix(".json"): the same file
        raise ValueError(f"--out {out}: names the Markdown table (its JSON is written next to it, as "
                         f"{Path(out).with_suffix('.json').name}); give e.g. --out {Path(out).with_suffix('.md')}")
    keys = dict(CONTROLLED_KEYS, **(ENSEMBLE_KEYS if ensemble > 1 else {}))
    for o in overrides:
        k = _controlled_key(o, keys)
        if k is not None:
            raise ValueError(f"--set {o}: the script sets {k} itself ({keys[k]}); drop this --set")
    import glob

    for f in ([input_file] if isinstance(input_file, str) else input_file):
        if not (os.path.isfile(f) or glob.glob(f)):
            raise FileNotFoundError(f"--input {f}: no such file (the Criteo TSV to split)")
    if not os.path.isfile(config):
        raise FileNotFoundError(f"--config {config}: no such file")
    ns = [n for n in (train_rows or []) if n is not None]
    if any(n < 1 for n in ns):
        raise ValueError(f"--train-rows: a size must be >= 1 train row (or '{ALL}'), got {min(ns)}")
    if ns:
        have = expected_train_rows(input_file, range(first_seed, first_seed + splits), val_ratio, test_ratio)
        fewest = min(have, key=have.get)
        if max(ns) > have[fewest]:
            raise ValueError(f"--train-rows {max(ns)}: split {fewest} has only {have[fewest]} train rows (the fewest "
                             f"of splits {first_seed}-{first_seed + splits - 1}: the input's lines less "
                             f"--val-ratio {val_ratio:g} and --test-ratio {test_ratio:g}); give sizes up to "
                             f"{have[fewest]}, or '{ALL}'")
    return load_config(config, list(overrides))  # a bad --set fails before any split is preprocessed


@contextlib.contextmanager
def _console_to(log_path: Path | None):
    """Python-level stdout and stderr (dlrmctl's echo, logging records, warnings) appended to
    ``log_path`` inside the block; ``None``: left on the console (``--verbose``)."""
    if log_path is None:
        yield
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        yield


def paired_stats(diffs) -> tuple[float, float]:
    """Mean and standard error ``std(ddof=1) / sqrt(K)`` of ``K >= 2`` paired differences.

    Raises:
        ValueError: fewer than 2 differences (no standard error).
    """
    d = np.asarray(diffs, dtype=np.float64)
    if d.size < 2:
        raise ValueError(f"a standard error needs >= 2 paired differences, got {d.size}")
    return float(d.mean()), float(d.std(ddof=1) / math.sqrt(d.size))


def preprocess_split(input_file: str | list[str], out_dir: Path, seed: int, val_ratio: float, test_ratio: float) -> None:
    """``dlrmctl preprocess criteo`` of ``input_file`` (one file / glob, or a list of them,
    preprocessed together) with split ``seed`` into ``out_dir`` (replaced whole: written to
    ``out_dir.tmp``, then renamed)."""
    from dlrmctl.data.criteo.parse import CriteoOptions
    from dlrmctl.data.criteo.preprocess import preprocess_criteo

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    preprocess_criteo(input_file if isinstance(input_file, str) or len(input_file) > 1 else input_file[0], tmp, CriteoOptions(val_ratio=val_ratio, test_ratio=test_ratio, seed=seed),
                      progress=False)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)


# ---------------------------------------------------------------------------- --train-rows
#: the ``--train-rows`` keyword for a split's whole train part (its data directory as preprocessed)
ALL = "all"


def parse_train_rows(specs: list[str] | None) -> list[int | None]:
    """``--train-rows`` values (each a comma list of integers and ``all``) -> the sizes, ascending,
    each once, ``None`` (= all of a split's train rows) last; no ``specs``: ``[None]``.

    Raises:
        ValueError: an entry that is neither an integer nor ``all``, or an integer < 1.
    """
    sizes: set[int | None] = set()
    for spec in specs or [ALL]:
        for part in spec.split(","):
            p = part.strip().lower()
            if p == ALL:
                sizes.add(None)
                continue
            try:
                n = int(p.replace("_", ""))
            except ValueError:
                raise ValueError(f"--train-rows {spec}: expected comma-separated integers >= 1 or '{ALL}' "
                                 f"(train rows per split), got {part.strip()!r}") from None
            if n < 1:
                raise ValueError(f"--train-rows {spec}: a size must be >= 1 train row (or '{ALL}'), got {n}")
            sizes.add(n)
    return sorted(s for s in sizes if s is not None) + ([None] if None in sizes else [])


def size_label(n: int | None) -> str:
    """``2500`` -> ``"2500"``, ``None`` -> ``"all"`` (as ``--train-rows`` spells it)."""
    return ALL if n is None else str(n)


def expected_train_rows(input_file: str | list[str], seeds, val_ratio: float, test_ratio: float) -> dict[int, int]:
    """Train rows each split seed's preprocessing will produce, from the split rule alone
    (:func:`dlrmctl.data.criteo.parse.row_split_codes` over every input line; nothing is parsed or
    written): ``{seed: rows}``.  An upper bound when the input has bad lines (skipped)."""
    from dlrmctl.data.criteo.parse import count_lines, expand_inputs, row_split_codes

    files = expand_inputs(input_file)
    lines = {f: np.arange(1, count_lines(f) + 1, dtype=np.int64) for f in files}
    return {s: int(sum(np.count_nonzero(row_split_codes(ln, f.name, s, val_ratio, test_ratio) == 0)
                       for f, ln in lines.items())) for s in seeds}


def subsample_indices(rows: int, n: int, seed: int) -> np.ndarray:
    """The ``n`` train rows kept of ``rows``: the first ``n`` of ``numpy.random.default_rng(seed)
    .permutation(rows)``, sorted (the file order kept).  Nested: for ``n1 < n2`` (same ``rows``,
    ``seed``) the ``n1`` rows are a subset of the ``n2`` rows.  Returns ``[n]`` int64.

    Raises:
        ValueError: ``n`` not in ``[1, rows]``.
    """
    if not 1 <= n <= rows:
        raise ValueError(f"a train subsample of {n} rows needs 1 <= n <= {rows} (the split's train rows)")
    return np.sort(np.random.default_rng(seed).permutation(rows)[:n]).astype(np.int64)


def _read_split(data_dir: Path, meta: dict, split: str):
    """One split's shards read whole, concatenated in meta order (``pyarrow.Table``)."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    tables = []
    for f in meta["splits"][split]["files"]:
        with pa.memory_map(str(data_dir / f)) as src:
            tables.append(ipc.open_file(src).read_all())
    return pa.concat_tables(tables).combine_chunks()


def derive_train_subsample(src: str | os.PathLike, dst: str | os.PathLike, n: int, seed: int) -> dict:
    """A copy of the preprocessed Criteo directory ``src`` whose train split holds ``n`` of its
    rows (:func:`subsample_indices` with ``seed``), written to ``dst`` (replaced whole: built in
    ``dst.tmp``, then renamed).  The val and test rows are ``src``'s, in ``src``'s order.

    As if only those ``n`` rows had been preprocessed as train: in vocabulary mode the vocabulary
    is rebuilt on them with ``src``'s frequency threshold ``T`` (a value keeps an id when it
    occurs >= ``T`` times in the kept rows, ids ranked by descending count, ties by value, as
    :func:`dlrmctl.data.criteo.vocab.build_vocab` does; every other value -> the new oov id; the
    tables shrink to the new sizes) and the ids of all three splits are mapped to it; in hashing
    mode the ids stay.  The dense statistics of ``dense_standardize`` (computed from the train
    split when training) and the logistic regression's one-hot columns follow from the new
    directory.  ``meta.json`` gets the new row counts, train CTR, table sizes, missing fractions
    and ``transforms.train_subsample`` (rows, of, seed, rule, source); ``distinct_train_values``
    is dropped (the raw values under the threshold are not in ``src``).  Reads the splits into
    memory (meant for sample-sized data).

    Returns:
        ``{"rows": n, "of": src's train rows}``.

    Raises:
        ValueError: ``n`` not in ``[1, src's train rows]``; a multi-hot or weighted feature (not
            supported).
        DataError: ``src`` is not a preprocessed directory (:func:`dlrmctl.data.columnar.read_meta`).
    """
    import pyarrow as pa
    import pyarrow.ipc as ipc

    from dlrmctl.data.columnar import LABEL_COLUMN, read_meta, write_meta, write_split_shard

    src, dst = Path(src), Path(dst)
    meta = read_meta(src)
    sparse = meta["sparse_features"]
    if any(f.get("multi_hot") or f.get("weighted") for f in sparse):
        raise ValueError(f"{src}: --train-rows supports single-hot, unweighted features only")
    tables = {s: _read_split(src, meta, s) for s in ("train", "val", "test")}
    of = tables["train"].num_rows
    keep = subsample_indices(of, n, seed)
    tables["train"] = tables["train"].take(pa.array(keep))
    vocab_mode = (meta.get("transforms") or {}).get("sparse", {}).get("mode") == "vocab"
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        (tmp / "vocab").mkdir(parents=True)
        new_sparse, maps = [], {}
        total = sum(t.num_rows for t in tables.values())
        for f in sparse:
            f = dict(f)
            name, old_missing = f["name"], int(f["missing_id"])
            if vocab_mode:
                v = int(f["oov_id"])
                t = int(meta["transforms"]["sparse"]["frequency_threshold"])
                with pa.memory_map(str(src / meta["vocab_files"][name])) as fh:
                    vocab = ipc.open_file(fh).read_all()
                values = vocab.column("value").to_numpy()
                if len(values) != v:
                    raise ValueError(f"{src / meta['vocab_files'][name]}: {len(values)} values, but meta.json "
                                     f"says oov_id {v} for {name}; re-run preprocessing")
                counts = np.bincount(tables["train"].column(name).to_numpy(), minlength=v + 2)[:v]
                ids = np.flatnonzero(counts >= t)
                ids = ids[np.lexsort((values[ids], -counts[ids]))]  # most frequent first, ties by value
                nv = len(ids)
                m = np.full(v + 2, nv, dtype=np.int64)  # old in-vocab ids under the threshold, and old oov -> oov
                m[ids] = np.arange(nv)
                m[v + 1] = nv + 1  # missing stays missing
                maps[name] = m
                vt = pa.table({"value": pa.array(values[ids], pa.int64()), "count": pa.array(counts[ids], pa.int64())})
                with pa.OSFile(str(tmp / meta["vocab_files"][name]), "wb") as sink, ipc.new_file(sink, vt.schema) as w:
                    w.write_table(vt)
                f.update(num_embeddings=nv + 2, oov_id=nv, missing_id=nv + 1)
                f.pop("distinct_train_values", None)
            missing = sum(int(np.count_nonzero(tb.column(name).to_numpy() == old_missing)) for tb in tables.values())
            f["missing_fraction"] = missing / total if total else 0.0
            new_sparse.append(f)
        out_meta = dict(meta)
        out_meta["splits"] = {}
        out_meta["ctr"] = dict(meta.get("ctr") or {})
        for s, tb in tables.items():
            cols = {c: tb.column(c).to_numpy() for c in tb.schema.names}
            for name, m in maps.items():
                cols[name] = m[cols[name]]
            rel = f"parts/subsample/{s}.arrow"
            write_split_shard(tmp / rel, cols, tb.schema)
            out_meta["splits"][s] = {"rows": int(tb.num_rows), "files": [rel]}
            if s == "train" and meta.get("label"):
                out_meta["ctr"]["train"] = float(np.mean(cols[LABEL_COLUMN])) if tb.num_rows else None
        out_meta["sparse_features"] = new_sparse
        out_meta["transforms"] = dict(meta.get("transforms") or {}, train_subsample={
            "rows": int(n), "of": int(of), "seed": int(seed), "source": str(src),
            "rule": "train = the first `rows` of numpy.random.default_rng(seed).permutation(of) of the source's "
                    "train rows (file order kept); val, test = the source's"
                    + ("; vocabulary rebuilt on the kept train rows with the same frequency threshold" if vocab_mode
                       else "")})
        if not vocab_mode:
            shutil.rmtree(tmp / "vocab")
        write_meta(tmp, out_meta)
    except BaseException:  # no half-built copy left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)
    return {"rows": int(n), "of": int(of)}


def run_name(seed: int, train_rows: int | None = None) -> str:
    """The run (and log) name of split ``seed`` at ``train_rows`` (None: all): ``split_<seed>`` or
    ``split_<seed>_n<rows>`` (an ensemble member adds ``_m<i>``)."""
    return f"split_{seed}" + ("" if train_rows is None else f"_n{train_rows}")


def _split_logs(work: Path, seed: int, train_rows: int | None, ensemble: int) -> list[Path]:
    """The training logs of split ``seed`` at ``train_rows`` under ``work/logs``."""
    tag = run_name(seed, train_rows)
    return list((work / "logs").glob(f"{tag}.log" if ensemble == 1 else f"{tag}_m*.log"))


def run_split(config: str, overrides: list[str], input_file: str, work: Path, seed: int, val_ratio: float,
              test_ratio: float, cs, log, ensemble: int = 1, verbose: bool = False, base_seed: int = 0,
              train_rows: int | None = None, preprocess: bool = True) -> dict:
    """One split: preprocess, train DLRM, score its best-on-val checkpoint on test, fit the LR.

    ``ensemble`` > 1: train that many DLRMs (``train.seed`` = the config's + 0, 1, ...; each its
    own best-on-val checkpoint) and score the mean of their logits on val and test.
    ``train_rows`` N (None: all): both models train on ``work/data_<seed>_n<N>``, the split's
    directory with N of its train rows (:func:`derive_train_subsample`, seeded by ``seed``; the
    same val and test rows); the runs are named ``split_<seed>_n<N>``.  ``preprocess=False``
    reuses ``work/data_<seed>`` (preprocessed by an earlier call for this seed).
    Each run's console output goes to ``work/logs/<run name>.log`` (the run's earlier logs removed first), or to the
    console with ``verbose``.

    Returns:
        ``{"seed", "size", "train_rows", "test_rows", "dlrm_val_auc", "dlrm_test_auc", "lr_val_auc",
        "lr_test_auc", "C", "dlrm_test_logits", "lr_test_logits", "test_labels"}`` (the arrays
        ``[n]`` float64; ``size`` the ``--train-rows`` entry, e.g. ``"2500"`` or ``"all"``;
        ``train_rows`` the rows both models trained on).
    """
    from dlrmctl.data.columnar import read_meta
    from dlrmctl.train.reload import run_logits
    from dlrmctl.metrics import compute_metrics_from_logits
    from dlrmctl.train.worker import run_training

    data = work / f"data_{seed}"
    for old in _split_logs(work, seed, train_rows, ensemble):
        old.unlink()  # an earlier invocation's: an error now must not point at it
    if preprocess:
        preprocess_split(input_file, data, seed, val_ratio, test_ratio)
    if train_rows is not None:
        sub = work / f"data_{seed}_n{train_rows}"
        derive_train_subsample(data, sub, train_rows, seed)
        data = sub
    used = int(read_meta(data)["splits"]["train"]["rows"])
    zs, vs = [], []
    for m in range(ensemble):
        name = run_name(seed, train_rows) + (f"_m{m}" if ensemble > 1 else "")
        log_path = None if verbose else work / "logs" / f"{name}.log"
        with _console_to(log_path):
            summary = run_training(config, list(overrides) + [f"data.path={data}", f"name={name}",
                                                              f"train.run_dir={work / 'runs'}", "train.progress=false"]
                                   + ([f"train.seed={base_seed + m}"] if ensemble > 1 else []), overwrite=True)
            run_dir = work / "runs" / name
            z, y = run_logits(str(run_dir), "test", checkpoint=None)  # best-on-val when the run kept one
            zs.append(np.asarray(z, np.float64))
            if ensemble > 1:
                zv, yv = run_logits(str(run_dir), "val", checkpoint=None)
                vs.append(np.asarray(zv, np.float64))
    z = np.mean(zs, axis=0)
    dlrm_test = compute_metrics_from_logits(z, y)
    dlrm_val_auc = (float(summary["best"]["auc"]) if ensemble == 1
                    else float(compute_metrics_from_logits(np.mean(vs, axis=0), yv)["auc"]))
    lr = bc.run_baselines(str(data), "val", "test", cs, 0, out=lambda s: None, log=log, keep_logits=True)
    lz, ly = lr["logits"]["test"]
    if not np.array_equal(np.asarray(ly, np.float64), np.asarray(y, np.float64)):
        raise RuntimeError(f"split {seed}: DLRM and LR test labels differ (row order); cannot pair them")
    return {"seed": seed, "size": size_label(train_rows), "train_rows": used, "test_rows": int(len(y)),
            "dlrm_val_auc": dlrm_val_auc,
            "dlrm_test_auc": float(dlrm_test["auc"]), "lr_val_auc": float(lr["logistic_regression"]["val"]["auc"]),
            "lr_test_auc": float(lr["logistic_regression"]["test"]["auc"]), "C": lr["C"],
            "dlrm_test_logits": np.asarray(z, np.float64), "lr_test_logits": np.asarray(lz, np.float64),
            "test_labels": np.asarray(y, np.float64)}


def summarize(rows: list[dict]) -> dict:
    """The per-split rows (of one train size) -> mean paired test difference ± SE, mean val AUCs,
    mean test AUCs ± SE (``std(ddof=1) / sqrt(K)`` of the per-split AUCs), the train rows' range,
    pooled test AUCs."""
    diffs = [r["dlrm_test_auc"] - r["lr_test_auc"] for r in rows]
    mean, se = paired_stats(diffs)
    y = np.concatenate([r["test_labels"] for r in rows])
    return {
        "splits": len(rows), "diff_mean": mean, "diff_se": se,
        "train_rows_min": int(min(r["train_rows"] for r in rows)),
        "train_rows_max": int(max(r["train_rows"] for r in rows)),
        "dlrm_val_mean": float(np.mean([r["dlrm_val_auc"] for r in rows])),
        "lr_val_mean": float(np.mean([r["lr_val_auc"] for r in rows])),
        "dlrm_test_mean": float(np.mean([r["dlrm_test_auc"] for r in rows])),
        "lr_test_mean": float(np.mean([r["lr_test_auc"] for r in rows])),
        "dlrm_test_se": paired_stats([r["dlrm_test_auc"] for r in rows])[1],
        "lr_test_se": paired_stats([r["lr_test_auc"] for r in rows])[1],
        "pooled_test_rows": int(y.size),
        "dlrm_pooled_test_auc": bc.auc(y, np.concatenate([r["dlrm_test_logits"] for r in rows])),
        "lr_pooled_test_auc": bc.auc(y, np.concatenate([r["lr_test_logits"] for r in rows])),
    }


def _rows_text(s: dict) -> str:
    """A size's train rows for the tables: ``2500``, or ``12510-12624`` when the splits differ."""
    lo, hi = s["train_rows_min"], s["train_rows_max"]
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def render(rows: list[dict], s: dict, command: str | None) -> str:
    """The Markdown table and summary lines of one train size (``command`` first, when given)."""
    lines = [f"`{command}`", ""] if command else []
    lines += ["| split seed | train rows | test rows | DLRM val AUC | DLRM test AUC | LR val AUC | LR test AUC (C) | "
              "DLRM - LR test |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['seed']} | {r['train_rows']} | {r['test_rows']} | {r['dlrm_val_auc']:.4f} | "
                     f"{r['dlrm_test_auc']:.4f} | {r['lr_val_auc']:.4f} | {r['lr_test_auc']:.4f} ({r['C']:g}) | "
                     f"{r['dlrm_test_auc'] - r['lr_test_auc']:+.4f} |")
    lines += ["",
              f"mean paired test difference DLRM - LR over {s['splits']} splits: {s['diff_mean']:+.4f} "
              f"± {s['diff_se']:.4f} (SE)",
              f"mean val AUC: DLRM {s['dlrm_val_mean']:.4f}, LR {s['lr_val_mean']:.4f}; "
              f"mean test AUC: DLRM {s['dlrm_test_mean']:.4f}, LR {s['lr_test_mean']:.4f}",
              f"pooled test AUC ({s['pooled_test_rows']} rows of all splits): DLRM {s['dlrm_pooled_test_auc']:.4f}, "
              f"LR {s['lr_pooled_test_auc']:.4f}"]
    return "\n".join(lines) + "\n"


def render_curve(curve: list[dict]) -> str:
    """The learning-curve table: one line per train size (``curve``: ``[{"size", "summary"}]``)."""
    lines = ["| train rows | DLRM test AUC (mean ± SE) | LR test AUC (mean ± SE) | "
             "paired DLRM - LR (mean ± SE) | splits |",
             "|---|---|---|---|---|"]
    for c in curve:
        s = c["summary"]
        rows = _rows_text(s) + (" (all)" if c["size"] == ALL else "")
        lines.append(f"| {rows} | {s['dlrm_test_mean']:.4f} ± {s['dlrm_test_se']:.4f} | "
                     f"{s['lr_test_mean']:.4f} ± {s['lr_test_se']:.4f} | "
                     f"{s['diff_mean']:+.4f} ± {s['diff_se']:.4f} | "
                     f"{s['splits']} |")
    return "\n".join(lines) + "\n"


def render_all(rows: list[dict], sizes: list[int | None], command: str, note: str | None = None) -> tuple[str, list]:
    """The whole report of ``rows`` (any sizes, any splits done; each size with >= 2 splits gets its
    table): one size without ``--train-rows`` -> :func:`render`'s layout; several -> a section per
    size, then the learning curve.  ``note`` (e.g. partial) goes under the command.
    Returns ``(text, curve)``, ``curve = [{"size", "summary"}]``."""
    curve, parts = [], []
    for n in sizes:
        rs = [r for r in rows if r["size"] == size_label(n)]
        if len(rs) < 2:
            continue
        s = summarize(rs)
        curve.append({"size": size_label(n), "summary": s})
        parts.append((n, rs, s))
    head = [f"`{command}`", ""] + ([note, ""] if note else [])
    if sizes == [None]:
        body = render(parts[0][1], parts[0][2], None) if parts else ""
        return "\n".join(head) + body, curve
    text = "\n".join(head)
    for n, rs, s in parts:
        text += f"### train rows: {size_label(n)}\n\n" + render(rs, s, None) + "\n"
    if curve:
        text += "### learning curve\n\n" + render_curve(curve)
    return text, curve


def run(input_file: str, config: str, overrides: list[str], splits: int = 5, first_seed: int = 0,
        work: str = "runs/criteo_cv", val_ratio: float = 0.15, test_ratio: float = 0.15, cs=bc.DEFAULT_CS,
        out: str | None = None, log=None, ensemble: int = 1, verbose: bool = False, threads: int = 1,
        train_rows: list[int | None] | None = None) -> dict:
    """Run the K splits (see the module docstring); returns ``{"rows": [...], "summary": {...},
    "curve": [{"size", "summary"}]}`` (the rows without their logit arrays, every size's; the
    summary of the last size, e.g. ``all``; the curve one summary per size).  ``train_rows``: the
    sizes (:func:`parse_train_rows`; default ``[None]``, all of each split's train rows).
    ``log`` gets one progress line per split and size (default stderr); the training runs' own
    output goes to ``work/logs/`` unless ``verbose``; ``threads``: torch's intra-op threads for
    the runs (set after the arguments are checked).  With ``out``, the splits done so far are
    written there after each split (marked partial) until the last one completes the file.

    Raises:
        FileNotFoundError: ``input_file`` or ``config`` missing.
        ValueError: a bad argument (:func:`check_args`).
        dlrmctl.config.ConfigError: a bad config or override.
        SplitError: a split's preprocessing, training or scoring refused the data or the
            configuration (the message names the split, the ``--set`` overrides and the run's log).
    """
    from dlrmctl.errors import UserError

    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    sizes = list(train_rows) if train_rows else [None]
    cfg = check_args(input_file, config, overrides, splits, first_seed, val_ratio, test_ratio, cs, ensemble,
                     threads, out=out, train_rows=sizes)
    import torch

    torch.set_num_threads(threads)
    work_p = Path(work)
    rows = []
    set_args = [a for o in overrides for a in ("--set", o)]
    sets = (" " + shlex.join(set_args)) if set_args else ""
    # every option that changes the figures, quoted: running the recorded command gives this table again
    inputs = [input_file] if isinstance(input_file, str) else list(input_file)
    command = shlex.join(["python", "scripts/criteo_cv.py"] + [a for f in inputs for a in ("--input", str(f))]
                         + ["--config", str(config),
                          "--splits", str(splits), "--first-seed", str(first_seed), "--val-ratio", f"{val_ratio:g}",
                          "--test-ratio", f"{test_ratio:g}", "--C", ",".join(f"{c:g}" for c in cs)]
                         + (["--train-rows", ",".join(size_label(n) for n in sizes)] if sizes != [None] else [])
                         + (["--ensemble", str(ensemble)] if ensemble > 1 else []) + set_args)

    def plain(rs):
        return [{k: v for k, v in r.items() if not isinstance(v, np.ndarray)} for r in rs]

    def write(text, curve, partial):
        write_text_atomic(Path(out), text)
        write_text_atomic(Path(out).with_suffix(".json"),
                          json.dumps({"command": command, "partial": partial, "rows": plain(rows),
                                      "summary": curve[-1]["summary"] if curve else None, "curve": curve},
                                     indent=1) + "\n")

    for k, seed in enumerate(range(first_seed, first_seed + splits)):
        for i, n in enumerate(sizes):
            t0 = time.perf_counter()
            try:
                r = run_split(config, overrides, input_file, work_p, seed, val_ratio, test_ratio, cs,
                              log=lambda s: None, ensemble=ensemble, verbose=verbose, base_seed=cfg.train.seed,
                              train_rows=n, preprocess=i == 0)
            except (UserError, ValueError) as e:
                msg = " ".join(str(e).split())  # one line, whatever the error's own layout
                logs = sorted(_split_logs(work_p, seed, n, ensemble),
                              key=lambda f: f.stat().st_mtime)  # the failed run's log: the newest of this split
                where = f"; its training log: {logs[-1]}" if logs and not verbose else ""
                at = "" if sizes == [None] else f", --train-rows {size_label(n)}"
                raise SplitError(f"split {seed}{at} (config {config}{sets or ', no --set'}): {msg}{where}") from e
            at = "" if sizes == [None] else f", train rows {r['train_rows']}"
            log(f"split {seed}{at}: DLRM val {r['dlrm_val_auc']:.4f} test {r['dlrm_test_auc']:.4f} | LR val "
                f"{r['lr_val_auc']:.4f} test {r['lr_test_auc']:.4f} ({time.perf_counter() - t0:.0f}s; run "
                f"{work_p / 'runs' / run_name(seed, n)}{'_m*' if ensemble > 1 else ''})")
            rows.append(r)
        if out and 2 <= k + 1 < splits:  # what is done so far, should the run be stopped
            write(*render_all(rows, sizes, command, f"**partial**: {k + 1} of {splits} splits done when this "
                                                    "was written (the run went on, or was stopped)"), True)
    text, curve = render_all(rows, sizes, command)
    print(text, end="")
    if out:
        write(text, curve, False)
    return {"rows": plain(rows), "summary": curve[-1]["summary"], "curve": curve}


def _fail(msg: str) -> None:
    """One ``error: ...`` line on stderr and exit status 2 (no usage text: the arguments parsed)."""
    print(f"error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _description() -> str:
    """The module docstring's first paragraph as one line (``--help``)."""
    return " ".join(__doc__.split("\n\n")[0].split())


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each option's default, except the empty ones (no ``--out``, no ``--set``, a flag)."""

    def _get_help_string(self, action):
        if action.default in (None, [], False):
            return action.help
        return super()._get_help_string(action)


def main(argv: list[str] | None = None) -> dict:
    """CLI entry: see the module docstring."""
    p = argparse.ArgumentParser(description=_description(), formatter_class=_DefaultsHelp)
    p.add_argument("--input", action="append", default=None,
                   help=f"Criteo TSV to split (repeatable or a glob: the files preprocessed together; "
                        f"default {DEFAULT_INPUT})")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="experiment YAML every split trains")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every split's training (repeatable; not data.path, name, "
                        "train.run_dir, train.progress, nor train.seed with --ensemble: the script sets them)")
    p.add_argument("--splits", type=int, default=5, help="K split seeds (>= 2)")
    p.add_argument("--ensemble", type=int, default=1,
                   help="DLRMs per split (train.seed + 0..N-1), their logits averaged (1: one model)")
    p.add_argument("--first-seed", type=int, default=0, help="the first split seed")
    p.add_argument("--work", default="runs/criteo_cv",
                   help="where each split's data (data_<seed>), run (runs/) and training log (logs/) go")
    p.add_argument("--val-ratio", type=float, default=0.15, help="share of rows in each split's val, in (0, 1)")
    p.add_argument("--test-ratio", type=float, default=0.15, help="share of rows in each split's test, in (0, 1)")
    p.add_argument("--C", default=",".join(f"{c:g}" for c in bc.DEFAULT_CS),
                   help="comma-separated inverse L2 strengths of the LR (chosen on val per split)")
    p.add_argument("--train-rows", action="append", default=None, metavar="N[,N...]",
                   help=f"train rows per split: comma-separated sizes and/or '{ALL}' (repeatable); each size "
                        "trains both models on N of the split's train rows (nested, seeded by the split seed; "
                        "vocabulary rebuilt on them), val and test unchanged; a learning curve (default: all)")
    p.add_argument("--out", default=None, help="also write the table here (Markdown) and as .json next to it")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="show each run's training output instead of writing it to WORK/logs/")
    a = p.parse_args(argv)
    a.input = a.input or [DEFAULT_INPUT]
    if a.config == DEFAULT_CONFIG:  # the repository's, from whatever directory the script is run
        a.config = str(REPO / DEFAULT_CONFIG)
    from dlrmctl.config import ConfigError

    try:
        cs = bc.parse_cs(a.C)
        sizes = parse_train_rows(a.train_rows)
        return run(a.input, a.config, a.overrides, a.splits, a.first_seed, a.work, a.val_ratio, a.test_ratio, cs,
                   a.out, ensemble=a.ensemble, verbose=a.verbose, threads=a.threads, train_rows=sizes)
    except (FileNotFoundError, ValueError, ConfigError, SplitError) as e:
        _fail(" ".join(str(e).split()))


if __name__ == "__main__":
    main()
