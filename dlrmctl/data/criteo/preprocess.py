"""``dlrmctl preprocess criteo``: the passes over the input files and the output ``meta.json``.

Each input file is parsed once.  Hashing mode has one pass: :func:`process_file` parses a file
and writes ``parts/<name>/{train,val,test}.arrow``.  Vocabulary mode has two: pass 1
(:func:`dlrmctl.data.criteo.vocab.count_file`) parses a file, counts its train rows' categorical
values into ``.counts/<name>.arrow`` and writes its decoded rows to ``.decoded/<name>.arrow``
(:mod:`dlrmctl.data.criteo.decoded`: at most 164.25 bytes per row, ~0.7x the TSV; all files' rows
exist together until pass 2 consumes them); the counts are merged one feature at a time into
``vocab/<feature>.arrow`` (:func:`~dlrmctl.data.criteo.vocab.build_vocab`); pass 2
(:func:`process_file`) maps the decoded rows to ids and deletes them.  The passes run one task per
input file on the worker pool of :mod:`dlrmctl.data.criteo.parallel`.

Resume: pass 1's outputs carry a fingerprint of the options and the input's size and mtime and
are reused when it matches; a finished part (``parts/<name>/done.json`` with the pass-2
fingerprint, which includes the vocabulary's hash) is skipped.  A file is parsed again only when
its counts or its decoded rows are stale or missing and its part still has to be written.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa

from dlrmctl.data.columnar import (
    IDS_KEY,
    IDS_RAW,
    LABEL_COLUMN,
    SPLITS,
    DataError,
    shard_schema,
    write_meta,
)
from dlrmctl.data.checksums import sha256_file
from dlrmctl.data.columnar.parts import (DONE_FILE, PartBuild, finished_part, fingerprint, part_fingerprint, parts_meta,
                                         split_rows)
from dlrmctl.data.criteo import decoded as _decoded
from dlrmctl.data.criteo import vocab as _vocab
from dlrmctl.data.criteo.parallel import Progress, report_rows, run_tasks
from dlrmctl.data.criteo.inputs import DAY_RE, count_lines, expand_inputs, num_fields
from dlrmctl.data.criteo.parse import (
    DENSE_FEATURES,
    DLRM_LOG_SOURCE,
    NUM_SPARSE,
    SPARSE_FEATURES,
    CriteoOptions,
    FileTask,
    ids_of,
    read_blocks,
    split_of_block,
)
from dlrmctl.data.multi_hot import MULTI_HOT_CACHE_VECTORS, multi_hot_expand

__all__ = ["PreprocessReport", "preprocess_criteo", "process_file"]


def _parsed_batches(task: FileTask) -> Iterator[tuple[_decoded.DecodedBatch | None, int]]:
    """Hashing mode: parse the TSV; yields ``(batch, bad lines)``, ``(None, 0)`` on a careful restart."""
    for blk in read_blocks(task):
        if blk is None:
            yield None, 0
        elif len(blk.lines) == 0:
            yield _decoded.DecodedBatch(np.zeros(0, np.int8), None, [], [], []), blk.bad_skipped
        else:
            yield (_decoded.DecodedBatch(split_of_block(task, blk), blk.label, blk.dense, blk.sparse_h,
                                         blk.sparse_present), blk.bad_skipped)


def _decoded_batches(task: FileTask) -> Iterator[tuple[_decoded.DecodedBatch | None, int]]:
    """Vocabulary mode: pass 1's decoded rows of the file; the bad lines come from its marker."""
    path, _ = _decoded.decoded_paths(task.out_dir, task.part)
    m = _decoded.read_marker(task.out_dir, task.part, task.decoded_fingerprint)
    if m is None:
        raise DataError("pass 1's decoded rows are missing or stale (expected a complete "
                        f"{path} for this input); rerun the preprocess", path=task.path)
    yield _decoded.DecodedBatch(np.zeros(0, np.int8), None, [], [], []), int(m["bad_lines"])
    for b in _decoded.read_decoded(path, task.labelled):
        yield b, 0


