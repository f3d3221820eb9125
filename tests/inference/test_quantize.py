"""Row-wise fp16/int8/int4 quantization: bounds, edge cases, FBGEMM layout and TBE lookups."""

import pytest
import torch

from dlrmctl import HAS_FBGEMM
from dlrmctl.inference.quantize import (
    QuantizationError,
    dequantize_rowwise,
    pack_int4,
    quantize_rowwise,
    quantize_table,
    tbe_row_bytes,
    unpack_int4,
)
from dlrmctl.inference.intnbit_tbe import tbe_rows

needs_fbgemm = pytest.mark.skipif(not HAS_FBGEMM, reason="fbgemm_gpu is not installed")


def _table(rows=257, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, dim, generator=g) * torch.logspace(-4, 1, rows)[:, None]
    w[3] += 5.0  # an offset row
    return w


@pytest.mark.parametrize("bits", [8, 4])
def test_round_trip_error_is_at_most_half_a_stored_scale_step(bits):
    w = _table()
    codes, scale, bias = quantize_rowwise(w, bits, "t")
    assert scale.dtype == torch.float16 and bias.dtype == torch.float16
    deq = dequantize_rowwise(codes, scale, bias, bits, w.shape[1])
    s = scale.float()[:, None]
    # directed fp16 rounding: every value lies in [bias, bias + qmax*scale] -> half a step
    bound = s / 2 * (1 + 1e-6) + 1e-6 * w.abs()
    assert bool(((w - deq).abs() <= bound).all()), float(((w - deq).abs() - bound).max())
    # the stored scale is the ideal (max-min)/qmax up to fp16 rounding (one ulp + bias rounding)
    qmax = (1 << bits) - 1
    ideal = (w.amax(1) - w.amin(1)) / qmax
    assert bool((scale.float() >= ideal).all())
    # one fp16 ulp (relative 2**-10, or 2**-24 absolute for subnormals) above the range seen from the bias
    from_bias = ideal + (w.amin(1) - bias.float()) / qmax
    assert bool((scale.float() <= from_bias * (1 + 2.0**-10) * (1 + 1e-6) + 2.0**-24).all())
    assert bool((bias.float() <= w.amin(1)).all())


def test_constant_row_has_zero_scale_and_dequantizes_exactly():
    w = torch.full((2, 8), 9.0)
    w[1] = -0.5
    for bits in (8, 4):
        codes, scale, bias = quantize_rowwise(w, bits, "t")
        assert scale.tolist() == [0.0, 0.0]
        assert bias.tolist() == [9.0, -0.5]
        assert torch.equal(dequantize_rowwise(codes, scale, bias, bits, 8), w)


def test_constant_row_not_representable_in_fp16_is_reconstructed_within_1e7():
    w = torch.full((1, 8), 0.1)
    codes, scale, bias = quantize_rowwise(w, 8, "t")
    assert float(bias) < 0.1  # rounded down
    assert float((dequantize_rowwise(codes, scale, bias, 8, 8) - w).abs().max()) < 1e-7


@pytest.mark.parametrize("bad,what", [(float("nan"), "NaN"), (float("inf"), "+inf"), (float("-inf"), "-inf")])
@pytest.mark.parametrize("dtype", ["int8", "int4", "fp16", "fp32"])
def test_non_finite_row_is_refused_naming_table_and_row(bad, what, dtype):
    w = torch.zeros(10, 8)
    w[7, 2] = bad
    with pytest.raises(QuantizationError, match=rf"table 't_C3', row 7: contains {what.replace('+', '[+]')} \(column 2\)"):
        quantize_table(w, dtype, "t_C3")


def test_non_finite_row_in_a_later_chunk_reports_the_global_row():
    w = torch.zeros(10, 8)
    w[9, 0] = float("nan")
    with pytest.raises(QuantizationError, match="row 9:"):
        quantize_table(w, "int8", "t", chunk_rows=4)


