"""``dlrmctl preprocess criteo``: the two passes over the input files and the output ``meta.json``.

Pass 1 (vocabulary mode only) counts the train rows' categorical values per file
(:func:`dlrmctl.data.criteo.vocab.count_file`), then merges them one feature at a time into
``vocab/<feature>.arrow`` (:func:`~dlrmctl.data.criteo.vocab.build_vocab`).  Pass 2 transforms
every file into ``parts/<name>/{train,val,test}.arrow`` (:func:`process_file`).  Both passes run one
task per input file on the worker pool of :mod:`dlrmctl.data.criteo.parallel`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from dlrmctl.data.columnar import (
    FORMAT_VERSION,
    LABEL_COLUMN,
    SPLITS,
    DataError,
    ShardWriter,
    shard_schema,
    write_json_atomic,
    write_meta,
)
from dlrmctl.data.criteo import vocab as _vocab
from dlrmctl.data.criteo.parallel import Progress, report_rows, run_tasks
from dlrmctl.data.criteo.parse import (
    _DAY_RE,
    DENSE_FEATURES,
    DLRM_LOG_SOURCE,
    NUM_SPARSE,
    SPARSE_FEATURES,
    CriteoOptions,
    FileTask,
    count_lines,
    expand_inputs,
    num_fields,
    read_blocks,
    sparse_ids,
    split_of_block,
)
from dlrmctl.data.multi_hot import MULTI_HOT_CACHE_VECTORS, multi_hot_expand

__all__ = ["PreprocessReport", "preprocess_criteo", "process_file"]


def process_file(task: FileTask) -> dict:
    """Transform one input file into ``parts/<part>/{train,val,test}.arrow`` + ``done.json``.

    Writes into ``parts/<part>.tmp`` and renames it when complete, so a crash leaves no
    half-finished part that could be taken for a finished one.
    """
    t0 = time.perf_counter()
    o = task.opts
    parts = Path(task.out_dir) / "parts"
    final = parts / task.part
    tmp = parts / (task.part + ".tmp")
    vocabs = _vocab.VocabSet.of_dir(task.vocab_dir) if o.mode == "vocab" else None  # loaded lazily
    mh = o.multi_hot_sizes or [1] * NUM_SPARSE
    schema = shard_schema(DENSE_FEATURES, SPARSE_FEATURES, [s > 1 for s in mh], labelled=task.labelled)

    def fresh():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        return {s: ShardWriter(tmp / f"{s}.arrow", schema) for s in SPLITS}

    writers = fresh()
    stats = _new_stats()
    reported = 0
    try:
        for blk in read_blocks(task):
            if blk is None:  # restart in careful mode
                for w in writers.values():
                    w.abort()
                writers = fresh()
                stats = _new_stats()
                continue
            stats["bad_lines"] += blk.bad_skipped
            if len(blk.lines) == 0:
                continue
            codes = split_of_block(task, blk)
            ids = sparse_ids(task, blk, vocabs)
            for f in range(NUM_SPARSE):
                stats["missing"][f] += int(len(ids[f]) - np.count_nonzero(blk.sparse_present[f]))
            for si, split in enumerate(SPLITS):
                sel = codes == si
                k = int(np.count_nonzero(sel))
                if k == 0:
                    continue
                allsel = k == len(codes)
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
                writers[split].write(cols)
                stats["rows"][split] += k
            nrows = len(blk.lines)
            reported += nrows
            report_rows(nrows)
        for w in writers.values():
            w.close()
        stats["seconds"] = time.perf_counter() - t0
        stats["fingerprint"] = task.fingerprint
        stats["input"] = task.path
        write_json_atomic(tmp / "done.json", stats)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    except BaseException:
        for w in writers.values():
            try:
                w.abort()
            except Exception:
                pass
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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


def _fingerprint(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]



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
            m = _DAY_RE.match(f.name)
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
        table_sizes = None

    def fp_common() -> dict:
        return {"format_version": FORMAT_VERSION, "seed": o.seed, "val_ratio": o.val_ratio,
                "test_ratio": o.test_ratio, "split_by_day": o.split_by_day, "on_bad_line": o.on_bad_line}

    def file_id(f: Path) -> dict:
        st = f.stat()
        return {"name": f.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                "role": roles[f], "valtest_first": valtest_first.get(f, 0)}

    rows_read = 0
    vocab_info = None
    vocab_dir = out / "vocab"
    if o.mode == "vocab":
        count_tasks = [FileTask(str(f), f.name, roles[f], labelled, str(out), o,
                                 _fingerprint({**fp_common(), **file_id(f), "pass": "count",
                                              "counts_format": _vocab.COUNTS_FORMAT}),
                                 valtest_first=valtest_first.get(f, 0)) for f in files]
        prog = Progress("criteo vocabulary pass", len(files), progress)
        count_files = run_tasks(_vocab.count_file, count_tasks, o.workers, prog)
        prog.show(final=True)
        rows_read += prog.rows
        vocab_info = _vocab.build_vocab(count_files, vocab_dir, o.threshold)
        table_sizes = [v["size"] + 2 for v in vocab_info]
        vocab_fp = _fingerprint([_sha_file(vocab_dir / f"{n}.arrow") for n in SPARSE_FEATURES])
    else:
        vocab_fp = None

    mh = o.multi_hot_sizes or [1] * NUM_SPARSE
    tasks, skipped, done_stats = [], [], {}
    for f in files:
        fp = _fingerprint({**fp_common(), **file_id(f), "mode": o.mode, "num_embeddings": o.num_embeddings,
                           "vocab": vocab_fp, "multi_hot": mh, "dist": o.multi_hot_distribution,
                           "table_sizes": table_sizes})
        done = out / "parts" / f.name / "done.json"
        if done.is_file():
            try:
                st = json.loads(done.read_text())
            except json.JSONDecodeError:
                st = {}
            if st.get("fingerprint") == fp:
                skipped.append(f)
                done_stats[f] = st
                continue
        tasks.append(FileTask(str(f), f.name, roles[f], labelled, str(out), o, fp,
                               vocab_dir=str(vocab_dir) if o.mode == "vocab" else None,
                               table_sizes=table_sizes, valtest_first=valtest_first.get(f, 0)))
    prog = Progress("criteo", len(tasks), progress)
    try:
        results = run_tasks(process_file, tasks, o.workers, prog)
    finally:
        _vocab.clear_cache()  # in-process (1 worker) runs loaded the vocabularies here
    prog.show(final=True)
    rows_read += prog.rows
    for t, st in zip(tasks, results):
        done_stats[Path(t.path)] = st

    # ---- meta
    rows = {s: sum(done_stats[f]["rows"][s] for f in files) for s in SPLITS}
    pos = {s: sum(done_stats[f]["positives"][s] for f in files) for s in SPLITS}
    missing = [sum(done_stats[f]["missing"][i] for f in files) for i in range(NUM_SPARSE)]
    bad_lines = sum(done_stats[f]["bad_lines"] for f in files)
    total = sum(rows.values())
    sparse_meta = []
    for i, name in enumerate(SPARSE_FEATURES):
        entry = {"name": name, "num_embeddings": int(table_sizes[i]), "multi_hot": mh[i] > 1,
                 "mean_pooling_factor": float(mh[i]), "max_pooling_factor": int(mh[i]),
                 "missing_id": int(table_sizes[i] - 1),
                 "missing_fraction": (missing[i] / total) if total else 0.0}
        if vocab_info is not None:
            entry["oov_id"] = int(table_sizes[i] - 2)
            entry["distinct_train_values"] = vocab_info[i]["distinct_train_values"]
        sparse_meta.append(entry)
    transforms = {
        "dense": {"missing": 0, "negative": "clamped to 0", "transform": "log(x+1)", "dtype": "float32",
                  "source": DLRM_LOG_SOURCE},
        "sparse": ({"mode": "hash", "parse": "int(s, 16) of 8 hex digits",
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
    meta = {
        "format_version": FORMAT_VERSION,
        "dataset": "criteo",
        "dense_features": DENSE_FEATURES,
        "sparse_features": sparse_meta,
        "label": LABEL_COLUMN if labelled else None,
        "splits": {s: {"rows": rows[s], "files": [f"parts/{f.name}/{s}.arrow" for f in files]}
                   for s in SPLITS},
        "ctr": {s: (pos[s] / rows[s] if rows[s] and labelled else None) for s in SPLITS},
        "transforms": transforms,
        "vocab_files": ({n: f"vocab/{n}.arrow" for n in SPARSE_FEATURES} if o.mode == "vocab" else {}),
        "inputs": [str(f) for f in files],
        "bad_lines_skipped": bad_lines,
        "rows_per_s": rows_read / elapsed if elapsed > 0 else None,
    }
    write_meta(out, meta)
    return PreprocessReport(out, rows, bad_lines, len(tasks), len(skipped), elapsed,
                            rows_read / elapsed if elapsed > 0 else 0.0)



def _sha_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]

