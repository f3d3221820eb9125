"""``dlrmctl preprocess logs``: any click log described by a schema -> columnar shards + ``meta.json``.

Passes, each one task per input file on the worker pool of :mod:`dlrmctl.data.criteo.parallel`
(memory: one block per worker, plus one feature's counts while merging):

0. with ``split_by='time'``: the time column's distinct values are counted; the latest ones make
   the test split (``test_ratio`` of the rows), the ones before them val; a time value is never
   cut between two splits; with ``split.group``, each group's latest rows (:mod:`.split`).  Side
   tables (``join``) are read and written to ``vocab/join_<i>.arrow`` first (:mod:`.join`).
1. when a feature has ``vocab`` or ``ids: raw``, or a dense column ``standardize``: the train
   rows' categorical keys are counted into ``.counts/<part>.arrow`` (one record batch per counted
   feature) and the train rows' dense sums are returned; every decoded row is kept in
   ``.counts/<part>.decoded.arrow`` (:mod:`dlrmctl.data.logs.cache`) for pass 2, so a file is
   parsed once; the counts are merged one feature at a
   time into ``vocab/<feature>.arrow`` (:func:`dlrmctl.data.criteo.vocab.build_vocab`: ``value``
   = the key, ``count``; row ``i`` = id ``i``, most frequent first, ties by key).
2. every row is transformed (:mod:`dlrmctl.data.logs.transform`) and written to
   ``parts/<part>/{train,val,test}.arrow`` with a ``done.json``; a finished part whose fingerprint
   (schema, options, input size and mtime, vocabularies) matches is skipped (resume); it reads
   pass 1's decoded rows when they are there with pass 1's fingerprint, else parses the file.

Splits by row hash are Criteo's (:func:`dlrmctl.data.criteo.parse.row_split_codes` of the file's
base name and the physical line, or Parquet's 1-based row).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dlrmctl.data.columnar import (
    LABEL_COLUMN,
    SPLITS,
    DataError,
    shard_schema,
    write_json_atomic,
    write_meta,
)
from dlrmctl.data.checksums import sha256_file
from dlrmctl.data.columnar.parts import DONE_FILE, PartBuild, finished_part, fingerprint, part_fingerprint
from dlrmctl.data.criteo import vocab as _vocab
from dlrmctl.data.file_cache import FileCache
from dlrmctl.data.criteo.parallel import Progress, report_rows, run_tasks
from dlrmctl.data.criteo.parse import expand_inputs, row_split_codes
from dlrmctl.data.criteo.preprocess import PreprocessReport
from dlrmctl.data.logs.bags import latest_train_times, prepare_bags, without_bags
from dlrmctl.data.logs.cache import DecodedCache, read_cache, remove_cache
from dlrmctl.data.logs.derived import CountTable, count_paths, finish_dense, write_count_tables
from dlrmctl.data.logs.join import prepare_joins, recorded
from dlrmctl.data.logs.meta import dataset_meta
from dlrmctl.data.logs.options import LogOptions
from dlrmctl.data.logs.read import file_columns, iter_batches
from dlrmctl.data.logs.schema import LogSchema
from dlrmctl.data.logs.split import GroupCutoffs, concat_keys, group_cutoffs, split_mode, time_cutoffs
from dlrmctl.data.logs.transform import VocabLookup, decode, dense_values, table_rows, vocab_path
from dlrmctl.data.logs.vocab_rules import drop_outside, finish_vocabs

__all__ = ["LogOptions", "preprocess_logs"]

# A feature's counts of later blocks are summed into its first table once they hold this many rows
# (2 MiB) or as many as that table, whichever is more (:func:`_count_block`).
FOLD_ROWS = 1 << 17


@dataclasses.dataclass
class LogTask:
    """One input file's work in a pass (picklable: sent to the worker pool)."""

    path: str
    part: str
    schema: LogSchema
    opts: LogOptions
    out_dir: str
    fingerprint: str = ""
    cutoffs: tuple[float, float] | None = None  # time split: (first val time, first test time)
    dense_stats: dict | None = None
    table_sizes: list[int] | None = None
    cache_fingerprint: str = ""  # pass 1's fingerprint: pass 2 reads its decoded blocks when they match
    groups: GroupCutoffs | None = None  # per-group time split