def process_file(task: FileTask) -> dict:
    """Transform one input file into ``parts/<part>/{train,val,test}.arrow`` + ``done.json``.

    Hashing mode parses the TSV; vocabulary mode reads pass 1's decoded rows
    (``.decoded/<part>.arrow``, memory-mapped, one record batch per CSV block) and deletes them
    once the part is in place.  Either way one record batch per CSV block and split is written,
    so the shards are byte-identical.  Writes into ``parts/<part>.tmp`` and renames it when
    complete, so a crash leaves no half-finished part that could be taken for a finished one.

    Returns:
        The part's statistics (also written to ``done.json``).

    Raises:
        DataError: a bad line (hashing mode, ``on_bad_line='error'``); missing or stale decoded
            rows (vocabulary mode).
    """
    t0 = time.perf_counter()
    o = task.opts
    vocabs = _vocab.VocabSet.of_dir(task.vocab_dir) if o.mode == "vocab" else None  # loaded lazily
    mh = o.multi_hot_sizes or [1] * NUM_SPARSE
    schema = shard_schema(DENSE_FEATURES, SPARSE_FEATURES, [s > 1 for s in mh], labelled=task.labelled)
    stats = _new_stats()
    source = _decoded_batches(task) if o.mode == "vocab" else _parsed_batches(task)
    with PartBuild(task.out_dir, task.part, schema) as build:  # any failure or Ctrl-C removes the temp part
        for blk, bad in source:
            if blk is None:  # restart in careful mode
                build.restart()
                stats = _new_stats()
                continue
            stats["bad_lines"] += bad
            nrows = len(blk.codes)
            if nrows == 0:
                continue
            codes = blk.codes
            ids = ids_of(o, blk.sparse_h, blk.sparse_present, vocabs)
            for f in range(NUM_SPARSE):
                stats["missing"][f] += int(nrows - np.count_nonzero(blk.sparse_present[f]))
            for si, split in enumerate(SPLITS):
                sel = codes == si
                k = int(np.count_nonzero(sel))
                if k == 0:
                    continue
                allsel = k == nrows
                pick = (lambda a: a) if allsel else (lambda a: a[sel])
                cols: dict[str, Any] = {}
                if task.labelled:
                    lab = pick(blk.label)
                    cols[LABEL_COLUMN] = lab
                    stats["positives"][split] += int(lab.sum())
                for name, d in zip(DENSE_FEATURES, blk.dense):
                    cols[name] = pick(d)
                for f, name in enumerate(SPARSE_FEATURES):
                    x = pick(ids[f])
                    if mh[f] > 1:
                        vals, _ = multi_hot_expand(x, task.table_sizes[f], mh[f], o.multi_hot_distribution,
                                                   seed=o.seed * 1000 + f)
                        offs = np.arange(0, (k + 1) * mh[f], mh[f], dtype=np.int32)
                        cols[name] = pa.ListArray.from_arrays(pa.array(offs), pa.array(vals))
                    else:
                        cols[name] = x
                build.writers[split].write(cols)
                stats["rows"][split] += k
            report_rows(nrows)
        stats.update(seconds=time.perf_counter() - t0, fingerprint=task.fingerprint, input=task.path)
        build.commit(stats)
    _decoded.remove_decoded(task.out_dir, task.part)  # the part is in place: pass 1's rows are spent
    return stats


def _new_stats() -> dict:
    return {"rows": {s: 0 for s in SPLITS}, "positives": {s: 0 for s in SPLITS},
            "missing": [0] * NUM_SPARSE, "bad_lines": 0}



@dataclasses.dataclass
class PreprocessReport:
    """What :func:`preprocess_criteo` / the synthetic generator did.

    Attributes:
        out_dir: output directory.
        rows: rows written per split.
        bad_lines: lines skipped (``on_bad_line='skip'``).
        files_processed: input files transformed in this run.
        files_skipped: input files already done by an earlier run (resumed).
        seconds: wall-clock time of the whole run.
        rows_per_s: rows read / ``seconds`` (all passes included).
    """

    out_dir: Path
    rows: dict[str, int]
    bad_lines: int
    files_processed: int
    files_skipped: int
    seconds: float
    rows_per_s: float


