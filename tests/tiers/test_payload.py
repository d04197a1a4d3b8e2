"""Payloads view K/V bytes without copying; records catch every damaged byte."""

from __future__ import annotations

import pytest
import torch

from kvtier.tiers import Payload, TierError
from kvtier.tiers.histogram import LatencyHistogram
from kvtier.tiers.record import RecordCodec, parse_head


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.int8])
def test_payload_shares_the_tensor_bytes_and_restores_dtype_and_shape(dtype: torch.dtype) -> None:
    kv = torch.randn(2, 3, 4, 8).to(dtype)
    payload = Payload.of(kv, form="full")
    assert payload.data is not None
    assert payload.data.data_ptr() == kv.data_ptr()  # no copy
    assert payload.nbytes == kv.numel() * kv.element_size()
    restored = payload.tensor()
    assert restored.dtype == dtype and restored.shape == kv.shape
    assert torch.equal(restored, kv)


def test_metadata_round_trips_and_rejects_garbage() -> None:
    payload = Payload.of(torch.zeros(2, 5, dtype=torch.bfloat16), form="int4+sink")
    again = Payload.from_meta(None, payload.nbytes, payload.meta())
    assert (again.form, again.dtype, again.shape) == ("int4+sink", "bfloat16", (2, 5))
    with pytest.raises(ValueError):
        Payload.from_meta(None, 0, payload.meta()[:-3])
    with pytest.raises(ValueError):
        Payload.from_meta(None, 0, b"\x01x\x07no_such\x00")


def test_size_only_payload_has_no_bytes() -> None:
    payload = Payload.sized(1000, form="int8")
    assert payload.data is None and payload.nbytes == 1000
    with pytest.raises(ValueError):
        payload.tensor()


def test_record_detects_any_flipped_byte(make_payload) -> None:
    codec = RecordCodec()
    payload = make_payload(tokens=2)
    head, body = codec.encode(b"key", "tenant", payload)
    record = bytearray(head + bytes(body))
    for position in range(0, len(record), 7):
        damaged = bytearray(record)
        damaged[position] ^= 0x40
        with pytest.raises(TierError):
            parsed = parse_head(damaged)
            dest = torch.empty(parsed.payload_nbytes, dtype=torch.uint8)
            codec.decode(parsed, memoryview(damaged)[parsed.head_len :], dest, in_place=False)


def test_histogram_quantiles_are_bucket_bounds() -> None:
    histogram = LatencyHistogram()
    for _ in range(98):
        histogram.observe(0.0002)
    histogram.observe(0.3)
    histogram.observe(30.0)
    assert histogram.quantile(0.5) == pytest.approx(2.5e-4)
    assert histogram.quantile(0.99) == pytest.approx(0.5)
    assert histogram.quantile(1.0) == float("inf")
    snapshot = histogram.snapshot()
    assert snapshot["count"] == 100
    assert snapshot["buckets"]["inf"] == 100