def _stat(d) -> bool:
    """Whether pass 1 sums a dense column's train values (its mean and std are used)."""
    return d.transform == "standardize" or d.fill == "mean"


def _counted(schema: LogSchema) -> list[int]:
    return [i for i, c in enumerate(schema.categorical) if c.mode in ("vocab", "raw")]


def _split_codes(task: LogTask, d) -> np.ndarray:
    n = len(d.keys)
    if task.schema.label is None:
        return np.full(n, 2, np.int8)
    if task.groups is not None:
        return task.groups.codes(d.group, d.time, d.order)
    if task.opts.split_by == "time":
        t_val, t_test = task.cutoffs
        return np.where(d.time >= t_test, 2, np.where(d.time >= t_val, 1, 0)).astype(np.int8)
    return row_split_codes(d.keys, task.part, task.opts.seed, task.opts.val_ratio, task.opts.test_ratio)


def _blocks(task: LogTask):
    for b in iter_batches(task.path, task.schema, task.opts.on_bad_line, task.opts.block_size):
        d = decode(b, task.schema, task.opts.on_bad_line)
        report_rows(b.num_rows + b.bad_skipped)
        yield d


# ----------------------------------------------------------------------------- pass 0 / 1
def time_counts(task: LogTask) -> pa.Table:
    """Pass 0: distinct values of the time column and their row counts (``value``, ``count`` int64)."""
    acc = []
    for d in _blocks(task):
        vc = pc.value_counts(pa.array(d.time))
        acc.append(pa.table({"value": vc.field("values"), "count": vc.field("counts")}))
        if len(acc) >= 8:
            acc = [_vocab.merge_counts(acc)]
    return _vocab.merge_counts(acc) if acc else pa.table({"value": pa.array([], pa.int64()),
                                                          "count": pa.array([], pa.int64())})


def group_rows(task: LogTask) -> tuple[np.ndarray, ...]:
    """Pass 0 of a per-group split: ``(group, time, tiebreak)`` ``[n]`` int64 of the file's good rows."""
    return concat_keys([(d.group, d.time, d.order) for d in _blocks(task)])


def count_task(task: LogTask) -> dict:
    """Pass 1: count the train rows' keys of the counted features into ``.counts/<part>.arrow`` and
    return the train rows' dense sums ``{name: [n, sum, sum of squares]}`` (reused when its
    fingerprint matches)."""
    out = Path(task.out_dir) / ".counts" / f"{task.part}.arrow"
    done = out.with_suffix(".done.json")
    if done.is_file() and out.is_file():
        st = json.loads(done.read_text())
        if st.get("fingerprint") == task.fingerprint:
            report_rows(-1)
            return st["dense"]
    counted = _counted(task.schema)
    acc: list[list[pa.Table]] = [[] for _ in counted]
    sums = {d.name: [0, 0.0, 0.0] for d in task.schema.dense if _stat(d)}
    cache = DecodedCache(task.out_dir, task.part, task.schema)
    try:
        for d in _blocks(task):
            cache.write(d)
            _count_block(task, d, counted, acc, sums)
    except BaseException:
        cache.abort()
        raise
    cache.close(task.fingerprint)
    _vocab.write_count_file(out, acc)
    write_json_atomic(done, {"fingerprint": task.fingerprint, "dense": sums})
    return sums


