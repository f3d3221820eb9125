"""The names a run directory's checkpoints are found by, torch-free (the verbs read them before
torch is imported): the ``checkpoints/`` directory and its ``LATEST`` / ``BEST`` markers, each a
file naming the newest / best checkpoint (:mod:`dlrmctl.train.checkpoint.store`).  The checkpoint
package's :mod:`~dlrmctl.train.checkpoint.format` re-exports them."""

__all__ = ["BEST", "CKPT_DIR", "LATEST"]

#: the directory of a run's checkpoints, ``<run_dir>/checkpoints``
CKPT_DIR = "checkpoints"
#: the marker naming the newest complete checkpoint
LATEST = "LATEST"
#: the marker naming the checkpoint of the best validation metric (``train.keep_best``)
BEST = "BEST"
