"""dlrmctl: train, shard, plan and ship DLRM recommendation models.

Importing the package checks that the installed ``torch`` / ``fbgemm_gpu`` pair
loads together (see :mod:`dlrmctl._fbgemm`).  A missing ``fbgemm_gpu`` is not an
error: the ``dense`` embedding kernel (``torch.nn.EmbeddingBag``) is used instead.
An installed but ABI-incompatible ``fbgemm_gpu`` *is* an error, raised at import
with both versions and the pair to install.
"""

__version__ = "0.1.0"

from dlrmctl._fbgemm import check_torch_fbgemm_pair  # noqa: E402

HAS_FBGEMM: bool = check_torch_fbgemm_pair()

__all__ = ["HAS_FBGEMM", "__version__"]
