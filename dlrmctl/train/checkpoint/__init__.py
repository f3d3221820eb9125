"""Run-directory checkpoints in the ``torch.distributed.checkpoint`` (DCP) format.

Layout::

    runs/<name>/checkpoints/step_00000100/
        __0_0.distcp ...  DCP data files: each rank writes its own embedding shards
                          (no rank ever gathers a table) and a share of the
                          replicated tensors (DCP de-duplicates them); every
                          chunk is a torch.save record (stored zip, row-major)
        .metadata         DCP metadata (pickled by DCP): every key's global shape
                          and saved chunks, and where each chunk lies in the files
        meta.json         format, step, world_size, table shapes, plan, byteorder and,
                          per file above: bytes, block_bytes, the CRC-32 of every
                          block (base64 of little-endian uint32) and, per chunk,
                          the offset of its raw tensor bytes; ``files_crc32``: the
                          CRC-32 of that file table as canonical JSON (written last)
    runs/<name>/checkpoints/LATEST   name of the newest complete checkpoint
    runs/<name>/checkpoints/BEST     name of the checkpoint with the best validation metric
                                     (``train.keep_best``; never pruned by ``keep_last``)

Keys of the DCP state dict (the format; see :func:`~dlrmctl.train.checkpoint.layout.checkpoint_state`)::

    emb/<table>/weight              [rows, dim]  chunks = the shards of the plan that saved it
    emb/<table>/state<i>            i-th embedding-optimizer moment: [rows] (row-wise
                                    Adagrad; partial row-wise Adam / LAMB's state1) or
                                    [rows, dim] (Adagrad; Adam / LAMB state0, state1;
                                    partial row-wise state0), sharded like the rows
    emb/<table>/state<i>@cols<a>-<b> [rows]  column-wise tables only: the row-wise moment
                                    of the column shard [a, b) (each column shard has its own)
    dense/<name>                    MLP / interaction parameters and buffers (replicated)
    dense_opt/<param>/<key>         dense-optimizer state tensors (replicated)
    meta/<name>                     JSON (uint8 tensor, see :func:`pack`): trainer (step,
                                    epoch, best, data position), fused optimizer hyper-
                                    parameters (type, lr, eps, weight_decay, step), dense and
                                    embedding-dense optimizer param_groups (lr, betas, eps,
                                    ...), LR schedule
    rank/<r>                        JSON per-rank entries: RNG states (torch, numpy, python,
                                    cuda), per-shard scalar optimizer state

A tensor that is sharded is given to DCP as :class:`Blocks` (global shape +
this rank's blocks with their offsets); DCP records every chunk in
``.metadata`` and, on load, reads for each requested block exactly the
overlapping parts of the saved chunks — so a checkpoint loads into any world
size or plan, including a single process (``no_dist``); ``dlrmctl checkpoint
reshard`` (:func:`reshard_rank`) rewrites one for a new layout offline.

Optimizer moments across plans: per-element moments and the per-row moments of
row-wise / table-wise / table_row_wise / data_parallel tables are exact under
any resharding.  Row-wise Adagrad keeps one value per row for the whole row,
but each column shard of a column-wise table keeps its own (over its columns):
a column shard loads its own ``@cols`` entry when the column split is unchanged
(exact: resuming with the same plan), else the table's per-row moment (exact at
save time when the source was not column-wise; from a column-wise source it is
the column-0 shard's moment).

Atomicity: a save goes to ``.step_XXXXXXXX.tmp/``; each rank's file is checksummed
while DCP writes it (never read back); after every rank has written (DCP's final
barrier) rank 0 gathers the checksums, writes ``meta.json``, renames the
directory and rewrites ``LATEST`` via temp file + ``os.replace``.  A crash (even SIGKILL) at any point leaves the previous
checkpoint and ``LATEST`` intact; ``keep_last`` older checkpoints are pruned
only after the new one is visible (the one ``BEST`` names is always kept), and a
published directory is never rewritten (a second save of a step becomes ``step_XXXXXXXX.1``).

Readers and pruning: nothing is locked (a reader's lock file would outlive a killed reader and
block pruning, and no process can tell whether a reader on another host of a shared file system
still lives).  Instead readers go through :func:`read_checkpoint`: a checkpoint pruned while it
is read is noticed by its missing files, ``best`` / ``last`` are resolved again (pruning only
ever follows the publication of a newer complete checkpoint, so they then name one) and read
once more, and a fixed step that went is reported as pruned, not as corrupt.

Integrity without extra reads: a loading rank checks the sizes of the files it
opens, reads of each saved chunk only the rows its blocks overlap (rounded out to
whole checksum blocks, ~1/4096 of a file) and verifies exactly those blocks, so a
truncated file or a damaged block is refused naming the file, the byte range and
the entry, and a reshard reads about the checkpoint once in total, not W times.

Nothing is unpickled: non-tensor entries are JSON, DCP's pickled (``BYTE_IO``)
entries are refused, and ``.metadata`` is read with an unpickler that resolves only
DCP's metadata classes.  Format ``dcp-v1`` (pickled entries, whole-file CRCs) is
refused with its version named.

Modules: :mod:`.format` (constants, :class:`CheckpointError`), :mod:`.store` (step directories,
``LATEST`` / ``BEST``, resolving, pruning-safe reads, meta.json, :func:`check_integrity`), :mod:`.codec` (:class:`Blocks`,
:func:`pack` / :func:`unpack`, the safe unpickler), :mod:`.integrity` (block CRCs,
the verifying reader), :mod:`.storage` (the DCP storage writer / reader), :mod:`.save` /
:mod:`.load`, :mod:`.reshard`, :mod:`.layout` (the shard-key layout of a model's state) and
:mod:`.checkpointer` (:class:`Checkpointer`), :mod:`.shared_dir` (the multi-node run's check that every
rank sees the checkpoint directory).  Every public name is re-exported here
(``from dlrmctl.train import checkpoint as ckpt; ckpt.save_checkpoint(...)``); the tunables
``BLOCK_BYTES`` / ``READ_SLAB_BYTES`` are read from here at call time.
"""