def preprocess_criteo(inputs: str | os.PathLike | Sequence[str | os.PathLike], out_dir: str | os.PathLike,
                      options: CriteoOptions | None = None, progress: bool = True) -> PreprocessReport:
    """Preprocess Criteo TSV files into a columnar directory (see the module docstring).

    Args:
        inputs: a file, a directory, a glob, or a list of those (plain / ``.gz`` / ``.bz2``).
        out_dir: output directory (created).  Re-running on the same directory resumes: input
            files whose part is complete (``parts/<name>/done.json`` with the same options and the
            same input size / mtime) are not redone.
        options: :class:`CriteoOptions`.
        progress: print a rows/s progress line on stderr.

    Returns:
        :class:`PreprocessReport`.

    Raises:
        ValueError: inconsistent options (message names the option).
        DataError: unreadable input or a bad line (``path:line: field X: ...``) when
            ``on_bad_line='error'``; mixed 40/39-field inputs; ``split_by_day`` with files not
            named ``day_N``.
    """
    t0 = time.perf_counter()
    o = dataclasses.replace(options) if options is not None else CriteoOptions()
    o.validate()
    files = expand_inputs(inputs)
    nf = {f: num_fields(f) for f in files}
    kinds = {n for n in nf.values() if n is not None}
    if not kinds:  # nothing to read: say so before anything is written
        raise DataError("empty file: no lines to preprocess" if len(files) == 1 else
                        f"all {len(files)} input files are empty: no lines to preprocess",
                        path=files[0] if len(files) == 1 else str(inputs))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "parts").mkdir(exist_ok=True)

    if not kinds <= {39, 40}:
        bad = next(f for f, n in nf.items() if n not in (None, 39, 40))
        raise DataError(f"expected 40 (label, I1-I13, C1-C26) or 39 (no label) tab-separated fields, "
                        f"got {nf[bad]}", path=bad, line=1)
    if kinds == {39, 40}:
        raise DataError("inputs mix labelled (40 fields) and unlabelled (39 fields) files: "
                        + ", ".join(f"{f.name}={n}" for f, n in nf.items()), path=str(inputs))
    labelled = kinds != {39}
    if not labelled and (o.val_ratio or o.test_ratio or o.split_by_day):
        raise ValueError("unlabelled (39-field) input: every row goes to the 'test' split; "
                         "--val-ratio/--test-ratio/--split-by-day do not apply")

    roles: dict[Path, str] = {}
    valtest_first: dict[Path, int] = {}
    if not labelled:
        roles = {f: "unlabelled" for f in files}
    elif o.split_by_day:
        days = {}
        for f in files:
            m = DAY_RE.match(f.name)
            if not m:
                raise DataError("--split-by-day needs files named day_N (1TB Criteo layout)", path=f)
            days[f] = int(m.group(1))
        if len(days) < 2:
            raise DataError("--split-by-day needs at least two day_N files (train days + the last day)",
                            path=str(inputs))
        last = max(days, key=days.get)
        for f in files:
            roles[f] = "valtest" if f == last else "train"
        n_last = count_lines(last)
        valtest_first[last] = (n_last + 1) // 2
    else:
        roles = {f: "ratio" for f in files}

    if o.mode == "hash":
        table_sizes = [n + 1 for n in o.num_embeddings]
    else:
        table_sizes = None  # vocab: from the vocabulary; raw: distinct train ids, once written

    def file_fingerprint(f: Path, fields: dict) -> str:  # the options and the file's role, then the pass's fields
        return part_fingerprint(f, {"seed": o.seed, "val_ratio": o.val_ratio, "test_ratio": o.test_ratio,
                                    "split_by_day": o.split_by_day, "on_bad_line": o.on_bad_line, "role": roles[f],
                                    "valtest_first": valtest_first.get(f, 0), **fields})

    rows_read = 0
    vocab_info = None
    vocab_dir = out / "vocab"
    count_tasks: dict[Path, FileTask] = {}
    deferred: set[Path] = set()
    if o.mode == "vocab":
        for f in files:
            count_tasks[f] = FileTask(str(f), f.name, roles[f], labelled, str(out), o,
                                      file_fingerprint(f, {"pass": "count", "counts_format": _vocab.COUNTS_FORMAT,
                                                           "decoded_format": _decoded.DECODED_FORMAT}),
                                      valtest_first=valtest_first.get(f, 0))
            # fresh counts but no decoded rows, and a finished part: parse again only if that part
            # turns out stale once the vocabulary is known (a resumed pass 2 deletes spent rows)
            t = count_tasks[f]
            counts = out / ".counts" / f"{f.name}.arrow"
            done_txt = counts.with_suffix(".done")
            if (done_txt.is_file() and done_txt.read_text() == t.fingerprint and counts.is_file()
                    and _decoded.read_marker(out, f.name, t.fingerprint) is None
                    and (out / "parts" / f.name / DONE_FILE).is_file()):
                deferred.add(f)
        first = [count_tasks[f] for f in files if f not in deferred]
        prog = Progress("criteo pass 1 (parse, count)", len(first), progress)
        run_tasks(_vocab.count_file, first, o.workers, prog)
        prog.show(final=True)
        rows_read += prog.rows
        count_files = [str(out / ".counts" / f"{f.name}.arrow") for f in files]
        vocab_info = _vocab.build_vocab(count_files, vocab_dir, o.threshold)
        table_sizes = [v["size"] + 2 for v in vocab_info]
        vocab_fp = fingerprint([sha256_file(vocab_dir / f"{n}.arrow")[:16] for n in SPARSE_FEATURES])
    else:
        vocab_fp = None

    mh = o.multi_hot_sizes or [1] * NUM_SPARSE
    tasks, skipped, done_stats = [], [], {}
    for f in files:
        fp = file_fingerprint(f, {"mode": o.mode, "num_embeddings": o.num_embeddings, "vocab": vocab_fp, "multi_hot": mh,
                                  "dist": o.multi_hot_distribution, "table_sizes": table_sizes})
        st = finished_part(out, f.name, fp)
        if st is not None:
            skipped.append(f)
            done_stats[f] = st
            _decoded.remove_decoded(out, f.name)  # left over if a run stopped right after the part
            continue
        tasks.append(FileTask(str(f), f.name, roles[f], labelled, str(out), o, fp,
                               vocab_dir=str(vocab_dir) if o.mode == "vocab" else None,
                               table_sizes=table_sizes, valtest_first=valtest_first.get(f, 0),
                               decoded_fingerprint=count_tasks[f].fingerprint if count_tasks else ""))
    redo = [count_tasks[Path(t.path)] for t in tasks if Path(t.path) in deferred]
    if redo:  # stale finished parts whose decoded rows an earlier run already deleted
        prog = Progress("criteo pass 1 (parse again for stale parts)", len(redo), progress)
        run_tasks(_vocab.count_file, redo, o.workers, prog)
        prog.show(final=True)
        rows_read += prog.rows
    prog = Progress("criteo", len(tasks), progress)
    try:
        results = run_tasks(process_file, tasks, o.workers, prog)
    finally:
        _vocab.clear_cache()  # in-process (1 worker) runs loaded the vocabularies here
    prog.show(final=True)
    rows_read += prog.rows
    try:
        (out / _decoded.DIR_NAME).rmdir()  # every part's decoded rows are spent
    except OSError:
        pass
    for t, st in zip(tasks, results):
        done_stats[Path(t.path)] = st

    # ---- meta
    rows = split_rows(files, done_stats)
    missing = [sum(done_stats[f]["missing"][i] for f in files) for i in range(NUM_SPARSE)]
    total = sum(rows.values())
    if o.mode == "raw":
        table_sizes = _distinct_train_ids(out, files)
    sparse_meta = []
    for i, name in enumerate(SPARSE_FEATURES):
        entry = {"name": name, "num_embeddings": int(table_sizes[i]), "multi_hot": mh[i] > 1,
                 "mean_pooling_factor": float(mh[i]), "max_pooling_factor": int(mh[i]),
                 "missing_fraction": (missing[i] / total) if total else 0.0}
        if o.mode == "raw":
            entry[IDS_KEY] = IDS_RAW
        else:
            entry["missing_id"] = int(table_sizes[i] - 1)
        if vocab_info is not None:
            entry["oov_id"] = int(table_sizes[i] - 2)
            entry["distinct_train_values"] = vocab_info[i]["distinct_train_values"]
        sparse_meta.append(entry)
    transforms = {
        "dense": {"missing": 0, "negative": "clamped to 0", "transform": "log(x+1)", "dtype": "float32",
                  "source": DLRM_LOG_SOURCE},
        "sparse": ({"mode": "raw", "parse": "int(s, 16) of 8 hex digits",
                    "formula": "id = raw_ids(f'{int(s, 16):08x}') (dlrmctl.data.ids: FNV-1a-64 of the "
                               "UTF-8 text, top bit cleared); missing -> 0",
                    "num_embeddings": "distinct raw ids of the train split"}
                   if o.mode == "raw" else
                   {"mode": "hash", "parse": "int(s, 16) of 8 hex digits",
                    "formula": "id = h mod num_embeddings_arg; missing -> num_embeddings_arg",
                    "num_embeddings_arg": o.num_embeddings}
                   if o.mode == "hash" else
                   {"mode": "vocab", "parse": "int(s, 16) of 8 hex digits", "frequency_threshold": o.threshold,
                    "built_on": "train split",
                    "formula": "id = rank by descending train count (ties by value) for count >= T; "
                               "rarer/unseen -> oov_id = V; missing -> V + 1"}),
        "split": ({"mode": "day", "train": "day_N for every N but the last",
                   "val": "first half of the last day", "test": "second half of the last day"}
                  if o.split_by_day else
                  {"mode": "ratio", "val_ratio": o.val_ratio, "test_ratio": o.test_ratio, "seed": o.seed,
                   "rule": "u = splitmix64(blake2b(seed:file) ^ line*0xD1B54A32D192ED03)/2^64; "
                           "val if u < val_ratio, test if u < val_ratio+test_ratio"}
                  if labelled else {"mode": "unlabelled", "test": "all rows"}),
        "multi_hot": ({"sizes": mh, "distribution": o.multi_hot_distribution,
                       "seed": "seed*1000 + feature index", "cache_vectors": MULTI_HOT_CACHE_VECTORS,
                       "source": "MLPerf Training DLRMv2 torchrec_dlrm/multi_hot.py"}
                      if o.multi_hot_sizes else None),
        "on_bad_line": o.on_bad_line,
    }
    elapsed = time.perf_counter() - t0
    meta = parts_meta(files, done_stats, labelled,
                      {"dataset": "criteo", "dense_features": DENSE_FEATURES, "sparse_features": sparse_meta},
                      {"transforms": transforms,
                       "vocab_files": ({n: f"vocab/{n}.arrow" for n in SPARSE_FEATURES} if o.mode == "vocab" else {})})
    meta["rows_per_s"] = rows_read / elapsed if elapsed > 0 else None
    write_meta(out, meta)
    return PreprocessReport(out, rows, meta["bad_lines_skipped"], len(tasks), len(skipped), elapsed,
                            rows_read / elapsed if elapsed > 0 else 0.0)



def _distinct_train_ids(out: Path, files: Sequence[Path]) -> list[int]:
    """Number of distinct raw ids of each sparse feature over every part's train shard (exact;
    one feature's ids in memory at a time, 8 bytes per train row)."""
    import pyarrow.ipc as ipc

    tables = []  # memory-mapped: a column is read when it is taken
    for f in files:
        p = out / "parts" / f.name / "train.arrow"
        if p.is_file():
            tables.append(ipc.open_file(pa.memory_map(str(p))).read_all())
    counts = []
    for name in SPARSE_FEATURES:
        cols = [t.column(name).to_numpy() for t in tables]
        counts.append(int(np.unique(np.concatenate(cols)).size) if cols else 0)
    return [max(1, c) for c in counts]
