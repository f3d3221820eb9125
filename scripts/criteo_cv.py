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

The script sets ``data.path``, ``name``, ``train.run_dir`` and ``train.progress`` of every run
itself (and ``train.seed`` with ``--ensemble`` > 1): a ``--set`` of one of them is refused.

While it works the script prints one progress line per split (on stderr); each training run's
console output (its epoch, evaluation and best-checkpoint lines, warnings) goes to
``WORK/logs/<run name>.log`` instead, next to the run directory ``WORK/runs/<run name>``
(``--verbose``: to the console as well as before).

Printed (and written to ``--out`` as Markdown, and as JSON next to it, each through a temp file
renamed into place): one row per split (rows, DLRM val / test AUC, LR val / test AUC, test
difference), then

* the mean paired difference ``mean_s(DLRM_s - LR_s)`` and its standard error
  ``std_s(.) / sqrt(K)`` (sample std, ddof 1): both models see the same rows of a split, so the
  split's difficulty cancels in the difference (a paired design; the SE says how far the mean
  can be trusted, about +-2 SE for a 95% interval with K >= 5);
* the mean val AUC of both models over the splits (what settings are chosen on; never the test);
* the pooled test AUC of each model: one AUC over the test rows of all splits together (a row
  can be a test row of several splits; the models of different splits are scored on one scale,
  so it also measures their calibration across splits).

