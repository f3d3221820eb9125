"""Format constants of the run-directory checkpoints (see :mod:`dlrmctl.train.checkpoint`) and
:class:`CheckpointError`.

The tunables (``BLOCK_BYTES``, ``READ_SLAB_BYTES``) are read through the package at call time
(``dlrmctl.train.checkpoint.BLOCK_BYTES``), so setting them there applies to every module.
"""

from __future__ import annotations

from dlrmctl.errors import UserError
from dlrmctl.train.checkpoint_names import BEST, CKPT_DIR, LATEST  # noqa: F401  (the names, torch-free)

FORMAT = "dcp-v2"
#: formats this dlrmctl refuses, with what changed (shown in the error)
OLD_FORMATS = {
    "dcp-v1": "its trainer / optimizer / RNG entries are pickled objects (unpickling a file can run code) and its "
              "checksums cover whole files only",
}
#: checksummed blocks: a read verifies (so reads) every block it overlaps.  A data file gets blocks
#: of ~1/BLOCKS_PER_FILE of its size (a power of two in [MIN_BLOCK_BYTES, BLOCK_BYTES]), so a range
#: read over-reads at most two such blocks and meta.json holds at most ~BLOCKS_PER_FILE CRCs a file
#: (4 bytes each, base64) below BLOCK_BYTES x BLOCKS_PER_FILE = 4 GiB files
BLOCK_BYTES = 1 << 20
MIN_BLOCK_BYTES = 4096
BLOCKS_PER_FILE = 4096


class CheckpointError(RuntimeError, UserError):
    """A checkpoint is missing, truncated or does not match the model."""

#: the largest piece of a saved chunk read at once (bytes): rows are read, verified and copied into
#: their target slab by slab, so loading a table never holds a second copy of it
READ_SLAB_BYTES = 64 << 20

