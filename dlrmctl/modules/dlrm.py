"""DLRM (Naumov et al., "Deep Learning Recommendation Model for Personalization
and Recommendation Systems", 2019) with TorchRec's module names.

    dense [B, D_in] --DenseArch (MLP, ReLU)--> [B, d]
    sparse KJT --EmbeddingBagCollection--> KeyedTensor [B, F*d]
    InteractionArch: [dense, F pooled] -> [dense | upper-triangle pairwise dots]
    OverArch (MLP, ReLU, last layer linear) -> logits [B, 1]

The interaction is pluggable (``dot``; ``dcn`` and ``projection`` live in
:mod:`dlrmctl.modules.interactions`).
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Sequence

import torch
from torch import nn

from dlrmctl.sparse import KeyedJaggedTensor, KeyedTensor


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


def _linear(in_features: int, out_features: int, bias: bool = True) -> nn.Linear:
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
            lin = _linear(prev, n)
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


class DenseArch(nn.Module):
    """MLP over the dense features: ``[B, D_in] -> [B, layer_sizes[-1]]`` (``dropout``: see :class:`MLP`)."""

    def __init__(self, in_features: int, layer_sizes: Sequence[int], dropout: float = 0.0) -> None:
        super().__init__()
        self.model = MLP(in_features, layer_sizes, final_activation=True, dropout=dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


#: zero rows appended to the interaction's ``T`` on the CPU, per ``(N, d, dtype, threads)``
#: (set once by :func:`_dot_row_pad`; tests may preset entries)
_ROW_PAD: dict[tuple[int, int, torch.dtype, int], int] = {}
_ROW_PAD_MIN_BATCH = 256  # smaller batches: no padding and no tuning (too little time to tell apart)


def _dot_row_pad(dense: torch.Tensor, values: torch.Tensor, dtype: torch.dtype) -> int:
    """Zero rows to append to ``T = [dense, values]`` (``[B, N, d]`` in ``dtype``, ``dense [B, d]``,
    ``values [B, (N-1) d]``) before the forward ``bmm(T, T^T)`` on the CPU.

    The CPU batched GEMM's speed depends on the row count in ways no simple rule covers (measured
    on a 2-core AMD EPYC, fp32, B = 2048, best of 25: ``N = 27, d = 64``: 2.75 ms, 28 rows 2.2 ms;
    ``d = 128``: 7.5 ms, 28 rows 5.0 ms; ``N = 13``: 1.03 ms, 16 rows 0.75 ms; ``N = 9``: 0.50 ms,
    10 or 12 rows slower).  So the first call per ``(N, d, dtype, intra-op threads)`` with
    ``B >= 256`` times ``N`` rows against ``N`` rounded up to a multiple of 4 and of 8 (best of 3
    each on ``t`` itself, ~10 bmms once) and keeps the fastest.  The padding adds only zero rows:
    ``Z[:N, :N]`` is the same dot products, bit for bit (each is the same length-``d`` product in
    the same order; tests/modules/test_dlrm.py checks it for the pads tried).  CUDA / other devices: 0.

    Returns:
        the number of zero rows (0 when unpadded is fastest, on other devices and for small batches).
    """
    B, d = dense.shape
    N = 1 + values.shape[1] // d
    if dense.device.type != "cpu" or B < _ROW_PAD_MIN_BATCH:
        return 0
    key = (N, d, dtype, torch.get_num_threads())
    pad = _ROW_PAD.get(key)
    if pad is None:
        import time

        t = torch.cat([dense, values], dim=1).view(B, N, d).to(dtype)
        best = (float("inf"), 0)
        for cand in sorted({0, -N % 4, -N % 8}):
            tp = torch.cat([t, t.new_zeros(B, cand, d)], dim=1) if cand else t
            torch.bmm(tp, tp.transpose(1, 2))
            for _ in range(3):
                t0 = time.perf_counter()
                torch.bmm(tp, tp.transpose(1, 2))
                best = min(best, (time.perf_counter() - t0, cand))
        pad = _ROW_PAD[key] = best[1]
    return pad


class _DotInteraction(torch.autograd.Function):
    """The whole training-mode dot interaction as one autograd node:
    ``dense [B, d]``, ``values [B, F*d]`` -> ``[B, d + (F+1)F/2]`` = ``[dense | triu(T T^T)]``
    with ``T = [dense, e_1..e_F]`` viewed ``[B, F+1, d]``.

    Forward: the same ops as the plain path (``cat`` -> one ``bmm`` -> ``index_select`` of the
    strict upper triangle -> ``cat`` after ``dense``), so its values are bit-identical to it; on
    the CPU ``T`` may carry zero rows after its ``N`` rows (:func:`_dot_row_pad`: a faster GEMM
    shape, the same dot products), which the triangle's indices skip.

    Backward, with ``g`` the output gradient (no autograd through the cats / slices):

    * the symmetric ``G [B, N, N]`` is gathered in one ``index_select`` straight from the pair
      columns of ``g`` (``g[:, d:]``, ``[B, P]``, ``P = N(N-1)/2``; gathered from ``g`` itself with
      the index shifted by ``d``, as ``index_select`` copies a strided input first): ``sym_flat`` maps
      flat position (i, j) and (j, i) to pair ``p(i, j)`` (and the diagonal to pair 0), then the
      ``B x N`` diagonal entries are set to zero.  That is ``G_u + G_u^T`` of the upper-triangle
      scatter ``G_u`` exactly (each off-diagonal entry is one value plus zero; only a ``-0.0``
      keeps its sign, which compares and multiplies equal) without the zero fill, the
      ``index_copy_`` scatter, the ``[B, N, N]`` add and the strided read of the transpose (about
      6x less time for this part on a 2-core CPU), and without a zero-padded copy of the pair
      gradient (``[B, P+1]``: one fill and one copy of ``B x P`` floats per step);
    * ``dT = G T`` — one ``bmm`` (``Z = T T^T`` is symmetric, so ``dT = (G_u + G_u^T) T``;
      autograd would run two bmms on transposed views plus a sum);
    * ``d dense = dT[:, 0] + g[:, :d]`` (the two uses of ``dense``; the same sum of the same two
      terms as autograd's accumulation, hence bit-identical), ``d values = dT[:, 1:]`` as a
      ``[B, F*d]`` view (row stride ``N*d``), which the embedding backward (FBGEMM TBE) makes
      contiguous — one ``[B, F*d]`` copy, as after autograd's ``cat`` backward (the profiled
      ``aten::clone`` under ``split_embedding_backward_codegen``).

    Under ``torch.autocast`` the bmms run in the autocast dtype (``T`` is cast once and saved
    cast); the gradients returned for fp32 inputs are cast back by autograd.
    """

    @staticmethod
    def forward(ctx, dense: torch.Tensor, values: torch.Tensor, triu_flat: torch.Tensor,  # type: ignore[override]
                sym_flat: torch.Tensor) -> torch.Tensor:
        B, d = dense.shape
        N = 1 + values.shape[1] // d
        parts = [dense, values]
        dev = dense.device.type
        cast = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        pad = _dot_row_pad(dense, values, cast or dense.dtype)
        if pad:
            parts.append(dense.new_zeros(B, pad * d))
        t = torch.cat(parts, dim=1).view(B, N + pad, d)  # B may be 0
        if cast is not None and t.dtype != cast:
            t = t.to(cast)
        ctx.save_for_backward(t, sym_flat)
        ctx.n = N
        if pad:  # flat position i * N + j -> i * (N + pad) + j
            triu_flat = triu_flat + (triu_flat // N) * pad
        pairs = torch.bmm(t, t.transpose(1, 2)).flatten(1).index_select(1, triu_flat)
        return torch.cat([dense, pairs], dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        t, sym_flat = ctx.saved_tensors
        B, _, d = t.shape
        N = ctx.n
        t = t[:, :N]  # without the zero rows (a strided view: the bmm reads it in place)
        # index_select copies a strided input first: gather from the whole (contiguous) gradient,
        # the pair columns start at d; under autocast the bmm runs in t's dtype
        g_all = grad.contiguous() if grad.dtype == t.dtype else grad.to(t.dtype, memory_format=torch.contiguous_format)
        g_sym = g_all.index_select(1, sym_flat + d).view(B, N, N)
        g_sym.diagonal(dim1=1, dim2=2).zero_()  # no self-dots: their gradient is 0
        dt = torch.bmm(g_sym, t)
        d_dense = d_values = None
        if ctx.needs_input_grad[0]:
            d_dense = dt[:, 0] + grad[:, :d]
        if ctx.needs_input_grad[1]:
            d_values = dt[:, 1:].reshape(B, (N - 1) * d)
        return d_dense, d_values, None, None


class InteractionArch(nn.Module):
    """DLRM dot interaction.

    Stacks ``T = [dense, e_1..e_F]`` as ``[B, F+1, d]``, computes ``T T^T``
    ``[B, F+1, F+1]`` and keeps the strict upper triangle (``(F+1)F/2``
    pairwise dots, no self-dots), concatenated after the dense vector.

    Args:
        num_sparse_features: ``F``.

    Forward: ``dense [B, d]``, ``sparse`` KeyedTensor ``[B, F*d]`` ->
    ``[B, d + F(F+1)/2]``.
    """

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__()
        self.F = num_sparse_features
        idx = torch.triu_indices(self.F + 1, self.F + 1, offset=1)
        # flat positions of the strict upper triangle in a row-major [F+1, F+1] matrix
        self.register_buffer("triu_flat", idx[0] * (self.F + 1) + idx[1], persistent=False)
        # the training backward's gather of the symmetric pair gradient: flat position (i, j) and
        # (j, i) -> pair index p, the diagonal -> pair 0 (overwritten with zeros after the gather)
        P = idx.shape[1]
        sym = torch.zeros((self.F + 1) ** 2, dtype=torch.long)
        sym[idx[0] * (self.F + 1) + idx[1]] = torch.arange(P)
        sym[idx[1] * (self.F + 1) + idx[0]] = torch.arange(P)
        self.register_buffer("sym_flat", sym, persistent=False)

    def output_dim(self, d: int) -> int:
        return d + self.F * (self.F + 1) // 2

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedTensor) -> torch.Tensor:
        if self.F == 0:
            return dense_features
        values = sparse_features.values()
        if ((dense_features.requires_grad or values.requires_grad)
                and not torch.jit.is_tracing() and not torch.jit.is_scripting()):
            return _DotInteraction.apply(dense_features, values, self.triu_flat, self.sym_flat)
        # inference / TorchScript export: the same values, plain ops
        B, d = dense_features.shape
        combined = torch.cat([dense_features, values], dim=1).view(B, self.F + 1, d)
        pairs = torch.bmm(combined, combined.transpose(1, 2)).flatten(1).index_select(1, self.triu_flat)
        return torch.cat([dense_features, pairs], dim=1)


class OverArch(nn.Module):
    """MLP on the interaction output; last layer linear: ``[B, in] -> [B, layer_sizes[-1]]``
    (``dropout``: see :class:`MLP`)."""

    def __init__(self, in_features: int, layer_sizes: Sequence[int], dropout: float = 0.0) -> None:
        super().__init__()
        self.model = MLP(in_features, layer_sizes, final_activation=False, dropout=dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class FirstOrder(nn.Module):
    """First-order ("wide") term added to DLRM's logit: a linear read-out of the raw dense
    features and of every pooled embedding,

        logit_1 = w_dense^T x_dense + sum_f w_f^T e_f            (no bias; the over arch has one)

    It is the linear part of a factorization machine (Rendle, "Factorization Machines", ICDM
    2010, eq. 1: ``w_0 + sum_i w_i x_i``) that DeepFM (Guo et al., IJCAI 2017, sec. 2.1: the FM
    component's "addition unit") and Wide & Deep (Cheng et al., DLRS 2016: the wide part's
    ``w^T x``) add to the deep model's logit.  The per-id scalar ``w_id`` of those models is
    here ``w_f^T e_{f,id}``: the id's own embedding row read through one shared ``[dim_f]``
    weight per feature, which can take any value per id (the rows are free parameters), so no
    extra dim-1 tables are needed and sharding, checkpoints and export of the tables are
    unchanged.  The dot interaction alone has no such term: the over arch sees only the dense
    vector and pairwise dot products, never an embedding by itself.

    Args:
        dense_in_features: ``D_in``.
        pooled_width: width of the pooled embeddings' KeyedTensor (``sum`` of feature dims).

    Forward: ``dense_features [B, D_in]`` float32, ``pooled [B, pooled_width]`` float32 ->
    ``[B, 1]`` float32.  Initialised to zero, so the model starts as the plain DLRM.
    """

    def __init__(self, dense_in_features: int, pooled_width: int) -> None:
        super().__init__()
        self.dense = _linear(dense_in_features, 1, bias=False)
        self.sparse = nn.Linear(pooled_width, 1, bias=False)
        nn.init.zeros_(self.dense.weight)
        nn.init.zeros_(self.sparse.weight)

    def forward(self, dense_features: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return self.dense(dense_features) + self.sparse(pooled)


class DenseStandardize(nn.Module):
    """``(x - mean) / std`` per dense column, with fixed statistics (``model.dense_standardize``).

    The statistics are buffers (``mean``, ``std``, ``[D_in]`` float32: saved in the dense state
    of checkpoints and carried into exports), initialised to 0 / 1 (the identity) and set once
    from the train split by :meth:`set_stats` (the trainer, before step 0; a restored checkpoint
    overwrites them).  The logistic-regression baseline standardises its dense columns the same
    way (``scripts/baselines_common.dense_stats``).

    Forward: ``[B, D_in]`` float32 -> ``[B, D_in]`` float32.
    """

    def __init__(self, num_features: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(num_features))
        self.register_buffer("std", torch.ones(num_features))

    def set_stats(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        """Set the column statistics (``[D_in]`` each, any float dtype).

        Raises:
            ValueError: a shape other than ``[D_in]``, or a std that is not finite and > 0.
        """
        mean = torch.as_tensor(mean, dtype=torch.float32)
        std = torch.as_tensor(std, dtype=torch.float32)
        if mean.shape != self.mean.shape or std.shape != self.std.shape:
            raise ValueError(f"DenseStandardize: expected mean and std of shape {tuple(self.mean.shape)}, got "
                             f"{tuple(mean.shape)} and {tuple(std.shape)}")
        if not bool(torch.all(torch.isfinite(std) & (std > 0))) or not bool(torch.all(torch.isfinite(mean))):
            raise ValueError(f"DenseStandardize: std must be finite and > 0 and mean finite, got std {std.tolist()}")
        self.mean.copy_(mean)
        self.std.copy_(std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


class DLRM(nn.Module):
    """DLRM: sparse part (``sparse_arch``, an EmbeddingBagCollection or its
    sharded replacement) + dense part (dense arch, interaction, over arch).

    Args:
        embedding_bag_collection: EBC (or ShardedEmbeddingBagCollection) with
            a ``forward(KeyedJaggedTensor) -> KeyedTensor``.
        dense_in_features: ``D_in`` (13 for Criteo).
        dense_arch_layer_sizes: e.g. ``[512, 256, 64, 16]``; last = embedding dim for ``dot``.
        over_arch_layer_sizes: e.g. ``[512, 256, 1]``; last must be 1.
        num_sparse_features: ``F`` (pooled embeddings entering the interaction).
        embedding_dim: ``d``.
        interaction: ``dot`` | a module with ``forward(dense, KeyedTensor) -> [B, out]``
            and ``output_dim(d)``.
        dropout: of the dense and over arch hidden activations in training (:class:`MLP`).
        first_order_width: ``None`` (default): the plain DLRM.  An int: the width of the pooled
            embeddings (sum of the feature dims); adds a :class:`FirstOrder` term to the logit
            (``model.first_order``), held as ``first_order``.
        dense_standardize: hold a :class:`DenseStandardize` as ``dense_norm`` and apply it to the
            dense features before the dense arch and the first-order term
            (``model.dense_standardize``); None otherwise.

    Forward: ``dense_features [B, D_in]`` float32, ``sparse_features`` KJT ->
    logits ``[B, 1]`` float32.
    """

    def __init__(
        self,
        embedding_bag_collection: nn.Module,
        dense_in_features: int,
        dense_arch_layer_sizes: Sequence[int],
        over_arch_layer_sizes: Sequence[int],
        num_sparse_features: int,
        embedding_dim: int,
        interaction: nn.Module | None = None,
        dropout: float = 0.0,
        first_order_width: int | None = None,
        dense_standardize: bool = False,
    ) -> None:
        super().__init__()
        self.sparse_arch = embedding_bag_collection
        self.dense_norm = DenseStandardize(dense_in_features) if dense_standardize else None
        self.dense_arch = DenseArch(dense_in_features, dense_arch_layer_sizes, dropout=dropout)
        self.inter_arch = interaction if interaction is not None else InteractionArch(num_sparse_features)
        self.over_arch = OverArch(self.inter_arch.output_dim(dense_arch_layer_sizes[-1]), over_arch_layer_sizes,
                                  dropout=dropout)
        self.first_order = (FirstOrder(dense_in_features, first_order_width)
                            if first_order_width is not None else None)

    def dense_parts(self) -> dict[str, nn.Module]:
        """Every submodule but ``sparse_arch``, by attribute name (``dense_arch``, ``inter_arch``,
        ``over_arch``, and ``first_order`` / ``dense_norm`` when the model has them): what moves,
        copies or exports as the dense part."""
        return {n: m for n, m in self.named_children() if n != "sparse_arch"}

    # the parameter interface DistributedModelParallel also offers (one for the trainer)
    def dense_parameters(self) -> list[nn.Parameter]:
        """Dense-layer parameters (MLPs, interaction, ...: everything but ``sparse_arch``) for the dense optimizer."""
        return [p for n, p in self.named_parameters() if not n.startswith("sparse_arch.")]

    def embedding_dense_parameters(self) -> list[nn.Parameter]:
        """Weights of the dense-kernel tables, for a torch embedding optimizer."""
        return self.sparse_arch.lookup.dense_parameters()

    def fused_optimizer(self) -> Any:
        """lr / state of the optimizers fused into the tables' TBEs (``FusedOptimizer``)."""
        return self.sparse_arch.fused_optimizer()

    def dense_forward(self, dense_features: torch.Tensor, embedded: KeyedTensor) -> torch.Tensor:
        """Everything after the embedding lookup: ``-> logits [B, 1]``.

        ``embedded`` may also be an awaitable of the KeyedTensor (anything with ``wait()``, e.g.
        the sharded EBC's ``compute_and_output_dist_async``): it is waited on after the dense arch,
        which thus overlaps the pooled embeddings' all-to-all (TorchRec's ``LazyAwaitable``)."""
        if self.dense_norm is not None:
            dense_features = self.dense_norm(dense_features)
        d = self.dense_arch(dense_features)
        if not isinstance(embedded, KeyedTensor):
            embedded = embedded.wait()
        logits = self.over_arch(self.inter_arch(d, embedded))
        if self.first_order is not None:
            logits = logits + self.first_order(dense_features, embedded.values())
        return logits

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        return self.dense_forward(dense_features, self.sparse_arch(sparse_features))