def test_values_beyond_fp16_range_are_refused():
    w = torch.zeros(3, 8)
    w[1, 1] = 1e6
    with pytest.raises(QuantizationError, match="table 't', row 1: .*fp16"):
        quantize_table(w, "int8", "t")
    with pytest.raises(QuantizationError, match="table 't', row 1: .*fp16"):
        quantize_table(w, "fp16", "t")


def test_int4_packing_low_nibble_first_and_round_trips():
    codes = torch.tensor([[0, 1, 2, 15, 3, 4, 15, 0]], dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.tolist() == [[0x10, 0xF2, 0x43, 0x0F]]
    assert torch.equal(unpack_int4(packed, 8), codes)
    rnd = torch.randint(0, 16, (33, 12), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(rnd), 12), rnd)
    with pytest.raises(QuantizationError, match="odd"):
        quantize_rowwise(torch.zeros(2, 7), 4, "t")


def test_chunked_quantization_equals_one_shot():
    w = _table(rows=100)
    a = quantize_table(w, "int4", "t", chunk_rows=7)
    codes, scale, bias = quantize_rowwise(w, 4, "t")
    assert torch.equal(a.data, codes) and torch.equal(a.scale, scale) and torch.equal(a.bias, bias)


def test_row_bytes_per_dtype_and_ratio_to_fp32():
    assert [tbe_row_bytes(16, d) for d in ("fp32", "fp16", "int8", "int4")] == [64, 32, 20, 12]
    assert tbe_row_bytes(16, "int8", 16) == 32
    # int8 <= 0.3x fp32 needs dim >= 20; int4 <= 0.17x needs dim >= 24
    assert tbe_row_bytes(16, "int8") / 64 > 0.3 and tbe_row_bytes(20, "int8") / 80 <= 0.3
    assert tbe_row_bytes(16, "int4") / 64 > 0.17 and tbe_row_bytes(24, "int4") / 96 <= 0.17


@needs_fbgemm
@pytest.mark.parametrize("bits", [8, 4])
def test_tbe_row_layout_matches_fbgemm_sbhalf_op(bits):
    """Our ``[scale|bias|codes]`` rows, with scale/bias moved to the end, decode with FBGEMM's
    ``FusedNBitRowwiseQuantizedSBHalfToFloat`` to exactly our dequantized values; and FBGEMM's
    own quantization of the same table agrees with ours to one quantization step."""
    w = _table(rows=64, dim=16)
    q = quantize_table(w, f"int{bits}", "t")
    rows = tbe_rows(q)
    assert rows.shape == (64, tbe_row_bytes(16, f"int{bits}"))
    assert torch.equal(rows[:, :2].contiguous().view(torch.float16).view(-1), q.scale)
    assert torch.equal(rows[:, 2:4].contiguous().view(torch.float16).view(-1), q.bias)
    fused = torch.cat([rows[:, 4:], rows[:, :4]], dim=1).contiguous()
    fb_deq = torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(fused, bits)
    assert torch.equal(fb_deq, q.dequantize())
    theirs = torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(
        torch.ops.fbgemm.FloatToFusedNBitRowwiseQuantizedSBHalf(w, bits), bits
    )
    # FBGEMM rounds bias/scale to nearest (a subnormal scale may round down and clamp the max):
    # same accuracy overall, nearly all values within one step of each other
    ours = q.dequantize()
    assert float((ours - w).abs().mean()) <= 1.02 * float((theirs - w).abs().mean())
    assert float(((ours - theirs).abs() <= q.scale.float()[:, None] * 1.01).float().mean()) >= 0.98
    # row 3 (values ~5, range ~1e-3): the fp16 ulp of the minimum dwarfs the range; directed
    # rounding keeps our error within half a step, FBGEMM's nearest rounding does not
    ours_err = float((q.dequantize()[3] - w[3]).abs().max())
    assert ours_err <= float(q.scale[3]) / 2 * 1.001
    assert ours_err < float((theirs[3] - w[3]).abs().max())