def _count_block(task: LogTask, d, counted: list[int], acc: list[list[pa.Table]], sums: dict) -> None:
    """Fold one decoded block's train rows into the per-feature counts ``acc`` and dense ``sums``.

    A feature's later blocks' counts are summed into its first table once they hold ``FOLD_ROWS``
    rows or as many as that table: memory stays within about twice the distinct values so far, and
    summing costs at most twice the rows counted (summing every few blocks summed a file's distinct
    values again every few blocks)."""
    train = _split_codes(task, d) == 0
    for spec, x in zip(task.schema.dense, d.dense):
        if spec.name in sums:
            xt = x[train]
            xt = xt[~np.isnan(xt)] if spec.fill == "mean" else xt  # the present values' mean fills the others
            s = sums[spec.name]
            s[0] += int(len(xt))
            s[1] += float(xt.sum())
            s[2] += float(np.square(xt).sum())
    for j, f in enumerate(counted):
        v = d.categorical[f]
        vc = pc.value_counts(pa.array(v.keys[v.present & (train if v.lengths is None else np.repeat(train, v.lengths))]))
        acc[j].append(pa.table({"value": vc.field("values"), "count": vc.field("counts")}))
        first, rest = acc[j][0], acc[j][1:]
        if sum(t.num_rows for t in rest) >= max(FOLD_ROWS, first.num_rows):
            acc[j] = [_vocab.merge_counts(acc[j])]
        elif len(rest) >= 64:  # many blocks of few values: their counts summed among themselves
            acc[j] = [first, _vocab.merge_counts(rest)]


# ----------------------------------------------------------------------------- pass 2
#: the vocabularies a pass-2 worker has read, by file version (a worker writes parts of one dataset)
_LOOKUPS: FileCache[VocabLookup] = FileCache(VocabLookup.read, limit=256)


def _bag_array(ids: np.ndarray, lengths: np.ndarray, dtype) -> pa.Array:
    offs = np.zeros(len(lengths) + 1, np.int32)
    np.cumsum(lengths, out=offs[1:])
    return pa.ListArray.from_arrays(pa.array(offs), pa.array(ids, dtype))


def write_task(task: LogTask) -> dict:
    """Pass 2: transform one input file into ``parts/<part>/{train,val,test}.arrow`` + ``done.json``
    (built in ``parts/<part>.tmp``, renamed when complete).

    Returns:
        The part's statistics (also in ``done.json``).

    Raises:
        DataError: a bad row (``on_bad_line='error'``), naming the file, line / row and column.
    """
    t0 = time.perf_counter()
    s = task.schema
    dense_names = [d.name for d in s.dense]
    names = [c.name for c in s.categorical]
    schema = shard_schema(dense_names, names, [c.multi for c in s.categorical], labelled=s.label is not None,
                          weighted=[c.weights is not None for c in s.categorical])
    vocabs = [_LOOKUPS.get(vocab_path(task.out_dir, c.name)) if c.mode == "vocab" else None for c in s.categorical]
    counts = {n: CountTable(Path(task.out_dir) / p) for n, p in count_paths(s).items()}
    k = len(names)
    stats: dict[str, Any] = {"rows": {sp: 0 for sp in SPLITS}, "positives": {sp: 0 for sp in SPLITS},
                             "missing": [0] * k, "train_values": [0] * k, "max_len": [0] * k, "bad_lines": 0}
    cached = read_cache(task.out_dir, task.part, task.cache_fingerprint, s) if task.cache_fingerprint else None
    with PartBuild(task.out_dir, task.part, schema) as build:  # any failure or Ctrl-C removes the temp part
        for d in cached if cached is not None else _blocks(task):
            d, all_ids = drop_outside(s, d, vocabs, task.path, task.opts.on_bad_line)
            stats["bad_lines"] += d.bad
            n = len(d.keys)
            if n == 0:
                continue
            codes = _split_codes(task, d)
            finish_dense(d, s, task.dense_stats or {}, counts)
            dense = dense_values(d, s, task.dense_stats or {})
            for f, (spec, v) in enumerate(zip(s.categorical, d.categorical)):
                stats["missing"][f] += int((v.lengths == 0).sum() if spec.multi else (~v.present).sum())
            for si, split in enumerate(SPLITS):
                sel = codes == si
                m = int(sel.sum())
                if m == 0:
                    continue
                cols: dict[str, Any] = {}
                if s.label is not None:
                    cols[LABEL_COLUMN] = lab = d.label[sel]
                    stats["positives"][split] += int(lab.sum())
                for name, x in zip(dense_names, dense):
                    cols[name] = x[sel]
                for f, (spec, v) in enumerate(zip(s.categorical, d.categorical)):
                    if spec.multi:
                        elem = np.repeat(sel, v.lengths)
                        lengths = v.lengths[sel]
                        cols[spec.name] = _bag_array(all_ids[f][elem], lengths, pa.int64())
                        if split == "train":
                            stats["train_values"][f] += int(lengths.sum())
                            stats["max_len"][f] = max(stats["max_len"][f], int(lengths.max(initial=0)))
                        if spec.weights:
                            cols[spec.name + "__weight"] = _bag_array(v.weights[elem], lengths, pa.float32())
                    else:
                        cols[spec.name] = all_ids[f][sel]
                        if spec.weights:
                            cols[spec.name + "__weight"] = v.weights[sel]
                build.writers[split].write(cols)
                stats["rows"][split] += m
        stats.update(seconds=time.perf_counter() - t0, fingerprint=task.fingerprint, input=task.path)
        build.commit(stats)
    remove_cache(task.out_dir, task.part)  # the part is in place: pass 1's decoded blocks are spent
    return stats


