"""Output directories that dlrmctl owns: the ownership marker, the refusal to replace what is not
ours, the atomic swap of a completed replacement, and the reclaiming of a killed run's temporaries.

Every output directory dlrmctl creates (a dataset of ``preprocess``, a training run, an export
artifact, a sweep) gets a marker file :data:`MARKER_NAME` (``.dlrmctl``), JSON::

    {"kind": "dataset" | "run" | "export" | "sweep", "version": 1, "created": ISO-8601, ...}

(a dataset's marker also records its ``recipe``: the inputs and options it was made from).
``--force`` / ``--overwrite`` replace only a directory of the same kind that is ours: it carries
the marker, or it is a dlrmctl output made before the marker existed (:func:`kind_of` recognises
a dataset by its ``meta.json``, an export by its ``manifest.json``, a run by its ``config.yaml``
with checkpoints or an attempt marker, a sweep by its ``sweep.csv``).  Never the working
directory or one of its parents, ``/`` or the home directory (:func:`check_replaceable`).

A replacement is built complete in a sibling temporary directory (:func:`make_temp_dir`:
``.<name>.tmp-XXXX``, marked with the building process's pid and host) and swapped in by
:func:`swap_in`: old renamed aside, new renamed in, old deleted; a failure at any point leaves the
old one in place.  :func:`reclaim_stale` removes the temporaries of killed runs (ours, and their
process gone) at the next build of the same output.

A finished build's marker lists the ``entries`` it wrote; ``--force`` refuses a directory where
anything else has appeared since (:func:`foreign_entries`).

Single output files (``predict --output``, ``plan --out`` / ``--report``) follow the same rule:
:func:`check_file_replaceable` lets ``--force`` replace only a regular file the command's kind of
writer made (recognised by its content), never a symbolic link, a device, a directory, a file
inside a dlrmctl output, or the command's own input; :func:`atomic_file` writes a hidden
``.<name>.tmp-<host>-<pid>`` sibling (within ``NAME_MAX``) renamed over the output when
complete, and first removes such siblings of killed runs (:func:`reclaim_stale_files`).

The package: :mod:`~dlrmctl.outputs.markers` (the marker, :func:`kind_of`, what may be replaced or
adopted), :mod:`~dlrmctl.outputs.swap` (temporaries, the swap, a dataset's build target),
:mod:`~dlrmctl.outputs.lock` (one writer at a time), :mod:`~dlrmctl.outputs.files` (single output
files); every public name is importable from ``dlrmctl.outputs``.

Torch-free (imported by the command modules before torch).
"""

from dlrmctl.errors import OutputError
from dlrmctl.outputs.markers import (
    KINDS,
    LEGACY_TEMP_AGE_S,
    MARKER_NAME,
    MARKER_VERSION,
    check_adoptable,
    check_replaceable,
    foreign_entries,
    kind_of,
    not_ours,
    pid_alive,
    read_marker,
    write_marker,
)
from dlrmctl.outputs.swap import (
    PLACE_ERRNOS,
    REPLACED_DIR,
    DatasetTarget,
    dataset_target,
    finish_marker,
    make_temp_dir,
    place_error,
    reclaim_stale,
    set_aside_hint,
    swap_in,
)
from dlrmctl.outputs.lock import (
    lock_output,
    unlock_output,
)
from dlrmctl.outputs.files import (
    SCORES_HEADERS,
    atomic_file,
    check_file_replaceable,
    is_scores_csv,
    reclaim_stale_files,
    temp_file,
)

__all__ = [
    "OutputError",
    "KINDS",
    "LEGACY_TEMP_AGE_S",
    "MARKER_NAME",
    "MARKER_VERSION",
    "check_adoptable",
    "check_replaceable",
    "foreign_entries",
    "kind_of",
    "not_ours",
    "pid_alive",
    "read_marker",
    "write_marker",
    "PLACE_ERRNOS",
    "REPLACED_DIR",
    "DatasetTarget",
    "dataset_target",
    "finish_marker",
    "make_temp_dir",
    "place_error",
    "reclaim_stale",
    "set_aside_hint",
    "swap_in",
    "lock_output",
    "unlock_output",
    "SCORES_HEADERS",
    "atomic_file",
    "check_file_replaceable",
    "is_scores_csv",
    "reclaim_stale_files",
    "temp_file",
]
