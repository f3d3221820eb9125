"""DLRM (Naumov et al., "Deep Learning Recommendation Model for Personalization
and Recommendation Systems", 2019) with TorchRec's module names.

    dense [B, D_in] --DenseArch (MLP, ReLU)--> [B, d]
    sparse KJT --EmbeddingBagCollection--> KeyedTensor [B, F*d]
    InteractionArch: [dense, F pooled] -> [dense | upper-triangle pairwise dots]
    OverArch (MLP, ReLU, last layer linear) -> logits [B, 1]

The interaction is pluggable (``dot``; ``dcn`` and ``projection`` live in
:mod:`dlrmctl.modules.interactions`); the MLP and its CPU training kernels are
:mod:`dlrmctl.modules.mlp`'s.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from dlrmctl.modules.mlp import MLP, linear_layer
from dlrmctl.sparse import KeyedJaggedTensor, KeyedTensor


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
        self.dense = linear_layer(dense_in_features, 1, bias=False)
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
