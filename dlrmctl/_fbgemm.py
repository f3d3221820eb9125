"""Loading FBGEMM-GPU against the installed torch.

FBGEMM's wheels are compiled against one torch release; loading a wheel built
for another torch fails with an ``undefined symbol`` error (or, worse, loads and
misses operators).  This is the most common install failure of TorchRec-style
stacks, so we check it once at import and turn it into a message that names
both versions and the pair that works.

Known-good pairs (from the FBGEMM release notes): torch 2.13.x with
fbgemm-gpu(-cpu) 1.8.0.  fbgemm-gpu 1.9 is built for a newer torch and does not
load against 2.13.

The check is lazy: importing :mod:`dlrmctl` does not import torch (``dlrmctl --help``
and configuration errors stay fast).  It runs once, on the first read of
``HAS_FBGEMM`` / ``FBGEMM_IMPORT_ERROR`` here or in :mod:`dlrmctl`, or on a call of
:func:`ensure_checked` (the modules that use FBGEMM's operators do one of these first).
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util

from dlrmctl.errors import UserError

#: torch minor release -> fbgemm-gpu release known to load against it.
KNOWN_GOOD_PAIRS: dict[str, str] = {"2.13": "1.8.0"}

# ``HAS_FBGEMM`` and ``FBGEMM_IMPORT_ERROR`` become module globals when the check has run
# (module ``__getattr__`` below runs it on their first read).
_CHECKED = False


class FbgemmTorchMismatchError(ImportError, UserError):
    """Raised when ``fbgemm_gpu`` is installed but cannot load against ``torch``."""


def _installed_version(*dists: str) -> str | None:
    for d in dists:
        try:
            return md.version(d)
        except md.PackageNotFoundError:
            continue
    return None


def check_torch_fbgemm_pair() -> bool:
    """Import ``fbgemm_gpu`` if installed and verify its operators are registered.

    Returns:
        True if FBGEMM is usable, False if it is not installed (the ``dense``
        kernel will be used).

    Raises:
        FbgemmTorchMismatchError: fbgemm_gpu is installed but fails to load or
            lacks the table-batched-embedding operators; the message names the
            torch and fbgemm versions and the pair to install.
    """
    global HAS_FBGEMM, FBGEMM_IMPORT_ERROR, _CHECKED
    import torch

    if importlib.util.find_spec("fbgemm_gpu") is None:
        HAS_FBGEMM, FBGEMM_IMPORT_ERROR, _CHECKED = False, "fbgemm_gpu is not installed", True
        return False
    torch_v = torch.__version__.split("+")[0]
    fb_v = _installed_version("fbgemm-gpu-cpu", "fbgemm-gpu", "fbgemm_gpu_cpu", "fbgemm_gpu")
    minor = ".".join(torch_v.split(".")[:2])
    want = KNOWN_GOOD_PAIRS.get(minor)
    hint = (
        f"install the matching pair: pip install torch=={minor}.0 fbgemm-gpu-cpu=={want} "
        f"(CPU) or fbgemm-gpu=={want} (CUDA)"
        if want
        else "install torch==2.13.0 with fbgemm-gpu(-cpu)==1.8.0"
    )
    try:
        import fbgemm_gpu  # noqa: F401
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: F401
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        torch.ops.fbgemm.asynchronous_complete_cumsum  # noqa: B018  (operator registered?)
    except Exception as e:  # ImportError, OSError (undefined symbol), AttributeError
        # not marked as checked: every later use raises this again (no silent fallback)
        raise FbgemmTorchMismatchError(
            f"fbgemm_gpu {fb_v} does not load against torch {torch.__version__}: "
            f"{type(e).__name__}: {str(e)[:300]}. {hint}. "
            "Or uninstall fbgemm_gpu to fall back to the dense (torch.nn.EmbeddingBag) kernel."
        ) from e
    HAS_FBGEMM, FBGEMM_IMPORT_ERROR, _CHECKED = True, None, True
    return True


def ensure_checked() -> bool:
    """Run :func:`check_torch_fbgemm_pair` once (imports torch); returns ``HAS_FBGEMM``.

    Raises:
        FbgemmTorchMismatchError: see :func:`check_torch_fbgemm_pair` (raised again on every call).
    """
    if not _CHECKED:
        return check_torch_fbgemm_pair()
    return bool(globals()["HAS_FBGEMM"])


def fused_kernel_available() -> bool:
    """Whether a table asking for the ``fused`` (FBGEMM TBE) kernel gets it in this process.

    The one decision of which kernel runs: the embedding modules build the ``dense`` kernel
    (``torch.nn.EmbeddingBag``) instead when this is False (fbgemm_gpu not installed), and the
    planner -- the plan ``train`` makes and the one ``dlrmctl plan`` writes -- then costs and
    names the ``dense`` kernel for every table.  Imports torch (the first call only).

    Raises:
        FbgemmTorchMismatchError: fbgemm_gpu is installed but does not load (see
            :func:`check_torch_fbgemm_pair`).
    """
    return ensure_checked()


def __getattr__(name: str):  # PEP 562: the check runs on the first read of its results
    if name in ("HAS_FBGEMM", "FBGEMM_IMPORT_ERROR"):
        ensure_checked()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
