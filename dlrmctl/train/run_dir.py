"""The run directory's lifecycle: ``train.run_dir/<name>`` checked for a new run, prepared
(config, data meta, the attempt marker), and cleared of what a failed attempt left.

:class:`TrainError` (a run cannot start or continue) is defined here, the lowest module of
the training package that raises it; every other module imports it from here.
"""

from __future__ import annotations

import json
import os
import shutil

import yaml

from dlrmctl import outputs, run_lock
from dlrmctl.config import ExperimentConfig, read_data_meta, to_dict
from dlrmctl.errors import UserError, check_output_dir
from dlrmctl.train.checkpoint.format import CKPT_DIR, CheckpointError
from dlrmctl.train.checkpoint.store import latest_checkpoint


class TrainError(RuntimeError, UserError):
    """A run cannot start (bad run directory, missing data, ...)."""


def check_run_dir(cfg: ExperimentConfig, resume: bool, overwrite: bool) -> str:
    """The run directory ``train.run_dir/<name>``, checked for use by a new run.  Nothing is written,
    except that an ``--overwrite`` a kill left half-way is settled first (:func:`settle_replacement`).

    Args:
        cfg: the experiment config.
        resume: the run continues the directory's newest checkpoint.
        overwrite: the run replaces whatever the directory holds.

    Returns:
        The run directory's path (it may not exist yet).

    Raises:
        TrainError: the run directory holds checkpoints and neither flag was given.
        OutputError: the run directory is a file, lies under one, or cannot be written (read-only).
        RunInUseError: another running dlrmctl holds the run directory's lock (:mod:`dlrmctl.run_lock`).
        DataMismatchError: resuming on other data than the run was trained on (fingerprints differ).
    """
    run_dir = os.path.join(cfg.train.run_dir, cfg.name)
    # a file, under a file, read-only or not writable: one line before anything is written
    check_output_dir(cfg.train.run_dir, "train.run_dir")
    check_output_dir(run_dir, "the run directory")
    kind = outputs.kind_of(run_dir)
    # (a checkpoints/ directory makes it a run: the checks below say what to do with it)
    foreign = sorted(set(os.listdir(run_dir)) - {run_lock.LOCK_NAME, ATTEMPT_MARKER, "logs"}) \
        if os.path.isdir(run_dir) and kind is None and not os.path.isdir(os.path.join(run_dir, CKPT_DIR)) else []
    if foreign or kind not in (None, "run"):
        # a run never moves into (and --overwrite never deletes) what no dlrmctl run wrote
        what = f"a dlrmctl {kind}" if kind else f"{', '.join(foreign[:3])}, which was not written by dlrmctl"
        raise TrainError(f"{run_dir} exists and is not a dlrmctl run directory: it holds {what}; train.run_dir/name "
                         "must name a new directory or a dlrmctl run (--set name=<other>), and keep experiment "
                         "configs outside run directories")
    run_lock.check_not_in_use(run_dir)  # another dlrmctl is training it: refuse before anything else
    # an --overwrite attempt killed half-way: its old run comes back (or goes, past the new one's first
    # checkpoint) before the checks below look at what the directory holds
    settle_replacement(run_dir)
    if not resume and not overwrite and os.path.exists(os.path.join(run_dir, CKPT_DIR)):
        raise TrainError(
            f"{run_dir} already holds a run; pass --resume to continue it, --overwrite to replace it, "
            "or --set name=<other>"
        )
    recorded = os.path.join(run_dir, "data_meta.json")
    if (resume and os.path.exists(os.path.join(run_dir, CKPT_DIR)) and os.path.exists(recorded)
            and os.path.exists(os.path.join(cfg.data.path, "meta.json"))):
        from dlrmctl.data.fingerprint import check_run_data

        check_run_data(recorded, cfg.data.path, hint="Resume on the data the run was trained on, or start a new run "
                                                     "(--set name=<other>)")
    return run_dir


