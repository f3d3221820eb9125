"""Export's latency check: its time per batch size is bounded by how slow one call is, and each
batch size announces itself."""

import pytest
import torch

from dlrmctl.console import stages
from dlrmctl.inference import parity


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class _Model:
    """Just what the latency check calls; each call advances the fake clock by ``call_s``."""

    feature_names = ["f0", "f1"]
    num_dense = 3
    weighted_features = ()
    manifest = {"tables": [{"features": ["f0", "f1"], "num_embeddings": 10}]}

    def __init__(self, clock, call_s):
        self.clock, self.call_s, self.calls = clock, call_s, 0

    def logits(self, dense, values, lengths, weights):
        assert dense.shape[1] == 3 and values.numel() == lengths.numel() == 2 * dense.shape[0]
        self.calls += 1
        self.clock.t += self.call_s
        return torch.zeros(dense.shape[0])


@pytest.mark.parametrize("call_s, calls, timed", [(0.001, 203, 200), (0.3, 4, 3), (5.0, 2, 1)])
def test_calls_per_batch_size_shrink_with_a_slow_call(monkeypatch, capsys, call_s, calls, timed):
    clock = _Clock()
    monkeypatch.setattr(parity.time, "perf_counter", clock)
    m = _Model(clock, call_s)
    with stages("export"):
        out = parity.latency(m, batches=(1, 8), budget_s=1.0, clock=clock)
    assert m.calls == 2 * calls
    assert [v["calls"] for v in out.values()] == [timed, timed]
    assert out["8"]["p50"] == pytest.approx(call_s * 1e3)
    assert clock.t <= 2 * max(1.0 + 3 * call_s, 4 * call_s) + 1e-9  # the documented bound, per batch size
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "latency at batch" in ln]
    assert [ln.split(" s ", 1)[1] for ln in lines] == ["latency at batch 1", "latency at batch 8"]
