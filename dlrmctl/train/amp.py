"""Mixed precision of a training step (``train.precision``): autocast of the dense part, and
under fp16 the GradScaler with the pooled embeddings' gradient unscaled where it leaves the
dense part (:class:`_UnscaleGrad`) and the step skipped on overflow.

This is the only module that reads GradScaler's per-optimizer state (``_per_optimizer_states``,
stable since torch 1.6).
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
        scale = ctx.scaler._get_scale_async()  # the scale as a device tensor: no host read
        g = grad / (scale if scale is not None else ctx.scaler.get_scale())
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
        self.found_inf.zero_()
        self.scaler.scale(loss).backward()
        self._unscale_dense(optimizers.dense)
        # read only when a dense-kernel table optimizer must follow the dense step's fate
        skipped = optimizers.embedding_dense is not None and self._step_skipped(optimizers.dense)
        self.scaler.step(optimizers.dense)  # skips the step on inf/NaN dense or embedding grads
        self.scaler.update()  # and then backs off the scale
        optimizers.step(dense=False, embedding_dense=not skipped)

    def _unscale_dense(self, dense_opt: torch.optim.Optimizer) -> None:
        """fp16: unscale the dense grads and fold the embeddings' overflow flag into the scaler.

        ``GradScaler.unscale_`` records the dense grads' inf/NaN per device; the pooled-embedding
        gradient's flag (:class:`_UnscaleGrad`, already max-reduced over ranks in the backward, so
        that every rank skips the same step and keeps the same scale) is added to it, so ``scaler.step`` skips the dense step and
        ``scaler.update`` backs off whenever either overflowed.  No host read."""
        assert self.scaler is not None
        self.scaler.unscale_(dense_opt)
        found = self.scaler._per_optimizer_states[id(dense_opt)]["found_inf_per_device"]
        if not found:  # no dense grads on any device: give the scaler one flag to read
            found[self.found_inf.device] = torch.zeros((), dtype=torch.float32, device=self.device)
        for t in found.values():
            t.add_(self.found_inf.to(t.device))

    def _step_skipped(self, dense_opt: torch.optim.Optimizer) -> bool:
        """True when the scaler will skip this step (after :meth:`_unscale_dense`; one host
        read, the one ``scaler.step`` makes anyway)."""
        assert self.scaler is not None
        found = self.scaler._per_optimizer_states[id(dense_opt)]["found_inf_per_device"]
        return bool(sum(float(t.item()) for t in found.values()))
