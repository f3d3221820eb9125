"""The MLP of DLRM's dense and over arches (Linear + ReLU stack, the reference's init) and its CPU
training kernels: oneDNN's fp32 linear with the ReLU fused (:class:`OneDNNLinear`,
``train.cpu_linear``) and a first layer that computes only the weight gradient; which one a run
takes on this machine (:func:`resolve_cpu_linear`, :func:`apply_cpu_linear`).  Evaluation,
``no_grad``, autocast, CUDA and tracing always run ``F.linear``."""

from __future__ import annotations

import os
import warnings
from typing import Sequence

import torch
from torch import nn


class _WeightGradOnlyLinear(torch.autograd.Function):
    """``addmm(bias, x, W^T)`` (what ``F.linear`` runs for a 2-D input) for an input that needs no
    gradient (the dense features entering the dense arch): ``x [B, in]``, ``W [out, in]``,
    ``bias [out]`` float32 -> ``[B, out]``.

    Backward: ``dW = (x^T g)^T`` and ``d bias = g.sum(0)``, no ``dx``.  Autograd's addmm backward
    computes ``dW`` as ``g^T x`` (it keeps the layout of ``W^T``); for a narrow input (Criteo: 13
    features, ``[512, 2048] x [2048, 13]``) that GEMM shape is slow on the CPU: 1.08 vs 0.40 ms on
    1 thread, 0.54 vs 0.27 ms on 2 (B 2048, ``out`` 512, best of 40 alternated, 2-core AMD EPYC).
    Every entry is the same length-``B`` dot product; this machine's CPU GEMM gives the same bits
    both ways (another BLAS may sum in another order: the result then differs by rounding only;
    ``tests/modules/test_dlrm.py`` compares the gradients with autograd's).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return torch.addmm(bias, x, weight.t())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        dw = torch.mm(x.t(), grad).t().contiguous() if ctx.needs_input_grad[1] else None
        db = grad.sum(0) if ctx.needs_input_grad[2] else None
        return None, dw, db


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN's fp32 linear (``torch.ops.mkldnn._linear_pointwise``)
    for :class:`MLP`'s ``cpu_linear = "onednn"``."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


def _lp(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, relu: bool = False) -> torch.Tensor:
    """oneDNN ``x @ w^T + b`` (then ReLU): ``x [M, K]``, ``w [N, K]`` (any strides) -> ``[M, N]``."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "relu" if relu else "none", [], "")