class ProjectedInteraction(nn.Module):
    """Mixed-dimension embeddings in front of an interaction: each pooled embedding narrower
    than ``d`` goes through its own bias-free ``Linear(dim_f, d)`` (Ginart et al., "Mixed
    Dimension Embeddings with Application to Memory-Efficient Recommendation Systems",
    ISIT 2021, arXiv:1909.11810: a per-table projection to the common base dimension), then
    the wrapped interaction sees ``F`` vectors of width ``d`` as usual.

    Args:
        interaction: the ``d``-wide interaction (dot / dcn / projection).
        keys: the pooled embeddings' names, in KeyedTensor order (``F``).
        dims: their widths ``[F]``; each ``<= d``; those equal to ``d`` pass unchanged.
        d: the common width (``dense_arch_layer_sizes[-1]``).

    Forward: ``dense [B, d]``, KeyedTensor ``[B, sum(dims)]`` -> the interaction's output.
    Projections are initialised like the MLP layers (``N(0, sqrt(2 / (dim_f + d)))``).

    Raises:
        ValueError: ``keys`` and ``dims`` differ in length, or a width > ``d`` (construction);
            the KeyedTensor's keys are not ``keys`` (forward).
    """

    def __init__(self, interaction: nn.Module, keys: Sequence[str], dims: Sequence[int], d: int) -> None:
        super().__init__()
        if len(keys) != len(dims):
            raise ValueError(f"ProjectedInteraction: {len(keys)} keys but {len(dims)} dims")
        wide = [(k, w) for k, w in zip(keys, dims) if w > d]
        if wide:
            raise ValueError(f"ProjectedInteraction: embeddings {wide} are wider than the common width {d}")
        self.inner = interaction
        self.d = d
        self._keys = list(keys)
        self._dims = [int(w) for w in dims]
        self.projections = nn.ModuleList()
        self._proj_index: list[int] = []  # per key: index into projections, -1 = unchanged
        for w in self._dims:
            if w == d:
                self._proj_index.append(-1)
                continue
            lin = nn.Linear(w, d, bias=False)
            nn.init.normal_(lin.weight, 0.0, (2.0 / (w + d)) ** 0.5)
            self._proj_index.append(len(self.projections))
            self.projections.append(lin)

    def output_dim(self, d: int) -> int:
        return self.inner.output_dim(d)

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedTensor) -> torch.Tensor:
        if sparse_features.keys() != self._keys:
            raise ValueError(f"ProjectedInteraction: pooled embeddings {sparse_features.keys()}, expected {self._keys}")
        parts = torch.split(sparse_features.values(), self._dims, dim=1)
        out = []
        for j, x in enumerate(parts):
            k = self._proj_index[j]
            out.append(x if k < 0 else self.projections[k](x))
        projected = KeyedTensor(self._keys, [self.d] * len(self._keys), torch.cat(out, dim=1))
        return self.inner(dense_features, projected)