from __future__ import annotations

from dlrmctl.train.checkpoint.format import (BEST, BLOCK_BYTES, BLOCKS_PER_FILE, CKPT_DIR, FORMAT, LATEST,
                                             MIN_BLOCK_BYTES, OLD_FORMATS, READ_SLAB_BYTES, CheckpointError)
from dlrmctl.train.checkpoint.rng import rng_state, set_rng_state
from dlrmctl.train.checkpoint.codec import Blocks, pack, unpack
from dlrmctl.train.checkpoint.store import (best_checkpoint, check_integrity, checkpoint_root, copy_run_files,
                                            latest_checkpoint,
                                            list_checkpoints, load_checkpoint_meta, mark_best, read_checkpoint,
                                            resolve_checkpoint)
from dlrmctl.train.checkpoint.save import save_checkpoint
from dlrmctl.train.checkpoint.load import load_checkpoint, read_metadata, saved_size
from dlrmctl.train.checkpoint.layout import (RowMomentKeys, check_tables, checkpoint_meta, checkpoint_state,
                                             dense_state_dict, embedding_load_request, embedding_state,
                                             load_dense_state_dict, local_embedding_shards, managed_collision_state,
                                             restore_checkpoint,
                                             row_moment_keys)
from dlrmctl.train.checkpoint.reshard import reshard_rank
from dlrmctl.train.checkpoint.checkpointer import Checkpointer, ResumePoint, resolve_resume
from dlrmctl.train.checkpoint.shared_dir import check_shared_checkpoint_dir

__all__ = [
    "BEST", "BLOCK_BYTES", "BLOCKS_PER_FILE", "CKPT_DIR", "FORMAT", "LATEST", "MIN_BLOCK_BYTES", "OLD_FORMATS",
    "READ_SLAB_BYTES", "Blocks", "CheckpointError", "Checkpointer", "ResumePoint", "RowMomentKeys", "best_checkpoint",
    "check_integrity", "check_shared_checkpoint_dir", "check_tables", "checkpoint_meta", "checkpoint_root",
    "checkpoint_state", "copy_run_files",
    "dense_state_dict", "embedding_load_request", "embedding_state", "latest_checkpoint", "list_checkpoints",
    "load_checkpoint", "load_checkpoint_meta", "load_dense_state_dict", "local_embedding_shards", "managed_collision_state", "mark_best",
    "pack", "read_checkpoint", "read_metadata", "reshard_rank", "resolve_checkpoint", "resolve_resume", "restore_checkpoint",
    "rng_state", "row_moment_keys", "save_checkpoint", "saved_size", "set_rng_state", "unpack",
]