class OneDNNLinear(torch.autograd.Function):
    """One MLP layer on the CPU through oneDNN's fp32 GEMM: ``x [B, in]``, ``W [out, in]``,
    ``bias [out]`` float32 -> ``relu?(x W^T + bias)`` ``[B, out]``.

    oneDNN's AVX-512 fp32 kernels run this machine's MLP GEMMs 2.0-2.4x faster than the MKL
    ``sgemm`` ATen's ``addmm`` calls (2-core AMD EPYC, B 2048: 487 vs 216 GFLOP/s on 2 threads,
    251 vs 111 on 1; MKL takes a generic path on non-Intel CPUs).  Same formula in fp32
    arithmetic (max relative error 1.2e-6 against float64 where MKL's is 4.7e-7), not the same
    bits: the two libraries block the sums differently.

    Forward: one call with the bias fused, then (``relu``) an in-place ``torch.relu_``: oneDNN's
    fused ReLU maps NaN to 0, which would hide a diverged layer from the non-finite loss check;
    ``torch.relu`` keeps NaN as ``F.linear`` + ReLU does.  Backward, with ``g`` the output gradient (after the ReLU's mask when ``relu``): ``dx = g W`` (skipped when ``x`` needs no
    gradient), ``dW = g^T x`` (``(x^T g)^T`` when ``in < out / 4``, the faster shape for a narrow
    input such as Criteo's 13 dense features), ``d bias = g.sum(0)`` as autograd's addmm backward.
    Once differentiable (a ``create_graph`` double backward raises instead of giving zeros).
    :class:`MLP` never sends it an empty batch (oneDNN has no empty GEMM: ``F.linear`` runs it).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,  # type: ignore[override]
                relu: bool) -> torch.Tensor:
        # the ReLU runs after the GEMM, not fused into it: oneDNN's fused ReLU maps NaN to 0, so a
        # diverged layer would train on with finite outputs and a finite loss (torch.relu keeps NaN)
        y = _lp(x, weight, bias)
        if relu:
            y = torch.relu_(y)
        ctx.relu = relu
        ctx.save_for_backward(x, weight, y if relu else None)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable  # oneDNN's op has no derivative: a double backward is an error
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        x, weight, y = ctx.saved_tensors
        if ctx.relu:
            g = torch.ops.aten.threshold_backward(g, y, 0)
        g = g.contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _lp(g, weight.t(), None)
        if ctx.needs_input_grad[1]:
            n_in, n_out = weight.shape[1], weight.shape[0]
            dw = _lp(x.t(), g.t(), None).t().contiguous() if 4 * n_in < n_out else _lp(g.t(), x.t(), None)
        if ctx.needs_input_grad[2]:
            db = g.sum(0)
        return dx, dw, db, None


CPU_LINEAR_CHOICES = ("aten", "onednn")
#: environment variable that decides ``train.cpu_linear: auto`` instead of the CPU's vendor
#: (``aten`` | ``onednn``; unset or empty: the vendor decides), e.g. to test the oneDNN path on an Intel CPU
CPU_LINEAR_ENV = "DLRMCTL_CPU_LINEAR"


def resolve_cpu_linear(kind: str, vendor: str | None = None) -> tuple[str, str]:
    """The GEMM library ``train.cpu_linear`` picks, and why.

    ``aten`` and ``onednn`` are themselves.  ``auto`` is ``onednn`` on an x86 CPU that is not
    Intel's (``vendor_id`` ``AuthenticAMD``, ``HygonGenuine``, ...) when the torch build has oneDNN's
    linear, else ``aten``: MKL's sgemm, which ``F.linear`` calls on x86 builds, ran at 0.4-0.5x
    oneDNN's fp32 GEMM on an AMD EPYC (the bench model trained 1.35-1.5x faster on oneDNN) and at
    the same rate on an Intel Xeon (0.98x; benchmarks/training_throughput.md).  The choice depends
    only on the machine, never on a timing, so a run is reproducible on it.  The environment
    variable ``DLRMCTL_CPU_LINEAR`` (``aten`` | ``onednn``), when set and not empty, decides
    ``auto`` instead of the vendor (an explicit ``aten`` / ``onednn`` in the config still wins).

    Args:
        kind: ``auto``, ``aten`` or ``onednn``.
        vendor: the CPU vendor string (default :func:`dlrmctl.procs.cpu_vendor`).

    Returns:
        ``(library, why)``: ``aten`` or ``onednn``, and a few words for the console.

    Raises:
        ValueError: ``kind`` is none of the three, or ``DLRMCTL_CPU_LINEAR`` is set to
            something other than ``aten`` / ``onednn``.
    """
    if kind in CPU_LINEAR_CHOICES:
        return kind, f"train.cpu_linear {kind}"
    if kind != "auto":
        raise ValueError(f"train.cpu_linear: expected one of {['auto', *CPU_LINEAR_CHOICES]}, got {kind!r}")
    forced = os.environ.get(CPU_LINEAR_ENV, "").strip()
    if forced:
        if forced not in CPU_LINEAR_CHOICES:
            raise ValueError(f"{CPU_LINEAR_ENV}: expected one of {list(CPU_LINEAR_CHOICES)}, got {forced!r}")
        return forced, f"train.cpu_linear auto: {CPU_LINEAR_ENV}={forced}"
    if vendor is None:
        from dlrmctl.procs import cpu_vendor

        vendor = cpu_vendor()
    if vendor is None or vendor == "GenuineIntel":
        return "aten", f"train.cpu_linear auto: {vendor or 'CPU vendor unknown'}"
    if not onednn_linear_available():
        return "aten", f"train.cpu_linear auto: {vendor}, but this torch build has no oneDNN linear"
    return "onednn", f"train.cpu_linear auto: {vendor} CPU"


def cpu_fp32_training(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``module`` runs a CPU fp32 training step on ``x [B, in]``: training mode, grad
    enabled, a 2-D float32 CPU input, no autocast, not tracing / scripting (the case the CPU
    training kernels of this module — :class:`OneDNNLinear`, :class:`_WeightGradOnlyLinear` — are for)."""
    return (module.training and x.dim() == 2 and x.device.type == "cpu" and x.dtype == torch.float32
            and torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
            and not torch.jit.is_tracing() and not torch.jit.is_scripting())


