"""``train.cpu_linear: onednn`` (issue 17): the MLPs' Linear layers train on oneDNN's fp32 GEMM on
the CPU.  Checked: forward and every gradient against ``F.linear`` + autograd to fp32 rounding
(fused ReLU or not, a narrow input, an input needing no gradient, dropout), evaluation / no_grad /
autocast / tracing stay on ``F.linear`` bit for bit, the choice reaches the MLPs inside a sharded
model, bad or unavailable choices are clear errors, and a trainer run converges like the aten one."""

from __future__ import annotations

import pytest
import torch

from dlrmctl.config import config_from_dict
from dlrmctl.modules import mlp as mlp_mod
from dlrmctl.modules.mlp import MLP, OneDNNLinear, onednn_linear_available, set_cpu_linear
from dlrmctl.distributed.env import RunEnv
from dlrmctl.train.trainer import Trainer
from dlrmctl.train.run_dir import TrainError, prepare_run_dir
from tests.conftest import REPO, tiny_synthetic

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="this torch build has no oneDNN linear")


@pytest.mark.parametrize("n_in,n_out,relu,x_grad", [(13, 512, True, False), (512, 256, True, True),
                                                    (415, 512, False, True), (256, 1, False, True),
                                                    (64, 64, True, True)])
def test_onednn_linear_matches_f_linear(n_in, n_out, relu, x_grad):
    torch.manual_seed(0)
    x0, w0, b0 = torch.randn(96, n_in), torch.randn(n_out, n_in) * 0.1, torch.randn(n_out)
    g = torch.randn(96, n_out)
    xa, wa, ba = (t.clone().requires_grad_(r) for t, r in ((x0, x_grad), (w0, True), (b0, True)))
    xb, wb, bb = (t.clone().requires_grad_(r) for t, r in ((x0, x_grad), (w0, True), (b0, True)))
    ya = torch.nn.functional.linear(xa, wa, ba)
    ya = torch.relu(ya) if relu else ya
    yb = OneDNNLinear.apply(xb, wb, bb, relu)
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(yb, ya, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wb.grad, wa.grad, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(bb.grad, ba.grad, rtol=1e-5, atol=1e-4)
    if x_grad:
        torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-5, atol=1e-5)
    else:
        assert xb.grad is None
    assert wb.grad.shape == wb.shape and wb.grad.is_contiguous()


@pytest.mark.parametrize("final,dropout", [(True, 0.0), (False, 0.0), (True, 0.3)])
def test_mlp_trains_on_onednn_like_aten(final, dropout):
    """Same module, same RNG stream (dropout masks drawn in the same order): outputs and every
    parameter gradient agree to fp32 rounding."""
    torch.manual_seed(1)
    a = MLP(13, [64, 32, 8], final_activation=final, dropout=dropout)
    b = MLP(13, [64, 32, 8], final_activation=final, dropout=dropout)
    b.load_state_dict(a.state_dict())
    assert set_cpu_linear(b, "onednn") == 1
    x = torch.randn(128, 13)
    torch.manual_seed(7)
    ya = a(x)
    torch.manual_seed(7)
    yb = b(x)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(yb, ya, rtol=1e-5, atol=1e-5)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-4, atol=1e-5, msg=n)


