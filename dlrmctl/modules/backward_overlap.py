"""The embedding lookup's backward on a side thread, overlapping the dense backward (CPU).

On the CPU, FBGEMM's table-batched embedding (TBE) backward — the gradient sort, the fused
optimizer's row updates — runs on one thread: measured on the bench model (26 tables x 2048
ids, row-wise Adagrad), 2.9 ms with 1 intra-op thread and 3.0 ms with 2.  The dense backward
that follows it (the bottom MLP's GEMMs) uses every intra-op thread, so in a plain backward one
core idles during the TBE.  :class:`EmbeddingBackwardOverlap` hands the pooled embeddings'
gradient to a worker thread, which runs the lookup's backward while the autograd engine goes on
with the bottom MLP on the calling thread; the engine joins the worker before ``backward()``
returns (an engine callback, as DDP's gradient sync), so the tables are updated when
``loss.backward()`` returns, exactly as without it.

The same ops run on the same values in the same order per graph, so losses and parameters are
bit-identical with and without it.  It applies only where it can help: tensors on the CPU, grad
mode on, the pooled embeddings requiring grad, and more than one intra-op thread
(:func:`torch.get_num_threads`); otherwise :meth:`EmbeddingBackwardOverlap.wrap` returns its
input unchanged.  On CUDA the kernels are asynchronous already (the pipeline's streams overlap
them), so it is never used there.

One difference on failure: if the dense backward raises after the embeddings' gradient was
handed over, the worker may still apply the embedding update for that step (without the
overlap the TBE backward runs last and would not).  A failed backward ends the run; checkpoints
on disk are unaffected.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
import torch

__all__ = ["EmbeddingBackwardOverlap"]


def _worker_init() -> None:
    # the TBE backward is single-threaded anyway; one intra-op thread here keeps the worker's
    # own ops (the gradient's contiguous copy, the sort) from starting a second OpenMP team that
    # would compete with the dense backward's threads (thread-local: the caller keeps its count)
    torch.set_num_threads(1)


class _SideThreadBackward(torch.autograd.Function):
    """``held[0]``: ``values [B, W]`` attached to the lookup's graph -> the same values, detached
    from it and attached to this node (through ``anchor``, a grad-requiring empty leaf: the
    lookup's graph must not be an input of this node, or the engine would also walk into it);
    backward hands ``grad [B, W]`` to the worker, which runs ``values``' own backward (the TBE
    backward), and queues an engine callback that waits for it."""

    @staticmethod
    def forward(ctx, overlap: "EmbeddingBackwardOverlap", held: list, anchor: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.overlap = overlap
        ctx.held = held
        return held[0].detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        values = ctx.held.pop()  # the graph-attached tensor: its backward runs on the worker
        fut = ctx.overlap._submit(values, grad)
        torch.autograd.Variable._execution_engine.queue_callback(fut.result)
        return None, None, None


class EmbeddingBackwardOverlap:
    """Runs the embedding lookup's backward on one worker thread during the dense backward.

    Usage (the trainer, unsharded model, CPU)::

        overlap = EmbeddingBackwardOverlap()
        kt = ebc(features)                                   # KeyedTensor [B, sum dims]
        d = model.dense_arch(dense)                          # the bottom MLP's forward first
        kt = KeyedTensor(kt.keys(), kt.length_per_key(), overlap.wrap(kt.values()))
        loss(model.over_arch(model.inter_arch(d, kt))).backward()   # tables updated on return
        ...
        overlap.close()

    :meth:`wrap` must be called AFTER the bottom MLP's forward (the trainer hands
    ``DLRM.dense_forward`` an awaitable that wraps when it is waited on, after the dense arch):
    the autograd engine runs ready nodes newest first, so the wrap's node then runs as soon as the
    interaction's backward has produced the embeddings' gradient, and the worker starts before the
    bottom MLP's backward.  Wrapped before the dense arch, it would run after it: no overlap.

    The worker runs one backward at a time; :meth:`close` stops it (also at interpreter exit).
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._anchor = torch.empty(0, requires_grad=True)

    def active_for(self, values: torch.Tensor) -> bool:
        """Whether :meth:`wrap` defers ``values``' backward: CPU tensor requiring grad, grad
        mode on, more than one intra-op thread, and not closed."""
        return (
            not self._closed
            and values.device.type == "cpu"
            and values.requires_grad
            and torch.is_grad_enabled()
            and torch.get_num_threads() > 1
        )

    def wrap(self, values: torch.Tensor) -> torch.Tensor:
        """``values [B, W]`` float (the lookup's output, attached to its graph) -> the same
        values; in backward their gradient reaches the lookup on the worker thread.  Returns
        ``values`` itself where the overlap does not apply (see :meth:`active_for`)."""
        if not self.active_for(values):
            return values
        return _SideThreadBackward.apply(self, [values], self._anchor)

    def _submit(self, values: torch.Tensor, grad: torch.Tensor) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="dlrmctl-emb-bwd", initializer=_worker_init)
        return self._pool.submit(torch.autograd.backward, values, grad)

    def close(self) -> None:
        """Wait for a running backward and stop the worker; :meth:`wrap` then returns its input."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
