"""Embedding optimizers: the registry and the update rules of the ``dense`` kernel
(the place of TorchRec's ``torchrec/optim/``; below ``modules`` and ``distributed``).

* :mod:`~dlrmctl.optim.registry`: one :class:`~dlrmctl.optim.registry.EmbeddingOptimizer`
  record per optimizer (FBGEMM type, rule class, state bytes, row coupling, sparse gradients,
  fp16, aliases), read by config validation, the modules, the planner and the checkpoint.
  No torch import.
* :mod:`~dlrmctl.optim.rows`: the rows of a step and their summed gradient without a host sync;
  fp32 row updates of fp16 tables.
* :mod:`~dlrmctl.optim.adagrad`: ``exact_rowwise_adagrad``, ``exact_adagrad``, ``exact_sgd``.
* :mod:`~dlrmctl.optim.adam`: ``adam``, ``partial_rowwise_adam``, ``lamb``, ``partial_rowwise_lamb``.
* :mod:`~dlrmctl.optim.dense`: :func:`~dlrmctl.optim.dense.embedding_optimizer_for_dense` (the
  registry's rule for a config), :func:`~dlrmctl.optim.dense.dense_optimizer` (the MLPs'),
  :func:`~dlrmctl.optim.dense.row_state_tensors`.

This ``__init__`` imports nothing, so that reading the registry does not load torch; import
from the submodules.
"""