def test_evaluation_no_grad_autocast_and_tracing_stay_on_f_linear(monkeypatch):
    """Only training in fp32 with grad takes the oneDNN path: eval mode, no_grad, bf16 autocast
    and jit tracing give F.linear's values bit for bit (what evaluation and the export compute)."""
    torch.manual_seed(2)
    a = MLP(13, [32, 8])
    b = MLP(13, [32, 8])
    b.load_state_dict(a.state_dict())
    set_cpu_linear(b, "onednn")
    calls = []
    real = OneDNNLinear.apply
    monkeypatch.setattr(OneDNNLinear, "apply", lambda *args: calls.append(1) or real(*args))
    x = torch.randn(16, 13)
    a.eval(), b.eval()
    assert torch.equal(a(x), b(x))
    a.train(), b.train()
    with torch.no_grad():
        assert torch.equal(a(x), b(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(a(x), b(x))
    assert torch.equal(torch.jit.trace(a, x)(x), torch.jit.trace(b, x)(x))
    assert calls == []
    b(x)  # training, fp32, grad on
    assert calls


def test_the_choice_reaches_every_mlp_of_a_wrapped_model():
    """set_cpu_linear walks the module tree: the dense arch, the over arch and a projection
    interaction's branches inside a DLRM inside a wrapper all get it."""
    from dlrmctl.modules.interactions import InteractionProjectionArch

    wrapper = torch.nn.Sequential(torch.nn.ModuleDict({"dense": MLP(13, [8]), "over": MLP(40, [8, 1]),
                                                        "inter": InteractionProjectionArch(4, 8, [16], [16])}))
    assert set_cpu_linear(wrapper, "onednn") == 4  # dense, over, the projection's two branches
    assert all(m.cpu_linear == "onednn" for m in wrapper.modules() if isinstance(m, MLP))


def test_bad_or_unavailable_choice_is_a_clear_error(monkeypatch):
    with pytest.raises(ValueError, match="train.cpu_linear: expected one of"):
        set_cpu_linear(MLP(4, [4]), "mkl")
    monkeypatch.setattr(mlp_mod, "onednn_linear_available", lambda: False)
    with pytest.raises(ValueError, match="onednn needs a torch build with oneDNN"):
        set_cpu_linear(MLP(4, [4]), "onednn")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_synthetic(tmp_path_factory, "tiny_onednn", rows=3000, seed=4)


def _trainer(tiny, tmp_path, name, kind):
    cfg = config_from_dict({
        "name": name, "data": {"path": tiny, "batch_size": 256, "eval_batch_size": 8192},
        "model": {"embedding_dim": 8, "dense_arch_layer_sizes": [32, 8], "over_arch_layer_sizes": [32, 1]},
        "optimizer": {"embedding": {"lr": 0.05}, "dense": {"lr": 0.05}},
        "train": {"epochs": 1, "run_dir": str(tmp_path), "progress": False, "keep_best": "none",
                  "cpu_linear": kind, "log_every": 1000},
    })
    return Trainer(cfg, RunEnv(), prepare_run_dir(cfg, resume=False, overwrite=False))


def test_trainer_with_onednn_trains_like_aten(tiny, tmp_path):
    """A whole epoch: the per-step losses follow the aten run's to fp32-rounding drift and the
    final validation AUC is within 0.002 of it."""
    out = {}
    for kind in ("aten", "onednn"):
        t = _trainer(tiny, tmp_path, f"cl_{kind}", kind)
        mlps = [m for m in t.model.modules() if isinstance(m, MLP)]
        assert mlps and all(m.cpu_linear == kind for m in mlps)
        calls = []
        real = OneDNNLinear.apply
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(OneDNNLinear, "apply", lambda *args: calls.append(1) or real(*args))
            out[kind] = t.train()["final"]["auc"]
        assert bool(calls) is (kind == "onednn")
    assert abs(out["onednn"] - out["aten"]) < 0.002, out


def test_unavailable_onednn_stops_the_trainer_with_one_message(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(mlp_mod, "onednn_linear_available", lambda: False)
    with pytest.raises(TrainError, match="train.cpu_linear: onednn needs"):
        _trainer(tiny, tmp_path, "cl_x", "onednn")


def test_an_empty_batch_falls_back_and_trains():
    """A rank's empty last batch (B = 0; oneDNN has no empty GEMM): the MLP runs it on F.linear,
    [0, out] and zero gradients, as with aten."""
    m = MLP(13, [64, 16])
    set_cpu_linear(m, "onednn")
    y = m(torch.zeros(0, 13))
    assert y.shape == (0, 16)
    y.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in m.parameters())


def test_double_backward_is_an_error_not_zeros():
    m = MLP(6, [8, 1], final_activation=False)
    set_cpu_linear(m, "onednn")
    x = torch.randn(5, 6, requires_grad=True)
    (g,) = torch.autograd.grad(m(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|double backward|does not require grad"):
        torch.autograd.grad((g ** 2).sum(), list(m.parameters()), allow_unused=True)


def test_two_ranks_with_an_empty_last_local_batch_train(tiny, tmp_path):
    """`dlrmctl train --nproc 2` where the last global batch has one row, so rank 1's local batch
    is empty (data.drop_last false): with onednn the run finishes as with aten (breaker: oneDNN
    has no empty GEMM)."""
    import json
    import os
    import subprocess
    import sys

    n = json.load(open(os.path.join(tiny, "meta.json")))["splits"]["train"]["rows"]
    bs = next((b for b in range(100, 600) if n % b == 1), None)
    if bs is None:
        pytest.skip(f"no batch size in 100..599 leaves one row of {n}")
    cmd = [sys.executable, "-m", "dlrmctl.cli", "train", "configs/demo.yaml", "--nproc", "2",
           "--set", f"data.path={tiny}", "--set", f"train.run_dir={tmp_path}", "--set", "name=empty_rank",
           "--set", f"data.batch_size={bs}", "--set", "data.drop_last=false", "--set", "train.epochs=1",
           "--set", "train.cpu_linear=onednn", "--set", "train.progress=false", "--set", "train.max_steps=null"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]


def test_dcn_cross_net_trains_on_onednn_like_aten(monkeypatch):
    """DCN-v2's low-rank cross net (DLRMv2's interaction) takes the choice too: V and W through
    oneDNN (two calls per layer), outputs and every gradient to fp32 rounding; evaluation stays on F.linear."""
    from dlrmctl.modules import interactions
    from dlrmctl.modules.interactions import LowRankCrossNet

    torch.manual_seed(3)
    a, b = LowRankCrossNet(240, 3, 64), LowRankCrossNet(240, 3, 64)
    b.load_state_dict(a.state_dict())
    assert set_cpu_linear(b, "onednn") == 1
    calls = []
    real = OneDNNLinear.apply
    monkeypatch.setattr(interactions.OneDNNLinear, "apply", lambda *args: calls.append(1) or real(*args))
    x0 = torch.randn(128, 240)
    xa, xb = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    ya = a(xa)
    assert calls == []
    yb = b(xb)
    assert len(calls) == 2 * 3
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(yb, ya, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-4, atol=1e-4)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-4, atol=1e-3, msg=n)
    a.eval(), b.eval()
    assert torch.equal(a(x0), b(x0))
    b.train()
    assert b(torch.zeros(0, 240)).shape == (0, 240)  # empty batch: F.linear
    assert len(calls) == 2 * 3


# ----------------------------------------------------------------- the default: train.cpu_linear auto
@pytest.mark.parametrize("vendor, have_onednn, expected", [
    ("GenuineIntel", True, "aten"),      # MKL's sgemm ran at oneDNN's rate on the Intel Xeon
    ("AuthenticAMD", True, "onednn"),    # ... at 0.4-0.5x of it on the AMD EPYC
    ("HygonGenuine", True, "onednn"),
    ("AuthenticAMD", False, "aten"),     # no oneDNN linear in this torch build
    (None, True, "aten"),                # not x86 / not Linux: torch's own default
])
def test_auto_picks_the_gemm_library_by_the_cpu_vendor(monkeypatch, vendor, have_onednn, expected):
    """The vendor is faked both ways, passed in and read from the machine (``procs.cpu_vendor``,
    None where /proc/cpuinfo has no vendor_id): the real CPU never decides the answer."""
    from dlrmctl import procs
    from dlrmctl.modules.mlp import CPU_LINEAR_ENV, resolve_cpu_linear

    monkeypatch.delenv(CPU_LINEAR_ENV, raising=False)
    monkeypatch.setattr(mlp_mod, "onednn_linear_available", lambda: have_onednn)
    monkeypatch.setattr(procs, "cpu_vendor", lambda: vendor)
    for kind, why in [resolve_cpu_linear("auto")] + ([resolve_cpu_linear("auto", vendor=vendor)] if vendor else []):
        assert kind == expected and why.startswith("train.cpu_linear auto"), (kind, why)
    assert resolve_cpu_linear("aten", vendor="AuthenticAMD")[0] == "aten"  # an explicit choice stays
    assert resolve_cpu_linear("onednn", vendor="GenuineIntel")[0] == "onednn"
    with pytest.raises(ValueError, match="expected one of"):
        resolve_cpu_linear("mkl")


@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD", None])
@pytest.mark.parametrize("forced", ["aten", "onednn"])
def test_the_environment_variable_decides_auto_on_any_cpu(monkeypatch, vendor, forced):
    """DLRMCTL_CPU_LINEAR decides ``auto`` whatever the vendor (how the suite runs the oneDNN
    path on an Intel CPU); an explicit config value still wins; a bad value is a clear error."""
    from dlrmctl import procs
    from dlrmctl.modules.mlp import CPU_LINEAR_ENV, resolve_cpu_linear

    monkeypatch.setattr(procs, "cpu_vendor", lambda: vendor)
    monkeypatch.setenv(CPU_LINEAR_ENV, forced)
    kind, why = resolve_cpu_linear("auto")
    assert kind == forced and f"DLRMCTL_CPU_LINEAR={forced}" in why, (kind, why)
    other = "aten" if forced == "onednn" else "onednn"
    assert resolve_cpu_linear(other)[0] == other
    monkeypatch.setenv(CPU_LINEAR_ENV, "mkl")
    with pytest.raises(ValueError, match="DLRMCTL_CPU_LINEAR: expected one of .*'aten', 'onednn'.*got 'mkl'"):
        resolve_cpu_linear("auto")
    monkeypatch.setenv(CPU_LINEAR_ENV, "")  # empty: the vendor decides
    assert resolve_cpu_linear("auto", vendor="GenuineIntel")[0] == "aten"


@pytest.mark.parametrize("relu", [True, False])
def test_a_non_finite_input_stays_non_finite_as_on_aten(relu):
    """oneDNN's fused ReLU maps NaN to 0; OneDNNLinear must not, or a diverged layer trains on
    with a finite loss (the non-finite loss check would never see it)."""
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[nan, 1.0], [1.0, 1.0], [inf, -1.0], [-inf, 2.0]])
    w = torch.tensor([[1.0, 1.0], [1.0, -1.0], [-1.0, 0.5]], requires_grad=True)
    b = torch.zeros(3, requires_grad=True)
    ref = torch.nn.functional.linear(x, w, b)
    ref = torch.relu(ref) if relu else ref
    got = OneDNNLinear.apply(x, w, b, relu)
    torch.testing.assert_close(got, ref, equal_nan=True)
    m = MLP(2, [3, 1], final_activation=False)
    set_cpu_linear(m, "onednn")
    assert m(x).isnan().any()


def test_cpu_vendor_reads_the_first_processor(tmp_path):
    from dlrmctl.procs import cpu_vendor

    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n\nprocessor\t: 1\n"
                 "vendor_id\t: AuthenticAMD\n")
    assert cpu_vendor(str(f)) == "AuthenticAMD"
    f.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\n\n")  # aarch64: no vendor_id
    assert cpu_vendor(str(f)) is None
    assert cpu_vendor(str(tmp_path / "missing")) is None


