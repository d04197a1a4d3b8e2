"""Quantization round trips stay within their documented error bounds, per bit width."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.compress import quant
from kvtier.compress.codecs import Int4Codec, Int8Codec, IntCodec
from kvtier.compress.presses.kivi import KiviPress
from kvtier.compress.quant import dequantize, dequantize_into, max_error, quantize
from kvtier.errors import KvtierError


def kv_like(seed: int) -> torch.Tensor:
    """Values shaped like one layer's keys [kv_heads, tokens, head_dim], with an outlier
    channel as real keys have (the reason KIVI groups keys per channel)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 100, 64, generator=g)
    x[:, :, 5] *= 20
    return x


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize(("dim", "group"), [(1, 32), (2, 64), (2, 16), (1, 24)])
def test_round_trip_within_half_a_step(bits, dim, group):
    if group * bits % 8:
        pytest.skip("group does not fill whole bytes")
    x = kv_like(bits)
    q = quantize(x, bits, group, dim)
    err = (dequantize(q) - x).abs()
    bound = max_error(x, bits, group, dim)
    assert torch.all(err <= bound * (1 + 1e-5) + 1e-7)
    # The step is (group range) / (2^bits - 1): relative error shrinks ~2x per extra bit.
    levels = (1 << bits) - 1
    assert bound.max() <= (x.max() - x.min()) / levels / 2 * 1.01


@pytest.mark.parametrize(("bits", "ratio"), [(8, 0.53), (4, 0.29), (2, 0.16)])
def test_packed_bytes_shrink_with_the_bit_width(bits, ratio):
    x = kv_like(0)
    q = quantize(x, bits, 64, dim=2)  # values: per token over all 64 channels
    bf16_bytes = x.numel() * 2
    assert q.nbytes / bf16_bytes == pytest.approx(ratio, abs=0.01)


def test_constant_groups_are_exact():
    x = torch.full((2, 32), 3.25)
    assert torch.equal(dequantize(quantize(x, 2, 32, dim=1)), x)


def test_bad_bit_width_or_group():
    with pytest.raises(KvtierError, match="bits must be one of"):
        quantize(torch.zeros(4, 8), 3, 8, 1)
    with pytest.raises(KvtierError, match="fill whole bytes"):
        quantize(torch.zeros(4, 8), 2, 3, 1)


@pytest.mark.parametrize("codec", [Int8Codec(), Int4Codec(), IntCodec(2, value_group=32)])
def test_block_codec_round_trip(codec):
    g = torch.Generator().manual_seed(1)
    block = torch.randn(30, 2, 3, 16, 64, generator=g)  # one pool block of SmolLM2
    payload = codec.encode(block)
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    restored = codec.decode(payload, block.shape, torch.float32)
    assert restored.shape == block.shape
    keys_bound = max_error(block[:, 0], codec.bits, 16, dim=2)
    values_bound = max_error(block[:, 1], codec.bits, min(codec.value_group, 64), dim=3)
    bound = torch.stack((keys_bound, values_bound), dim=1)
    assert torch.all((restored - block).abs() <= bound * (1 + 1e-5) + 1e-7)
    assert payload.numel() < block.numel() * 2  # smaller than the bfloat16 block


def test_block_codec_forms_and_sizes():
    block = torch.randn(30, 2, 3, 16, 64).bfloat16()
    sizes = {
        c.form: c.encode(block).numel() / (block.numel() * 2) for c in (Int8Codec(), Int4Codec())
    }
    assert sizes["int8"] == pytest.approx(0.578, abs=0.001)
    assert sizes["int4"] == pytest.approx(0.328, abs=0.001)


def test_kivi_keeps_the_residual_window_exact():
    g = torch.Generator().manual_seed(2)
    tokens = torch.randn(2, 2, 3, 200, 64, generator=g)  # [layers, K|V, heads, n, dim]
    press = KiviPress(bits=2, group_size=32, residual=64)
    assert press.num_quantized(200) == 128  # whole groups, at least 64 left exact
    out = press.apply(tokens)
    assert torch.equal(out[:, :, :, 128:], tokens[:, :, :, 128:])
    assert not torch.equal(out[:, :, :, :128], tokens[:, :, :, :128])
    keys_bound = max_error(tokens[:, 0, :, :128], 2, 32, dim=2)
    assert torch.all((out[:, 0, :, :128] - tokens[:, 0, :, :128]).abs() <= keys_bound + 1e-6)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize(("dim", "group_size"), [(2, 16), (3, 64), (3, 24), (2, 8)])
def test_dequantize_into_writes_what_dequantize_returns(bits, dim, group_size):
    """Into a strided slice of a bigger tensor (a chunk's K or V half), padded groups
    included (24 channels do not divide 64), in several tiles and a partial last one, bit
    for bit."""
    if group_size * bits % 8:
        pytest.skip("group does not fill whole bytes")
    x = torch.randn(50, 3, 16, 64, generator=torch.Generator().manual_seed(bits)).bfloat16()
    assert quant._TILE_VALUES < x.numel() < 2 * quant._TILE_VALUES  # two tiles, one partial
    q = quantize(x, bits, group_size, dim)
    whole = torch.zeros(50, 2, 3, 16, 64, dtype=torch.bfloat16)
    dequantize_into(q, whole[:, 1])
    assert torch.equal(whole[:, 1], dequantize(q, torch.bfloat16))
    assert not whole[:, 0].any()  # the other half untouched


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    bits=st.sampled_from([2, 4, 8]),
    bytes_per_group=st.integers(1, 5),
    axis=st.integers(0, 3),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    scale=st.sampled_from([1e-3, 1.0, 300.0]),
    seed=st.integers(0, 2**16),
)
def test_dequantize_into_matches_dequantize_on_any_shape(
    shape, bits, bytes_per_group, axis, dtype, scale, seed
):
    """Any rank, axis, group size (padded or not), bit width and dtype, written into a
    strided view (every other row of a bigger tensor), bit for bit what `dequantize` gives."""
    dim = axis % len(shape)
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)
    q = quantize(x, bits, bytes_per_group * 8 // bits, dim)
    whole = torch.zeros(2 * shape[0], *shape[1:], dtype=dtype)
    dequantize_into(q, whole[::2])
    assert torch.equal(whole[::2], dequantize(q, dtype))
    assert not whole[1::2].any()
