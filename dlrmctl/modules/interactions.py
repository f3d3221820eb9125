"""Feature interactions for DLRM beyond the dot product: DCN-v2 and projection.

Every interaction here has the interface :class:`dlrmctl.modules.dlrm.DLRM` expects:

* ``forward(dense_features [B, d] float32, sparse_features KeyedTensor [B, F*d]) -> [B, out]``
* ``output_dim(d) -> out`` (the width the over arch receives).

Both stack the dense vector and the ``F`` pooled embeddings as ``F+1`` vectors of width
``d`` (so every table must be ``d`` wide, as for ``dot``).

* ``dcn``: the low-rank cross network of DCN-v2 (Wang et al., "DCN V2: Improved Deep &
  Cross Network and Practical Lessons for Web-scale Learning to Rank Systems", WWW 2021,
  eq. (1) with the low-rank ``W = U V^T`` of section 5.1), applied to the flattened
  ``[B, (F+1)d]`` stack, as in TorchRec's ``LowRankCrossNet`` + ``InteractionDCNArch``
  used by the MLPerf DLRMv2 reference (3 layers, rank 512).
* ``projection``: TorchRec's ``InteractionProjectionArch`` (``DLRM_Projection``): two MLP
  branches project the flattened stack to ``F1`` and ``F2`` vectors of width ``d``; the
  output is ``[dense, all F1 x F2 dot products]``.

:func:`build_interaction` maps ``model.interaction`` of the config to one of these (or to
the dot :class:`~dlrmctl.modules.dlrm.InteractionArch`).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from dlrmctl.modules.dlrm import InteractionArch
from dlrmctl.modules.mlp import MLP, OneDNNLinear, cpu_fp32_training
from dlrmctl.sparse import KeyedTensor

__all__ = [
    "InteractionDCNArch",
    "InteractionProjectionArch",
    "LowRankCrossNet",
    "build_interaction",
]


def _stack(dense_features: torch.Tensor, sparse_features: KeyedTensor, F: int, who: str) -> torch.Tensor:
    """``dense [B, d]`` + KeyedTensor ``[B, F*d]`` -> ``[B, (F+1)*d]`` (dense first).

    Raises:
        ValueError: the KeyedTensor is not ``F*d`` wide (tables of another width).
    """
    B, d = dense_features.shape
    if F == 0:
        return dense_features
    sv = sparse_features.values()
    if sv.shape != (B, F * d):
        raise ValueError(
            f"{who}: expected pooled embeddings of shape [B={B}, F*d={F}*{d}], got {tuple(sv.shape)}; "
            f"every table must be {d} wide (= dense_arch_layer_sizes[-1])"
        )
    return torch.cat([dense_features, sv], dim=1)


class LowRankCrossNet(nn.Module):
    """DCN-v2 low-rank cross network.

    For ``l = 0 .. L-1``::

        x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l

    with ``V_l [r, N]``, ``W_l [N, r]``, ``b_l [N]`` and ``*`` the element-wise product
    (Wang et al. 2021, eq. (1) with ``W = U V^T``; TorchRec ``LowRankCrossNet``).
    Initialisation as TorchRec: ``W_l``, ``V_l`` Xavier-normal, ``b_l`` zeros.

    Args:
        in_features: ``N``.
        num_layers: ``L`` (>= 1).
        low_rank: ``r`` (>= 1).

    Forward: ``[B, N]`` float32 -> ``[B, N]`` float32.

    Raises:
        ValueError: non-positive ``in_features``, ``num_layers`` or ``low_rank``.
    """

    def __init__(self, in_features: int, num_layers: int, low_rank: int) -> None:
        super().__init__()
        for name, v in (("in_features", in_features), ("num_layers", num_layers), ("low_rank", low_rank)):
            if v <= 0:
                raise ValueError(f"LowRankCrossNet: {name} must be > 0, got {v}")
        self.in_features = in_features
        self.num_layers = num_layers
        self.low_rank = low_rank
        self.V_kernels = nn.ParameterList(
            [nn.Parameter(nn.init.xavier_normal_(torch.empty(low_rank, in_features))) for _ in range(num_layers)]
        )
        self.W_kernels = nn.ParameterList(
            [nn.Parameter(nn.init.xavier_normal_(torch.empty(in_features, low_rank))) for _ in range(num_layers)]
        )
        self.bias = nn.ParameterList([nn.Parameter(torch.zeros(in_features)) for _ in range(num_layers)])

    #: GEMM library for CPU fp32 training (``train.cpu_linear``, :func:`dlrmctl.modules.mlp.set_cpu_linear`)
    cpu_linear: str = "aten"

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        """``x0 [B, N]`` -> ``x_L [B, N]`` (see the class docstring)."""
        x = x0
        if self.cpu_linear == "onednn" and cpu_fp32_training(self, x0) and x0.shape[0] > 0:
            for V, W, b in zip(self.V_kernels, self.W_kernels, self.bias):
                x = x0 * OneDNNLinear.apply(OneDNNLinear.apply(x, V, None, False), W, b, False) + x
            return x
        for V, W, b in zip(self.V_kernels, self.W_kernels, self.bias):
            x = x0 * (nn.functional.linear(nn.functional.linear(x, V), W) + b) + x
        return x


class InteractionDCNArch(nn.Module):
    """DCN-v2 interaction: cross net over ``concat(dense, e_1..e_F)``.

    As TorchRec ``InteractionDCNArch`` (MLPerf DLRMv2): the ``F+1`` vectors of width ``d``
    are flattened to ``[B, (F+1)d]`` and passed through a :class:`LowRankCrossNet` of that
    width; its output goes to the over arch.

    Args:
        num_sparse_features: ``F``.
        embedding_dim: ``d`` (dense arch output width = every table's width).
        num_layers: cross layers ``L`` (DLRMv2: 3).
        low_rank: rank ``r`` (DLRMv2: 512).

    Forward: ``dense_features [B, d]`` float32, ``sparse_features`` KeyedTensor ``[B, F*d]``
    -> ``[B, (F+1)d]`` float32.

    Raises:
        ValueError: (forward) the KeyedTensor is not ``F*d`` wide.
    """

    def __init__(self, num_sparse_features: int, embedding_dim: int, num_layers: int, low_rank: int) -> None:
        super().__init__()
        self.F = num_sparse_features
        self.d = embedding_dim
        self.crossnet = LowRankCrossNet((num_sparse_features + 1) * embedding_dim, num_layers, low_rank)

    def output_dim(self, d: int) -> int:
        """Width of the output, ``(F+1) d``."""
        return (self.F + 1) * d

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedTensor) -> torch.Tensor:
        return self.crossnet(_stack(dense_features, sparse_features, self.F, "InteractionDCNArch"))


class InteractionProjectionArch(nn.Module):
    """Projection interaction (TorchRec ``InteractionProjectionArch`` / ``DLRM_Projection``).

    With ``T = concat(dense, e_1..e_F)`` flattened to ``[B, (F+1)d]``::

        P1 = branch1(T).view(B, F1, d)          # F1 = branch1_layer_sizes[-1] / d
        P2 = branch2(T).view(B, F2, d)          # F2 = branch2_layer_sizes[-1] / d
        out = concat(dense, (P1 @ P2^T).view(B, F1*F2))

    Each branch is an MLP with ReLU after every layer (TorchRec uses a ``DenseArch``).
    TorchRec views branch 2's output as ``[B, d, F2]`` instead of ``[B, F2, d]^T``; the two
    differ only by a fixed permutation of branch 2's last-layer units, so the model family
    is the same.

    Args:
        num_sparse_features: ``F``.
        embedding_dim: ``d``.
        branch1_layer_sizes: MLP widths of branch 1; the last must be a multiple of ``d``.
        branch2_layer_sizes: MLP widths of branch 2; the last must be a multiple of ``d``.

    Forward: ``dense_features [B, d]`` float32, ``sparse_features`` KeyedTensor ``[B, F*d]``
    -> ``[B, d + F1*F2]`` float32.

    Raises:
        ValueError: an empty branch, or a branch whose last width is not a positive multiple
            of ``d``; (forward) the KeyedTensor is not ``F*d`` wide.
    """

    def __init__(
        self,
        num_sparse_features: int,
        embedding_dim: int,
        branch1_layer_sizes: Sequence[int],
        branch2_layer_sizes: Sequence[int],
    ) -> None:
        super().__init__()
        self.F = num_sparse_features
        self.d = embedding_dim
        in_features = (num_sparse_features + 1) * embedding_dim
        counts = []
        for i, sizes in ((1, branch1_layer_sizes), (2, branch2_layer_sizes)):
            if not sizes or sizes[-1] <= 0 or sizes[-1] % embedding_dim:
                raise ValueError(
                    f"model.interaction_branch{i}_layer_sizes: the last layer must be a positive multiple of "
                    f"the embedding dim {embedding_dim} (it is reshaped into vectors of that width), got {list(sizes)}"
                )
            counts.append(sizes[-1] // embedding_dim)
        self.F1, self.F2 = counts
        self.interaction_branch1 = MLP(in_features, branch1_layer_sizes, final_activation=True)
        self.interaction_branch2 = MLP(in_features, branch2_layer_sizes, final_activation=True)

    def output_dim(self, d: int) -> int:
        """Width of the output, ``d + F1*F2``."""
        return d + self.F1 * self.F2

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedTensor) -> torch.Tensor:
        B, d = dense_features.shape
        t = _stack(dense_features, sparse_features, self.F, "InteractionProjectionArch")
        p1 = self.interaction_branch1(t).view(B, self.F1, d)
        p2 = self.interaction_branch2(t).view(B, self.F2, d)
        inter = torch.bmm(p1, p2.transpose(1, 2)).reshape(B, self.F1 * self.F2)
        return torch.cat([dense_features, inter], dim=1)


def build_interaction(model_cfg, num_sparse_features: int, embedding_dim: int) -> nn.Module:
    """The interaction module selected by ``model.interaction``.

    Args:
        model_cfg: :class:`dlrmctl.config.ModelConfig` (reads ``interaction``,
            ``dcn_num_layers``, ``dcn_low_rank_dim``, ``interaction_branch{1,2}_layer_sizes``).
        num_sparse_features: ``F``, pooled embeddings entering the interaction.
        embedding_dim: ``d``, the width of each pooled embedding and of the dense arch output.

    Returns:
        ``dot`` -> :class:`~dlrmctl.modules.dlrm.InteractionArch`; ``dcn`` ->
        :class:`InteractionDCNArch`; ``projection`` -> :class:`InteractionProjectionArch`.

    Raises:
        ValueError: unknown interaction name (message names ``model.interaction``), or bad
            sizes (see the classes).
    """
    kind = model_cfg.interaction
    if kind == "dot":
        return InteractionArch(num_sparse_features)
    if kind == "dcn":
        return InteractionDCNArch(num_sparse_features, embedding_dim, model_cfg.dcn_num_layers, model_cfg.dcn_low_rank_dim)
    if kind == "projection":
        return InteractionProjectionArch(
            num_sparse_features,
            embedding_dim,
            model_cfg.interaction_branch1_layer_sizes,
            model_cfg.interaction_branch2_layer_sizes,
        )
    raise ValueError(f"model.interaction: expected one of ['dot', 'dcn', 'projection'], got {kind!r}")
