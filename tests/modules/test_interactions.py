"""DCN-v2 cross network and projection interaction against explicit formulas."""

import pytest
import torch

from dlrmctl.config import ModelConfig
from dlrmctl.modules.dlrm import DLRM, InteractionArch
from dlrmctl.modules.interactions import (
    InteractionDCNArch,
    InteractionProjectionArch,
    LowRankCrossNet,
    build_interaction,
)
from dlrmctl.sparse import KeyedTensor

from tests.conftest import REPO


def _kt(B: int, F: int, d: int) -> KeyedTensor:
    return KeyedTensor([f"f{i}" for i in range(F)], [d] * F, torch.randn(B, F * d))


def _randomize(m: torch.nn.Module) -> None:
    # biases start at zero; give them values so the formula check covers them
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)


def test_low_rank_cross_net_matches_per_sample_formula_looped_by_hand():
    B, N, L, r = 5, 12, 3, 4
    net = LowRankCrossNet(N, L, r)
    _randomize(net)
    x0 = torch.randn(B, N)
    out = net(x0)
    for b in range(B):
        x0b = x0[b].double()
        x = x0b.clone()
        for layer in range(L):
            W = net.W_kernels[layer].double()  # [N, r]
            V = net.V_kernels[layer].double()  # [r, N]
            bias = net.bias[layer].double()
            # x_{l+1}[i] = x0[i] * (sum_k W[i,k] * sum_j V[k,j] x[j] + b[i]) + x[i]
            new = torch.empty(N, dtype=torch.float64)
            for i in range(N):
                s = sum(W[i, k] * sum(V[k, j] * x[j] for j in range(N)) for k in range(r))
                new[i] = x0b[i] * (s + bias[i]) + x[i]
            x = new
        torch.testing.assert_close(out[b].double(), x, rtol=1e-5, atol=1e-5)


def test_dcn_interaction_stacks_dense_first_then_pooled_embeddings():
    B, F, d = 4, 3, 8
    arch = InteractionDCNArch(F, d, num_layers=2, low_rank=5)
    _randomize(arch)
    dense = torch.randn(B, d)
    kt = _kt(B, F, d)
    out = arch(dense, kt)
    assert out.shape == (B, arch.output_dim(d)) == (B, (F + 1) * d)
    ref = arch.crossnet(torch.cat([dense, kt["f0"], kt["f1"], kt["f2"]], dim=1))
    torch.testing.assert_close(out, ref)


def test_dcn_rejects_pooled_embeddings_of_the_wrong_width():
    arch = InteractionDCNArch(2, 8, 1, 2)
    with pytest.raises(ValueError, match="every table must be 8 wide"):
        arch(torch.randn(3, 8), _kt(3, 2, 4))


def test_projection_interaction_shape_and_explicit_dot_products():
    B, F, d = 6, 4, 8
    arch = InteractionProjectionArch(F, d, [32, 24], [16, 16])  # F1 = 3, F2 = 2
    dense = torch.randn(B, d)
    kt = _kt(B, F, d)
    out = arch(dense, kt)
    assert (arch.F1, arch.F2) == (3, 2)
    assert out.shape == (B, arch.output_dim(d)) == (B, d + 3 * 2)
    torch.testing.assert_close(out[:, :d], dense)
    t = torch.cat([dense, kt.values()], dim=1)
    p1 = arch.interaction_branch1(t)
    p2 = arch.interaction_branch2(t)
    for b in range(B):
        for i in range(3):
            for j in range(2):
                expect = torch.dot(p1[b, i * d:(i + 1) * d], p2[b, j * d:(j + 1) * d])
                torch.testing.assert_close(out[b, d + i * 2 + j], expect)


def test_projection_rejects_branch_width_not_multiple_of_embedding_dim():
    with pytest.raises(ValueError, match="interaction_branch2_layer_sizes"):
        InteractionProjectionArch(3, 8, [16], [20])


@pytest.mark.parametrize(
    "kind,cls,out_dim",
    [("dot", InteractionArch, 8 + 3 * 4 // 2), ("dcn", InteractionDCNArch, 4 * 8), ("projection", InteractionProjectionArch, 8 + 2 * 3)],
)
def test_build_interaction_plugs_into_dlrm_and_backpropagates(kind, cls, out_dim):
    B, F, d = 5, 3, 8
    cfg = ModelConfig(
        interaction=kind,
        dcn_num_layers=2,
        dcn_low_rank_dim=4,
        interaction_branch1_layer_sizes=[16, 16],
        interaction_branch2_layer_sizes=[24],
    )
    inter = build_interaction(cfg, F, d)
    assert isinstance(inter, cls)
    assert inter.output_dim(d) == out_dim

    class FakeEBC(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(F * d))

        def forward(self, _kjt):
            return KeyedTensor([f"f{i}" for i in range(F)], [d] * F, self.w.expand(B, F * d))

    model = DLRM(FakeEBC(), 4, [16, d], [16, 1], F, d, interaction=inter)
    logits = model(torch.randn(B, 4), None)
    assert logits.shape == (B, 1)
    logits.sum().backward()
    assert model.sparse_arch.w.grad is not None and model.sparse_arch.w.grad.abs().sum() > 0


def test_criteo_1tb_dlrmv2_config_is_the_mlperf_setup():
    from dlrmctl.config import load_config

    cfg = load_config(REPO / "configs" / "criteo_1tb_dlrmv2.yaml")
    m = cfg.model
    assert [t.num_embeddings for t in m.tables] == [
        40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209, 11938,
        155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]
    assert [t.feature_names for t in m.tables] == [[f"C{i}"] for i in range(1, 27)]
    assert (m.embedding_dim, m.dense_arch_layer_sizes, m.over_arch_layer_sizes) == (
        128, [512, 256, 128], [1024, 1024, 512, 256, 1])
    assert (m.interaction, m.dcn_num_layers, m.dcn_low_rank_dim) == ("dcn", 3, 512)
    assert cfg.data.batch_size == 65536
    assert cfg.data.multi_hot_sizes == [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]
    assert cfg.optimizer.embedding.type == "exact_rowwise_adagrad" and cfg.optimizer.dense.type == "adagrad"
    assert cfg.train.eval_every == 4195197692 // (65536 * 20)
    # the over arch sees (F+1)*d = 27*128 cross-net features
    assert InteractionDCNArch(26, 128, 1, 1).output_dim(128) == 3456