def set_cpu_linear(model: nn.Module, kind: str) -> int:
    """Pick the GEMM library of every :class:`MLP` (and DCN ``LowRankCrossNet``: every module
    class with a ``cpu_linear`` attribute) in ``model`` for CPU training
    (``train.cpu_linear``): ``aten`` (``F.linear``: MKL on x86 builds) or ``onednn``
    (:class:`OneDNNLinear`).  Evaluation, ``no_grad``, autocast, CUDA and TorchScript tracing
    always use ``F.linear``, so evaluation and export give the same values whatever is picked.

    Returns:
        the number of modules set.

    Raises:
        ValueError: ``kind`` not in :data:`CPU_LINEAR_CHOICES`, or ``onednn`` on a torch build
            without oneDNN's linear.
    """
    if kind not in CPU_LINEAR_CHOICES:
        raise ValueError(f"train.cpu_linear: expected one of {list(CPU_LINEAR_CHOICES)}, got {kind!r}")
    if kind == "onednn" and not onednn_linear_available():
        raise ValueError("train.cpu_linear: onednn needs a torch build with oneDNN (torch.backends.mkldnn) and its "
                         "linear op (torch.ops.mkldnn._linear_pointwise); use aten")
    mods = [m for m in model.modules() if hasattr(type(m), "cpu_linear")]
    for m in mods:
        m.cpu_linear = kind
    return len(mods)


def apply_cpu_linear(model: nn.Module, kind: str, device: torch.device, precision: str) -> str | None:
    """Resolve ``train.cpu_linear`` on this machine (:func:`resolve_cpu_linear`) and set it on
    ``model`` (:func:`set_cpu_linear`).  Returns the console line to print when the MLPs train on
    oneDNN (CPU fp32 training), else None.

    Raises:
        ValueError: as :func:`resolve_cpu_linear` and :func:`set_cpu_linear`.
    """
    lib, why = resolve_cpu_linear(kind)
    if lib == "aten":
        return None
    set_cpu_linear(model, lib)
    if torch.device(device).type != "cpu" or precision != "fp32":
        return None
    return f"the MLPs train on oneDNN's fp32 GEMM ({why}; --set train.cpu_linear=aten: MKL's)"


def linear_layer(in_features: int, out_features: int, bias: bool = True) -> nn.Linear:
    """``nn.Linear(in_features, out_features, bias)``, also for a model without dense inputs
    (``in_features`` 0, e.g. Avazu): its ``[out, 0]`` weight has nothing to initialise, and torch's
    "zero-element tensors" warning about it is not shown (the default init draws the same random
    numbers either way)."""
    with warnings.catch_warnings():
        if in_features == 0:
            warnings.filterwarnings("ignore", "Initializing zero-element tensors is a no-op", UserWarning)
        return nn.Linear(in_features, out_features, bias=bias)


