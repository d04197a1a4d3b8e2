"""The link model: concurrent transfers share the bandwidth equally, and a transfer in parts
(one copy stream) lands its parts one after another while taking one share."""

from __future__ import annotations

import pytest

from kvtier.sim.channel import Channel
from kvtier.sim.events import EventLoop


def test_parts_land_in_order_each_when_its_own_bytes_are_through():
    loop = EventLoop()
    link = Channel(loop, bandwidth=10.0)
    landed: list[tuple[int, float]] = []
    link.submit_in_order([10.0, 30.0, 20.0], lambda i: landed.append((i, loop.now)))
    loop.run()
    assert landed == [(0, pytest.approx(1.0)), (1, pytest.approx(4.0)), (2, pytest.approx(6.0))]
    assert link.bytes_moved == 60.0 and link.active == 0


def test_a_stream_of_parts_takes_one_share_of_the_link_beside_another_transfer():
    loop = EventLoop()
    link = Channel(loop, bandwidth=10.0)
    landed: dict[str, float] = {}
    link.submit_in_order([10.0, 10.0], lambda i: landed.setdefault(f"part {i}", loop.now))
    link.submit(10.0, lambda: landed.setdefault("other", loop.now))
    loop.run()
    # both get 5 bytes/s until 2 s; then the second part is alone on the link
    assert landed == {
        "part 0": pytest.approx(2.0),
        "other": pytest.approx(2.0),
        "part 1": pytest.approx(3.0),
    }