# ----------------------------------------------------------------------------- driver
def preprocess_logs(schema: LogSchema, inputs: str | os.PathLike | Sequence[str | os.PathLike],
                    out_dir: str | os.PathLike, options: LogOptions | None = None,
                    progress: bool = True) -> PreprocessReport:
    """Preprocess click logs described by ``schema`` into a columnar directory (module docstring).

    Args:
        schema: :func:`dlrmctl.data.logs.schema.load_schema`.
        inputs: a file, a directory, a glob, or a list of those.
        out_dir: output directory (created; re-running resumes).
        options: :class:`LogOptions`.
        progress: print a rows/s progress line on stderr.

    Returns:
        :class:`dlrmctl.data.criteo.PreprocessReport`.

    Raises:
        ValueError: inconsistent options.
        DataError: no input, an empty input, a missing or unnamed column, a bad row
            (``on_bad_line='error'``).
    """
    t0 = time.perf_counter()
    o = dataclasses.replace(options) if options is not None else LogOptions()
    o.validate(schema)
    o.split_by = split_mode(o.split_by, schema)
    files = expand_inputs(inputs)
    for f in files:
        schema.format_of(f)
    out = Path(out_dir)
    (out / "parts").mkdir(parents=True, exist_ok=True)
    schema, joins = prepare_joins(schema, files, out) if schema.join else (schema, [])
    common = {"schema": recorded(schema).to_dict(), "opts": {
        k: v for k, v in dataclasses.asdict(o).items() if k not in ("workers",)},
        **({"joins": [sha256_file(out / j["file"]) for j in joins]} if joins else {})}

    def task(f: Path, **kw) -> LogTask:
        return LogTask(str(f), f.name, schema, o, str(out), **kw)

    rows_read = 0

    def run(fn, label: str, tasks: list[LogTask]) -> list:  # one pass over the worker pool
        nonlocal rows_read
        prog = Progress(label, len(tasks), progress)
        got = run_tasks(fn, tasks, o.workers, prog)
        prog.show(final=True)
        rows_read += prog.rows
        return got

    cutoffs = groups = None
    pass0 = [dataclasses.replace(task(f), schema=without_bags(schema)) for f in files]  # (before the bags exist)
    if o.split_by == "time" and schema.split is not None and schema.split.group:
        keys0 = concat_keys(run(group_rows, "logs pass 0 (groups)", pass0))
        groups = group_cutoffs(*keys0, o.val_ratio, o.test_ratio)
        if not groups.train_rows and len(groups.groups):  # (an empty input is said below)
            raise DataError(f"the per-group time split leaves no rows to train on with --val-ratio {o.val_ratio} "
                            f"--test-ratio {o.test_ratio} (too few rows per group)", path=str(inputs))
        common["groups"] = groups.digest()
    elif o.split_by == "time":  # one global cut
        cutoffs = time_cutoffs(_vocab.merge_counts(run(time_counts, "logs pass 0 (time)", pass0)), o, str(inputs))
    if any(j.many for j in schema.join):  # side tables aggregated into bags: after the split
        schema, bag_info = prepare_bags(schema, files, out, latest_train_times(groups, *keys0) if groups else None)
        joins += bag_info
        common["joins"] = [sha256_file(out / j["file"]) for j in joins]
    counted = _counted(schema)
    fp1: dict[Path, str] = {}
    dense_stats: dict[str, tuple[float, float]] = {}
    vocab_info: dict[int, dict] = {}
    if counted or any(_stat(d) for d in schema.dense):
        fp1 = {f: part_fingerprint(f, {**common, "cutoffs": cutoffs, "pass": 1}) for f in files}
        tasks = [task(f, cutoffs=cutoffs, groups=groups, fingerprint=fp1[f]) for f in files]
        sums = run(count_task, "logs pass 1 (count)", tasks)
        for d in schema.dense:
            if _stat(d):
                n = sum(s[d.name][0] for s in sums)
                mean = sum(s[d.name][1] for s in sums) / n if n else 0.0
                var = sum(s[d.name][2] for s in sums) / n - mean * mean if n else 0.0
                dense_stats[d.name] = (mean, float(np.sqrt(max(var, 0.0))))
        if counted:
            info = _vocab.build_vocab([str(out / ".counts" / f"{f.name}.arrow") for f in files], out / "vocab",
                                      [schema.categorical[i].min_count if schema.categorical[i].mode == "vocab"
                                       else None for i in counted], [schema.categorical[i].name for i in counted])
            vocab_info = finish_vocabs(schema, files, out, dict(zip(counted, info)),
                                       lambda fn, label: run(fn, label, [task(f) for f in files]))
            write_count_tables(schema, counted, [str(out / ".counts" / f"{f.name}.arrow") for f in files], out)
    sizes = [table_rows(c, vocab_info.get(i, {}).get("size"), vocab_info.get(i, {}).get("distinct_train_values"))
             for i, c in enumerate(schema.categorical)]
    vocab_fp = fingerprint([sha256_file(vocab_path(out, c.name)) for c in schema.categorical if c.mode == "vocab"]
                           + [sha256_file(out / p) for p in count_paths(schema).values()])
    tasks, done_stats, skipped = [], {}, 0
    for f in files:
        fp = part_fingerprint(f, {**common, "cutoffs": cutoffs, "vocab": vocab_fp, "dense": dense_stats,
                           "pass": 2})
        st = finished_part(out, f.name, fp)
        if st is not None:
            done_stats[f], skipped = st, skipped + 1
            continue
        tasks.append(task(f, fingerprint=fp, cutoffs=cutoffs, groups=groups, dense_stats=dense_stats,
                          table_sizes=sizes, cache_fingerprint=fp1.get(f, "")))
    for t, st in zip(tasks, run(write_task, "logs", tasks)):
        done_stats[Path(t.path)] = st
    shutil.rmtree(out / ".counts", ignore_errors=True) if all(
        (out / "parts" / f.name / DONE_FILE).is_file() for f in files) else None
    meta = dataset_meta(recorded(schema), o, files, done_stats, sizes, vocab_info, dense_stats, cutoffs or (None, None))
    if joins:
        meta["joins"] = joins
        meta["vocab_files"].update({f"join:{i}": j["file"] for i, j in enumerate(joins)})
    if groups is not None:
        meta["transforms"]["split"] = groups.describe(schema.time, schema.split, o.val_ratio, o.test_ratio)
    meta["input_format"] = schema.format_of(files[0])
    meta["input_columns"] = file_columns(files[0], schema)  # the order raw text rows are read in
    if not sum(meta["splits"][s]["rows"] for s in SPLITS):
        raise DataError("no rows to preprocess (empty input" + (f", {meta['bad_lines_skipped']:,} bad lines "
                        "skipped)" if meta["bad_lines_skipped"] else ")"), path=str(inputs))
    elapsed = time.perf_counter() - t0
    meta["rows_per_s"] = rows_read / elapsed if elapsed > 0 else None
    write_meta(out, meta)
    return PreprocessReport(out, {s: meta["splits"][s]["rows"] for s in SPLITS}, meta["bad_lines_skipped"],
                            len(tasks), skipped, elapsed, rows_read / elapsed if elapsed > 0 else 0.0)