def test_the_default_config_trains_on_onednn_on_an_amd_cpu_and_says_so(tiny, tmp_path, monkeypatch, capsys):
    """``train.cpu_linear`` defaults to ``auto``: on an AMD CPU the trainer's MLPs run oneDNN's
    GEMM and the console says so, once, after the model line; on Intel's they stay on aten."""
    from dlrmctl import procs
    from dlrmctl.config import config_from_dict as cfd

    assert cfd({"name": "x"}).train.cpu_linear == "auto"
    monkeypatch.delenv("DLRMCTL_CPU_LINEAR", raising=False)
    for vendor, kind in (("AuthenticAMD", "onednn"), ("GenuineIntel", "aten")):
        monkeypatch.setattr(procs, "cpu_vendor", lambda vendor=vendor: vendor)
        t = _trainer(tiny, tmp_path, f"auto_{vendor}", "auto")
        mlps = [m for m in t.model.modules() if isinstance(m, MLP)]
        assert mlps and all(m.cpu_linear == kind for m in mlps), vendor
        out = capsys.readouterr().out
        lines = [x for x in out.splitlines() if "oneDNN" in x]
        assert len(lines) == (kind == "onednn"), out
        if lines:
            assert "AuthenticAMD" in lines[0] and "train.cpu_linear=aten" in lines[0]