@needs_fbgemm
def test_exact_grid_table_gives_identical_bytes_to_fbgemm_int8():
    # min 0 and max 255 are fp16-exact and scale (255-0)/255 = 1 is exact: no rounding choice left
    w = torch.randint(0, 256, (20, 8)).float()
    w[:, 0], w[:, 1] = 0.0, 255.0
    ours = tbe_rows(quantize_table(w, "int8", "t"))
    fb = torch.ops.fbgemm.FloatToFusedNBitRowwiseQuantizedSBHalf(w, 8)
    assert torch.equal(ours[:, 4:], fb[:, :8]) and torch.equal(ours[:, :4], fb[:, 8:])


@needs_fbgemm
@pytest.mark.parametrize("dtype", ["int8", "int4", "fp16", "fp32"])
def test_intnbit_tbe_lookup_equals_embedding_bag_over_dequantized_weights(dtype):
    from dlrmctl.inference.intnbit_tbe import build_intnbit_tbe, tbe_storage_bytes

    g = torch.Generator().manual_seed(1)
    t0 = quantize_table(torch.randn(40, 16, generator=g) * 0.1, dtype, "t0")
    t1 = quantize_table(torch.randn(25, 8, generator=g), dtype, "t1")
    tbe = build_intnbit_tbe([t0, t1], feature_table_map=[0, 0, 1])  # features a, b -> t0; c -> t1
    B = 4
    lengths = torch.tensor([1, 3, 0, 2, 2, 0, 1, 1, 4, 1, 0, 3])
    n = [int(lengths[i * B:(i + 1) * B].sum()) for i in range(3)]
    values = torch.cat([torch.randint(0, 40, (n[0] + n[1],), generator=g), torch.randint(0, 25, (n[2],), generator=g)])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    out = tbe(values, offsets)
    assert out.shape == (B, 16 + 16 + 8) and out.dtype == torch.float32
    ref = []
    for f, tab in enumerate([t0, t0, t1]):
        s, e = int(offsets[f * B]), int(offsets[(f + 1) * B])
        ref.append(torch.nn.functional.embedding_bag(values[s:e], tab.dequantize(), offsets[f * B:(f + 1) * B + 1] - s,
                                                     mode="sum", include_last_offset=True))
    torch.testing.assert_close(out, torch.cat(ref, dim=1), rtol=1e-6, atol=1e-6)
    per_row = {"fp32": 64 + 32, "fp16": 32 + 16, "int8": 20 + 12, "int4": 12 + 8}[dtype]
    # 128-byte table alignment on top of the rows
    assert 40 * (per_row - tbe_row_bytes(8, dtype)) + 25 * tbe_row_bytes(8, dtype) <= tbe_storage_bytes(tbe) \
        <= 40 * (per_row - tbe_row_bytes(8, dtype)) + 25 * tbe_row_bytes(8, dtype) + 2 * 128


@needs_fbgemm
def test_tbe_refuses_dims_not_multiple_of_4():
    from dlrmctl.inference.intnbit_tbe import build_intnbit_tbe

    with pytest.raises(QuantizationError, match="table 'odd': embedding_dim 6"):
        build_intnbit_tbe([quantize_table(torch.zeros(3, 6), "int8", "odd")], [0])


def test_require_fbgemm_message_when_absent(monkeypatch):
    from dlrmctl import _fbgemm
    from dlrmctl.inference.intnbit_tbe import require_fbgemm

    monkeypatch.setattr(_fbgemm, "HAS_FBGEMM", False)
    monkeypatch.setattr(_fbgemm, "FBGEMM_IMPORT_ERROR", "fbgemm_gpu is not installed")
    with pytest.raises(RuntimeError, match=r"dlrmctl export needs fbgemm_gpu .*pip install fbgemm-gpu-cpu==1.8.0"):
        require_fbgemm("dlrmctl export")