Errors (one ``error: ...`` line on stderr, exit status 2), all arguments checked before any split
is preprocessed: a missing input file or config, ``--splits`` < 2 (no standard error from one
split), ``--ensemble`` / ``--threads`` < 1, ``--first-seed`` < 0, ``--val-ratio`` or ``--test-ratio``
not in (0, 1) or summing to >= 1 (both splits are needed: val chooses, test scores), a bad ``--C``,
a bad ``--set`` (the config's own error) or one of the keys the script sets, an ``--out`` ending
``.json``.  An error the
preprocessing, the trainer or the evaluator raises for the data or the configuration
(``ConfigError``, ``TrainError``, ``PlannerError``, ``DataError``, ...) is one line naming the split
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
               out: str | None = None) -> Any:
    """Every argument checked before any work (nothing is preprocessed or trained before this).
    Returns the loaded config (with the overrides): its ``train.seed`` is the ensemble's first.

    Raises:
        ValueError: ``splits`` < 2, ``ensemble`` or ``threads`` < 1, ``first_seed`` < 0, a ratio
            not in (0, 1) or ``val_ratio + test_ratio`` >= 1, ``cs`` empty or not all finite > 0,
            an override of a key the script sets (:data:`CONTROLLED_KEYS`, plus ``train.seed``
            with ``ensemble`` > 1), an ``out`` ending ``.json`` (its JSON copy's name).
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


def run_split(config: str, overrides: list[str], input_file: str, work: Path, seed: int, val_ratio: float,
              test_ratio: float, cs, log, ensemble: int = 1, verbose: bool = False, base_seed: int = 0) -> dict:
    """One split: preprocess, train DLRM, score its best-on-val checkpoint on test, fit the LR.

    ``ensemble`` > 1: train that many DLRMs (``train.seed`` = the config's + 0, 1, ...; each its
    own best-on-val checkpoint) and score the mean of their logits on val and test.
    Each run's console output goes to ``work/logs/<run name>.log`` (the split's earlier logs removed first), or to the
    console with ``verbose``.

    Returns:
        ``{"seed", "test_rows", "dlrm_val_auc", "dlrm_test_auc", "lr_val_auc", "lr_test_auc", "C",
        "dlrm_test_logits", "lr_test_logits", "test_labels"}`` (the arrays ``[n]`` float64).
    """
    from dlrmctl.train.reload import run_logits
    from dlrmctl.train.metrics import compute_metrics_from_logits
    from dlrmctl.train.worker import run_training

    data = work / f"data_{seed}"
    for old in (work / "logs").glob(f"split_{seed}.log" if ensemble == 1 else f"split_{seed}_m*.log"):
        old.unlink()  # an earlier invocation's: an error now must not point at it
    preprocess_split(input_file, data, seed, val_ratio, test_ratio)
    zs, vs = [], []
    for m in range(ensemble):
        name = f"split_{seed}" + (f"_m{m}" if ensemble > 1 else "")
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
    return {"seed": seed, "test_rows": int(len(y)), "dlrm_val_auc": dlrm_val_auc,
            "dlrm_test_auc": float(dlrm_test["auc"]), "lr_val_auc": float(lr["logistic_regression"]["val"]["auc"]),
            "lr_test_auc": float(lr["logistic_regression"]["test"]["auc"]), "C": lr["C"],
            "dlrm_test_logits": np.asarray(z, np.float64), "lr_test_logits": np.asarray(lz, np.float64),
            "test_labels": np.asarray(y, np.float64)}


def summarize(rows: list[dict]) -> dict:
    """The per-split rows -> mean paired test difference ± SE, mean val AUCs, pooled test AUCs."""
    diffs = [r["dlrm_test_auc"] - r["lr_test_auc"] for r in rows]
    mean, se = paired_stats(diffs)
    y = np.concatenate([r["test_labels"] for r in rows])
    return {
        "splits": len(rows), "diff_mean": mean, "diff_se": se,
        "dlrm_val_mean": float(np.mean([r["dlrm_val_auc"] for r in rows])),
        "lr_val_mean": float(np.mean([r["lr_val_auc"] for r in rows])),
        "dlrm_test_mean": float(np.mean([r["dlrm_test_auc"] for r in rows])),
        "lr_test_mean": float(np.mean([r["lr_test_auc"] for r in rows])),
        "pooled_test_rows": int(y.size),
        "dlrm_pooled_test_auc": bc.auc(y, np.concatenate([r["dlrm_test_logits"] for r in rows])),
        "lr_pooled_test_auc": bc.auc(y, np.concatenate([r["lr_test_logits"] for r in rows])),
    }


def render(rows: list[dict], s: dict, command: str) -> str:
    """The Markdown table and summary lines printed and written to ``--out``."""
    lines = [f"`{command}`", "",
             "| split seed | test rows | DLRM val AUC | DLRM test AUC | LR val AUC | LR test AUC (C) | DLRM - LR test |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['seed']} | {r['test_rows']} | {r['dlrm_val_auc']:.4f} | {r['dlrm_test_auc']:.4f} | "
                     f"{r['lr_val_auc']:.4f} | {r['lr_test_auc']:.4f} ({r['C']:g}) | "
                     f"{r['dlrm_test_auc'] - r['lr_test_auc']:+.4f} |")
    lines += ["",
              f"mean paired test difference DLRM - LR over {s['splits']} splits: {s['diff_mean']:+.4f} "
              f"± {s['diff_se']:.4f} (SE)",
              f"mean val AUC: DLRM {s['dlrm_val_mean']:.4f}, LR {s['lr_val_mean']:.4f}; "
              f"mean test AUC: DLRM {s['dlrm_test_mean']:.4f}, LR {s['lr_test_mean']:.4f}",
              f"pooled test AUC ({s['pooled_test_rows']} rows of all splits): DLRM {s['dlrm_pooled_test_auc']:.4f}, "
              f"LR {s['lr_pooled_test_auc']:.4f}"]
    return "\n".join(lines) + "\n"


def run(input_file: str, config: str, overrides: list[str], splits: int = 5, first_seed: int = 0,
        work: str = "runs/criteo_cv", val_ratio: float = 0.15, test_ratio: float = 0.15, cs=bc.DEFAULT_CS,
        out: str | None = None, log=None, ensemble: int = 1, verbose: bool = False, threads: int = 1) -> dict:
    """Run the K splits (see the module docstring); returns ``{"rows": [...], "summary": {...}}``
    (the rows without their logit arrays).  ``log`` gets one progress line per split (default
    stderr); the training runs' own output goes to ``work/logs/`` unless ``verbose``; ``threads``:
    torch's intra-op threads for the runs (set after the arguments are checked).

    Raises:
        FileNotFoundError: ``input_file`` or ``config`` missing.
        ValueError: a bad argument (:func:`check_args`).
        dlrmctl.config.ConfigError: a bad config or override.
        SplitError: a split's preprocessing, training or scoring refused the data or the
            configuration (the message names the split, the ``--set`` overrides and the run's log).
    """
    from dlrmctl.errors import UserError

    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    cfg = check_args(input_file, config, overrides, splits, first_seed, val_ratio, test_ratio, cs, ensemble,
                     threads, out=out)
    import torch

    torch.set_num_threads(threads)
    work_p = Path(work)
    rows = []
    set_args = [a for o in overrides for a in ("--set", o)]
    sets = (" " + shlex.join(set_args)) if set_args else ""
    for seed in range(first_seed, first_seed + splits):
        t0 = time.perf_counter()
        try:
            r = run_split(config, overrides, input_file, work_p, seed, val_ratio, test_ratio, cs,
                          log=lambda s: None, ensemble=ensemble, verbose=verbose, base_seed=cfg.train.seed)
        except (UserError, ValueError) as e:
            msg = " ".join(str(e).split())  # one line, whatever the error's own layout
            logs = sorted((work_p / "logs").glob(f"split_{seed}.log" if ensemble == 1 else f"split_{seed}_m*.log"),
                          key=lambda f: f.stat().st_mtime)  # the failed run's log: the newest of this split
            where = f"; its training log: {logs[-1]}" if logs and not verbose else ""
            raise SplitError(f"split {seed} (config {config}{sets or ', no --set'}): {msg}{where}") from e
        log(f"split {seed}: DLRM val {r['dlrm_val_auc']:.4f} test {r['dlrm_test_auc']:.4f} | LR val "
            f"{r['lr_val_auc']:.4f} test {r['lr_test_auc']:.4f} ({time.perf_counter() - t0:.0f}s; run "
            f"{work_p / 'runs' / f'split_{seed}'}{'_m*' if ensemble > 1 else ''})")
        rows.append(r)
    s = summarize(rows)
    # every option that changes the figures, quoted: running the recorded command gives this table again
    inputs = [input_file] if isinstance(input_file, str) else list(input_file)
    command = shlex.join(["python", "scripts/criteo_cv.py"] + [a for f in inputs for a in ("--input", str(f))]
                         + ["--config", str(config),
                          "--splits", str(splits), "--first-seed", str(first_seed), "--val-ratio", f"{val_ratio:g}",
                          "--test-ratio", f"{test_ratio:g}", "--C", ",".join(f"{c:g}" for c in cs)]
                         + (["--ensemble", str(ensemble)] if ensemble > 1 else []) + set_args)
    text = render(rows, s, command)
    print(text, end="")
    plain = [{k: v for k, v in r.items() if not isinstance(v, np.ndarray)} for r in rows]
    if out:
        write_text_atomic(Path(out), text)
        write_text_atomic(Path(out).with_suffix(".json"),
                      json.dumps({"command": command, "rows": plain, "summary": s}, indent=1) + "\n")
    return {"rows": plain, "summary": s}


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
        return run(a.input, a.config, a.overrides, a.splits, a.first_seed, a.work, a.val_ratio, a.test_ratio, cs,
                   a.out, ensemble=a.ensemble, verbose=a.verbose, threads=a.threads)
    except (FileNotFoundError, ValueError, ConfigError, SplitError) as e:
        _fail(" ".join(str(e).split()))


if __name__ == "__main__":
    main()
