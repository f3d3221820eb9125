"""Mixed precision of a training step (``train.precision``): autocast of the dense part, and
under fp16 the GradScaler with the pooled embeddings' gradient unscaled where it leaves the
dense part (:class:`_UnscaleGrad`) and the step skipped on overflow.

Only GradScaler's public API is used (``scale``, ``unscale_``, ``step``, ``update``): the scale as
a device tensor is ``scaler.scale(one)``, the embeddings' overflow reaches the scaler as a NaN in a
dense gradient before ``unscale_``, and whether the dense step ran is seen by the optimizer's step
hook.  Host reads per fp16 step: the one ``scaler.step`` makes (its inf check), none of ours.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from dlrmctl.distributed import comm
from dlrmctl.sparse import KeyedTensor
from dlrmctl.train.run_dir import TrainError

if TYPE_CHECKING:
    from dlrmctl.train.optimizers import TrainOptimizers


class _UnscaleGrad(torch.autograd.Function):
    """Identity forward; backward divides the gradient by the GradScaler's current scale.

    Under ``train.precision: fp16`` the loss is scaled, but the embedding optimizers run
    inside the lookup's backward (FBGEMM's fused TBE) or straight after it on their own
    gradients: they must see the true gradient of the pooled embeddings, so it is unscaled
    where it leaves the dense part.

    Overflow: the scaler's first scales (2^16, growing) overflow fp16 now and then by design
    (Micikevicius et al., "Mixed Precision Training", ICLR 2018, sec. 3.2); the scaler then
    skips the dense step and halves the scale.  A fused embedding update cannot be skipped
    (it runs inside this backward), so a gradient ``[N, D]`` float32 with any inf/NaN is
    replaced by zeros (rows unchanged under the Adagrad family and SGD; Adam-family moments
    take one zero-gradient step) and ``found_inf`` (a 0-d float32 device tensor) is set to
    1, which :meth:`MixedPrecision.backward_and_step` hands to the scaler so that it also skips the dense
    step and backs off.  The flag is max-reduced over ``pg`` here, before the gradient goes
    back through the output_dist: a rank whose own gradient is finite zeroes it too, so no
    table takes a partial update from the other ranks' rows on a step every rank skips.  No
    host read here (the all-reduce runs on the device's stream).
    """

    @staticmethod
    def forward(ctx, values: torch.Tensor, scaler: Any, found_inf: torch.Tensor,  # type: ignore[override]
                pg: Any = None) -> torch.Tensor:
        ctx.scaler = scaler
        ctx.found_inf = found_inf
        ctx.pg = pg
        return values.view_as(values)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        # the current scale as a 0-d device tensor (GradScaler.scale of a one): no host read
        g = grad / ctx.scaler.scale(torch.ones((), dtype=torch.float32, device=grad.device))
        bad = (~torch.isfinite(g).all()).to(ctx.found_inf.dtype)
        comm.all_reduce(bad, ctx.pg, op="max")  # every rank zeroes (and skips) the same step
        ctx.found_inf.add_(bad)
        return torch.where(bad > 0, torch.zeros((), dtype=g.dtype, device=g.device), g), None, None, None



class MixedPrecision:
    """``train.precision`` of one trainer: ``fp32`` (nothing), ``bf16`` (autocast of the dense
    part) or ``fp16`` (autocast and loss scaling, CUDA only).

    Attributes:
        scaler: fp16: the ``torch.amp.GradScaler`` of the dense optimizer; None otherwise (a
            test may put one on a CPU trainer: the scaling path is device-agnostic).
        found_inf: 0-d float32 on the device: 1 when this step's pooled-embedding gradient was
            non-finite (set by :class:`_UnscaleGrad`).

    Raises:
        TrainError: fp16 on a device other than CUDA.
    """

    def __init__(self, precision: str, device: torch.device, pg: Any = None) -> None:
        if precision == "fp16" and device.type != "cuda":
            raise TrainError(f"train.precision: fp16 autocast needs CUDA (a GradScaler on a GPU), the device is "
                             f"{device}; use bf16 on the CPU")
        self.precision = precision
        self.device = device
        self.pg = pg
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        self.found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self._dense_stepped = False  # set by the dense optimizer's step hook (see _watch)
        self._watched: set[int] = set()

    def autocast(self, enabled: bool = True) -> Any:
        """``torch.autocast`` for ``train.precision`` on this device (fp32 or ``enabled=False``:
        a no-op context)."""
        if self.precision == "fp32" or not enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16 if self.precision == "bf16" else torch.float16)

    def unscale_embeddings(self, embedded: Any) -> Any:
        """With a scaler: the pooled embeddings (``KeyedTensor [B, sum dims]`` float32, or its
        Awaitable, waited on here) with :class:`_UnscaleGrad` on their values; else ``embedded``
        unchanged (an Awaitable stays one)."""
        if self.scaler is None:
            return embedded
        if not isinstance(embedded, KeyedTensor):
            embedded = embedded.wait()
        if embedded.values().requires_grad:
            embedded = KeyedTensor(embedded.keys(), embedded.length_per_key(),
                                   _UnscaleGrad.apply(embedded.values(), self.scaler, self.found_inf, self.pg))
        return embedded

    def backward_and_step(self, loss: torch.Tensor, optimizers: "TrainOptimizers") -> None:
        """Backward of ``loss`` (0-d) and the optimizers' step: under fp16 the loss is scaled, the
        dense step is skipped (and the scale backed off) when the dense or the embeddings' gradient
        overflowed, and the dense-kernel table optimizer follows the dense step's fate."""
        if self.scaler is None:
            loss.backward()  # sharded: dense grads are all-reduced in buckets during backward
            optimizers.step()
            return
        self._watch(optimizers.dense)
        self.found_inf.zero_()
        self.scaler.scale(loss).backward()
        self._fold_embedding_overflow(optimizers.dense)
        self.scaler.unscale_(optimizers.dense)
        self._dense_stepped = False
        self.scaler.step(optimizers.dense)  # skips the step on inf/NaN dense or embedding grads (one host read)
        self.scaler.update()  # and then backs off the scale
        optimizers.step(dense=False, embedding_dense=self._dense_stepped)

    def _watch(self, dense_opt: torch.optim.Optimizer) -> None:
        """Register (once per optimizer) a step post-hook that records that ``dense_opt.step()`` ran:
        ``GradScaler.step`` calls it only when no gradient overflowed, so after ``scaler.step`` the
        flag says whether the step was skipped, with no host read of ours.

        Raises:
            TrainError: an optimizer that takes the scaler's inf flag inside its own step (``fused=True``,
                ``_step_supports_amp_scaling``): its step always runs, so the hook could not tell.
        """
        if id(dense_opt) in self._watched:
            return
        if getattr(dense_opt, "_step_supports_amp_scaling", False):
            raise TrainError("train.precision: fp16 needs a dense optimizer that GradScaler steps itself "
                             "(foreach or for-loop), not a fused one")

        def stepped(*_: Any) -> None:
            self._dense_stepped = True

        dense_opt.register_step_post_hook(stepped)
        self._watched.add(id(dense_opt))

    def _fold_embedding_overflow(self, dense_opt: torch.optim.Optimizer) -> None:
        """Before ``unscale_``: when the pooled embeddings' gradient overflowed (``found_inf``, already
        max-reduced over ranks by :class:`_UnscaleGrad`, so every rank skips the same step and keeps the
        same scale), put a NaN into the first element of the first dense gradient.  ``unscale_`` then
        records an overflow, ``scaler.step`` skips the dense step and ``scaler.update`` backs off, as for
        an overflow of the dense part itself; the poisoned gradient is never applied and is zeroed at the
        next step.  One element-wise add on the device, no host read.  A dense optimizer whose
        parameters have no gradient at all gets a zero gradient on its first parameter to carry it."""
        grads = [p for group in dense_opt.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            p0 = dense_opt.param_groups[0]["params"][0]
            p0.grad = torch.zeros_like(p0)
            grads = [p0]
        g = grads[0].grad
        flag = self.found_inf.to(g.device)
        g[(0,) * g.dim()].add_(torch.where(flag > 0, float("nan"), 0.0).to(g.dtype))  # a 0-d view: in place
