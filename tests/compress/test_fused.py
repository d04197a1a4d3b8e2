"""The INT4 codec's fused decode into bfloat16 writes, bit for bit, what `quant.dequantize`
returns, and the chunks it does not take still decode through torch."""

from __future__ import annotations

import pytest
import torch

from kvtier.compress import fused
from kvtier.compress.codecs import Int4Codec, IntCodec
from kvtier.compress.quant import dequantize, quantize


def chunk(blocks: int, tokens: int = 16, dim: int = 64, seed: int = 0) -> torch.Tensor:
    """Folded blocks of KV [blocks * layers, K|V, heads, tokens, dim], an outlier key channel
    as real keys have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(blocks * 30, 2, 3, tokens, dim, generator=g)
    x[:, 0, :, :, 5] *= 20
    return x.bfloat16()


def reference(block: torch.Tensor, codec: IntCodec) -> torch.Tensor:
    """Each half quantized as the codec does and decoded by `quant.dequantize`, as raw bits."""
    group = min(codec.value_group, block.shape[4])
    halves = (
        dequantize(quantize(block[:, 0], codec.bits, block.shape[3], dim=2), torch.bfloat16),
        dequantize(quantize(block[:, 1], codec.bits, group, dim=3), torch.bfloat16),
    )
    return torch.stack(halves, dim=1).view(torch.int16)


def decode_bits(codec: IntCodec, payload: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return codec.decode(payload, shape, torch.bfloat16).view(torch.int16)


@pytest.mark.parametrize(("blocks", "tokens"), [(1, 16), (16, 16), (2, 32)])
def test_the_fused_decode_is_bit_for_bit_dequantize(blocks, tokens):
    """One block, a 256-token chunk of SmolLM2 blocks, and 32-token blocks (two uint64
    words of key codes per channel)."""
    block = chunk(blocks, tokens)
    codec = Int4Codec()
    payload = codec.encode(block)
    keys, values = codec_halves(codec, payload, block.shape)
    assert fused.fits(keys, values, torch.empty(block.shape, dtype=torch.bfloat16))
    assert torch.equal(decode_bits(codec, payload, block.shape), reference(block, codec))


def test_values_beyond_float16_decode_to_the_same_infinities_and_nans():
    """A group whose range overflows its float16 step decodes to inf or NaN: the same bits."""
    block = chunk(1, seed=3)
    block[0, 0, 1, :, 7] = 1e5  # a key channel past float16's largest value
    block[2, 1, 0, 4, :] = -3e38  # a value row near bfloat16's smallest
    codec = Int4Codec()
    got = decode_bits(codec, codec.encode(block), block.shape)
    want = reference(block, codec)
    assert want.view(torch.bfloat16).isnan().any()
    assert torch.equal(got, want)


def test_a_payload_not_8_aligned_decodes_the_same():
    """The key codes are read as uint64 words: from a buffer at an address 2 mod 8 too (the
    float16 scales need 2)."""
    block = chunk(2, seed=4)
    codec = Int4Codec()
    payload = codec.encode(block)
    shifted = torch.empty(payload.numel() + 2, dtype=torch.uint8)[2:]
    shifted.copy_(payload)
    assert shifted.data_ptr() % 8
    assert torch.equal(decode_bits(codec, shifted, block.shape), reference(block, codec))


@pytest.mark.parametrize(
    ("tokens", "dim", "value_group", "dtype"),
    [
        (8, 64, 64, torch.bfloat16),  # 4 bytes of key codes per channel: not a uint64 word
        (16, 64, 48, torch.bfloat16),  # values padded to whole groups
        (16, 64, 64, torch.float32),
    ],
)
def test_chunks_the_kernels_do_not_take_decode_through_torch(tokens, dim, value_group, dtype):
    block = chunk(1, tokens, dim, seed=5)
    codec = Int4Codec(value_group=value_group)
    payload = codec.encode(block)
    out = torch.empty(block.shape, dtype=dtype)
    assert not fused.fits(*codec_halves(codec, payload, block.shape), out)
    got = codec.decode(payload, block.shape, dtype)
    assert torch.equal(got.bfloat16().view(torch.int16), reference(block, codec))


def test_a_strided_or_foreign_output_is_not_taken():
    block = chunk(1)
    codec = Int4Codec()
    halves = codec_halves(codec, codec.encode(block), block.shape)
    assert fused.fits(*halves, torch.empty(block.shape, dtype=torch.bfloat16))
    heads_first = torch.empty(30, 3, 2, 16, 64, dtype=torch.bfloat16).transpose(1, 2)
    assert heads_first.shape == block.shape
    assert not fused.fits(*halves, heads_first)


def codec_halves(codec: IntCodec, payload: torch.Tensor, shape: torch.Size):
    return codec.halves(payload, shape)