class MLP(nn.Module):
    """Linear + ReLU stack.

    Args:
        in_features: input width.
        layer_sizes: output width of each layer.
        final_activation: apply ReLU after the last layer too (DenseArch: yes;
            OverArch: no, its last layer emits logits).
        dropout: in training mode, zero each activation after every ReLU that feeds another
            layer with this probability and scale the rest by ``1 / (1 - dropout)``
            (``torch.nn.functional.dropout``); nothing in eval mode, nothing after the last layer.
            Applied in :meth:`forward`, so the parameter names (``model.<i>.weight``) do not
            depend on it.

    Forward: ``[B, in_features]`` float32 -> ``[B, layer_sizes[-1]]``.

    Raises:
        ValueError: ``dropout`` outside ``[0, 1)``.
    """

    def __init__(self, in_features: int, layer_sizes: Sequence[int], final_activation: bool = True,
                 dropout: float = 0.0) -> None:
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"MLP dropout must be in [0, 1), got {dropout}")
        self.dropout = float(dropout)
        layers: list[nn.Module] = []
        prev = in_features
        for i, n in enumerate(layer_sizes):
            lin = linear_layer(prev, n)
            # DLRM reference init (dlrm_s_pytorch.py create_mlp): W ~ N(0, sqrt(2/(fan_in+fan_out))),
            # b ~ N(0, sqrt(1/fan_out)).
            nn.init.normal_(lin.weight, 0.0, (2.0 / (prev + n)) ** 0.5)
            nn.init.normal_(lin.bias, 0.0, (1.0 / n) ** 0.5)
            layers.append(lin)
            if i < len(layer_sizes) - 1 or final_activation:
                # in place on the addmm output (bias already fused into the GEMM by F.linear):
                # no second [B, n] buffer per layer, same values
                layers.append(nn.ReLU(inplace=True))
            prev = n
        self.model = nn.Sequential(*layers)
        self.out_features = prev
        # indices in self.model of the ReLUs that feed another Linear (dropout goes after them)
        self._drop_after = [i for i, m in enumerate(layers) if isinstance(m, nn.ReLU) and i < len(layers) - 1]
        #: (Linear, ReLU after it, dropout after that ReLU) per layer: the oneDNN training forward
        self._fused_layers = [(m, i + 1 < len(layers) and isinstance(layers[i + 1], nn.ReLU),
                               self.dropout > 0.0 and i + 1 in self._drop_after)
                              for i, m in enumerate(layers) if isinstance(m, nn.Linear)]

    #: GEMM library for CPU training (:func:`set_cpu_linear`, ``train.cpu_linear``)
    cpu_linear: str = "aten"

    def _onednn_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Training forward through :class:`OneDNNLinear`, each Linear with its following ReLU
        (dropout, when on, after the ReLU as in :meth:`forward`)."""
        for lin, relu, drop in self._fused_layers:
            x = OneDNNLinear.apply(x, lin.weight, lin.bias, relu)
            if drop:
                x = torch.nn.functional.dropout(x, self.dropout, training=True)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        drop = self.training and self.dropout > 0.0
        training = cpu_fp32_training(self, x)
        # oneDNN has no empty GEMM (a rank's empty last batch): F.linear runs those
        if training and self.cpu_linear == "onednn" and x.shape[0] > 0 and x.shape[1] > 0:
            return self._onednn_forward(x)
        # training on the CPU with an input that needs no gradient (the dense arch): the first
        # layer skips dx and computes dW in the faster GEMM shape (_WeightGradOnlyLinear)
        first = (training and not x.requires_grad
                 and isinstance(self.model[0], nn.Linear) and self.model[0].bias is not None
                 and self.model[0].weight.requires_grad and self.model[0].bias.requires_grad)
        if not (drop or first):
            return self.model(x)
        for i, layer in enumerate(self.model):
            if i == 0 and first:
                x = _WeightGradOnlyLinear.apply(x, layer.weight, layer.bias)
            else:
                x = layer(x)
            if drop and i in self._drop_after:
                x = torch.nn.functional.dropout(x, self.dropout, training=True)
        return x