def check_train_splits(cfg: ExperimentConfig, meta: dict) -> None:
    """The train and validation splits exist and have rows, and their shards are the bytes meta.json
    records (one error line naming the split or the file otherwise, before the first step)."""
    from dlrmctl.data.checksums import verify_files
    from dlrmctl.data.columnar import DataError
    from dlrmctl.data.fingerprint import split_rows

    split_rows(meta, cfg.data.path, cfg.data.train_split, "data.train_split")
    split_rows(meta, cfg.data.path, cfg.data.val_split, "data.val_split")
    for split in dict.fromkeys((cfg.data.train_split, cfg.data.val_split)):
        verify_files(cfg.data.path, meta, meta["splits"][split].get("files") or [], DataError)


def prepare_run_dir(cfg: ExperimentConfig, resume: bool, overwrite: bool, config_path: str | None = None) -> str:
    """``train.run_dir/<name>``, set up for this attempt (its ``.dlrmctl`` marker, attempt marker,
    config.yaml, data_meta.json); refuses to clobber an existing run unless resuming or overwriting.

    With ``overwrite`` an existing run is not deleted: its files are moved into
    ``<run_dir>/.dlrmctl_replaced`` (:data:`REPLACED_DIR`) and deleted only once this run has its
    first complete checkpoint or ends successfully (:func:`finish_replacement`); a replacement that
    fails or is cancelled before that gets the old run back (:func:`clear_unsaved_attempt`, or
    :func:`settle_replacement` at the next ``train`` after a kill).

    Raises:
        TrainError: the run directory holds checkpoints and neither flag was given; with
            ``overwrite``, the directory holds files that are not a dlrmctl run's.
    """
    run_dir = check_run_dir(cfg, resume, overwrite)
    settle_replacement(run_dir)  # an --overwrite attempt killed before its first checkpoint: the old run is back
    clear_unsaved_attempt(run_dir)  # a failed attempt's files must not mix into this run's
    if overwrite and not resume and os.path.exists(run_dir):
        set_aside(run_dir)  # kept until this run's first complete checkpoint (finish_replacement)
    cpath = os.path.join(run_dir, "config.yaml")
    if (os.path.exists(cpath) and not os.path.exists(os.path.join(run_dir, ATTEMPT_MARKER))
            and not os.path.exists(os.path.join(run_dir, CKPT_DIR))):
        raise TrainError(f"{cpath} exists and was not written by dlrmctl; keep experiment configs outside the run "
                         "directory (it is replaced by the resolved config), or --set name=<other>")
    os.makedirs(run_dir, exist_ok=True)
    if outputs.read_marker(run_dir) is None:
        outputs.write_marker(run_dir, "run")
    with open(os.path.join(run_dir, ATTEMPT_MARKER), "w") as f:  # what this attempt writes is newer than this
        f.write(f"{os.getpid()}\n")
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
    meta = read_data_meta(cfg)
    if meta is not None:
        with open(os.path.join(run_dir, "data_meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
    return run_dir


#: written when a run attempt starts: clear_unsaved_attempt removes only outputs newer than it
ATTEMPT_MARKER = ".dlrmctl_attempt"

#: what a run writes besides checkpoints/ and logs/ (removed by clear_unsaved_attempt)
RUN_OUTPUTS = ("config.yaml", "data_meta.json", "plan.yaml", "plan.txt", "metrics.jsonl", "summary.json",
               "init_from.json", "tensorboard", "loss.png", "auc.png", "throughput.png")


#: where ``--overwrite`` keeps the run it replaces until the replacement has a complete checkpoint
REPLACED_DIR = outputs.REPLACED_DIR
#: what a run writes in its directory: all that ``--overwrite`` sets aside and replaces; anything else
#: (an export written into the run directory, the user's notes) stays where it is
RUN_ENTRIES = frozenset((*RUN_OUTPUTS, CKPT_DIR, "logs", ATTEMPT_MARKER, outputs.MARKER_NAME))


def set_aside(run_dir: str) -> None:
    """Move the run in ``run_dir`` (what a run writes: :data:`RUN_ENTRIES`; the lock, an export
    written into the directory and the user's own files stay) into ``run_dir/.dlrmctl_replaced``.

    Raises:
        TrainError: ``run_dir`` holds files that are not a dlrmctl run's (``--overwrite`` replaces
            only what dlrmctl made), or is the working directory, home or ``/``.
    """
    names = [n for n in os.listdir(run_dir) if n in RUN_ENTRIES]
    if not names:
        return
    if not set(names) <= {"logs", outputs.MARKER_NAME, ATTEMPT_MARKER}:  # more than a cleared attempt's logs
        try:
            outputs.check_replaceable(run_dir, "run", "--overwrite", "--set name=<other> for a new run")
        except outputs.OutputError as e:
            raise TrainError(str(e)) from None
    aside = os.path.join(run_dir, REPLACED_DIR)
    os.makedirs(aside)
    # a kill in this loop leaves a half-moved run: without ASIDE_DONE the next train moves it all back
    # (settle_replacement) instead of taking the old checkpoints still in place for the new run's
    for n in names:
        os.rename(os.path.join(run_dir, n), os.path.join(aside, n))
    if os.path.exists(os.path.join(aside, outputs.MARKER_NAME)):
        shutil.copy2(os.path.join(aside, outputs.MARKER_NAME), os.path.join(run_dir, outputs.MARKER_NAME))
    open(os.path.join(aside, ASIDE_DONE), "w").close()


#: in the set-aside directory: every entry of the old run is in it (set_aside finished)
ASIDE_DONE = ".set_aside_complete"
#: in the set-aside directory: the attempt's entries are gone, the old run's are moving back
RESTORING = ".restoring"
ASIDE_MARKS = (ASIDE_DONE, RESTORING, ".attempt_logs")


def _move_back(run_dir: str) -> None:
    """Every old-run entry of the set-aside directory back into ``run_dir`` (an entry of the same
    name there, the attempt's, gives way), the attempt's logs merged into ``logs/``, the directory gone."""
    aside = os.path.join(run_dir, REPLACED_DIR)
    for n in os.listdir(aside):
        if n not in ASIDE_MARKS:
            dst = os.path.join(run_dir, n)
            if os.path.lexists(dst) and n != outputs.MARKER_NAME:
                shutil.rmtree(dst) if os.path.isdir(dst) and not os.path.islink(dst) else os.remove(dst)
            os.replace(os.path.join(aside, n), dst)
    if os.path.isdir(os.path.join(aside, ".attempt_logs")):
        _merge_into(os.path.join(aside, ".attempt_logs"), os.path.join(run_dir, "logs"))
    shutil.rmtree(aside)


def finish_replacement(run_dir: str, done: bool = False) -> bool:
    """Delete the run an ``--overwrite`` set aside once the new run has a complete checkpoint
    (call after a save, rank 0) or is ``done`` (it ended successfully).  Returns True when deleted."""
    aside = os.path.join(run_dir, REPLACED_DIR)
    if not os.path.isdir(aside) or not os.path.exists(os.path.join(aside, ASIDE_DONE)) \
            or os.path.exists(os.path.join(aside, RESTORING)):  # half set aside, or coming back: never deleted
        return False
    try:
        if not done and latest_checkpoint(run_dir) is None:
            return False
    except CheckpointError:
        return False
    shutil.rmtree(aside, ignore_errors=True)
    return True


def _restore_replaced(run_dir: str) -> bool:
    """Put back the run an ``--overwrite`` attempt set aside: the attempt's own outputs
    (:data:`RUN_ENTRIES`) go, except its logs, which are merged into the restored run's ``logs/`` (the
    failure's record); the old run's come back as they were.  Returns True when restored."""
    aside = os.path.join(run_dir, REPLACED_DIR)
    if not os.path.isdir(aside):
        return False
    if os.path.exists(os.path.join(aside, ASIDE_DONE)) and not os.path.exists(os.path.join(aside, RESTORING)):
        attempt_logs = os.path.join(aside, ".attempt_logs")
        if os.path.isdir(os.path.join(run_dir, "logs")) and not os.path.exists(attempt_logs):
            os.rename(os.path.join(run_dir, "logs"), attempt_logs)  # the failure's record: kept
        for n in os.listdir(run_dir):
            if n in RUN_ENTRIES and n != outputs.MARKER_NAME:
                p = os.path.join(run_dir, n)
                shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)
        open(os.path.join(aside, RESTORING), "w").close()  # a kill from here on: the next train goes on
    # (no ASIDE_DONE: a set_aside killed half-way; everything still in run_dir is the old run's too)
    _move_back(run_dir)
    return True


def _merge_into(src: str, dst: str) -> None:
    """Move the tree ``src`` into ``dst``: entries ``dst`` lacks move as they are, directories on both
    sides merge, and a file on both sides keeps ``dst``'s, ``src``'s beside it as ``<name>.attempt``."""
    os.makedirs(dst, exist_ok=True)
    for n in os.listdir(src):
        s, d = os.path.join(src, n), os.path.join(dst, n)
        if not os.path.lexists(d):
            os.rename(s, d)
        elif os.path.isdir(s) and os.path.isdir(d) and not os.path.islink(d):
            _merge_into(s, d)
        else:
            k, alt = 0, d + ".attempt"
            while os.path.lexists(alt):
                k += 1
                alt = f"{d}.attempt{k}"
            os.rename(s, alt)
    shutil.rmtree(src, ignore_errors=True)


def settle_replacement(run_dir: str) -> None:
    """Resolve an ``--overwrite`` left half-way by a killed attempt: with a complete new checkpoint
    the old run is deleted (:func:`finish_replacement`), else it is restored."""
    if os.path.isdir(os.path.join(run_dir, REPLACED_DIR)) and not finish_replacement(run_dir):
        _restore_replaced(run_dir)


def clear_unsaved_attempt(run_dir: str) -> bool:
    """Remove what a run attempt that saved no checkpoint left in ``run_dir`` (config, data meta,
    plan, metrics, summary, plots), so that a retry starts clean; ``logs/`` (the failure's record),
    files dlrmctl does not write, and files older than the attempt's marker (:data:`ATTEMPT_MARKER`,
    e.g. a plan kept there by the user) stay.  A run directory with checkpoints is not touched.

    An ``--overwrite`` attempt's set-aside run (:data:`REPLACED_DIR`) comes back unless the attempt
    has a complete checkpoint.

    Returns:
        True when something was removed.
    """
    if os.path.isdir(os.path.join(run_dir, REPLACED_DIR)):
        if finish_replacement(run_dir):
            return False
        return _restore_replaced(run_dir)
    if not os.path.isdir(run_dir) or os.path.exists(os.path.join(run_dir, CKPT_DIR)):
        return False
    marker = os.path.join(run_dir, ATTEMPT_MARKER)
    if not os.path.exists(marker):  # not an attempt of dlrmctl's: nothing here is ours to remove
        return False
    since = os.path.getmtime(marker)
    removed = False
    for n in RUN_OUTPUTS:
        p = os.path.join(run_dir, n)
        if os.path.exists(p) and os.path.getmtime(p) < since:
            continue  # there before the attempt (e.g. a plan the user keeps here): not the attempt's
        if os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
            removed = True
        elif os.path.exists(p):
            os.remove(p)
            removed = True
    os.remove(marker)
    left = set(os.listdir(run_dir)) - {run_lock.LOCK_NAME}
    if outputs.MARKER_NAME in left and left <= {outputs.MARKER_NAME, "logs"}:  # no run left: the failure's logs at most
        os.remove(os.path.join(run_dir, outputs.MARKER_NAME))
    if not os.listdir(run_dir):
        os.rmdir(run_dir)
    return removed
