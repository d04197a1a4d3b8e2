"""Links: the channels between a replica's device and each lower tier, and how many transfers
run on them.

Each tier has a read link (loads towards the device) and a write link (spills and copies into
the tier), the same channel when the profile's path is not duplex, so reads and writes then
share its bandwidth. Loads (`restore.py`) and writes (`spill.py`) count themselves in
`in_flight` while they run: the replica takes its queue for stuck (the policy cannot help and
nothing will free memory) only when this is zero.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtier.sim.channel import Channel
from kvtier.sim.events import EventLoop
from kvtier.sim.profile import TierPath


class Links:
    def __init__(self, loop: EventLoop, tiers: Iterable[str], paths: dict[str, TierPath]) -> None:
        self.paths = paths  # tier -> its read and write `TierLink` (latency, bandwidth)
        self.read: dict[str, Channel] = {}
        self.write: dict[str, Channel] = {}
        for name in tiers:
            path = paths[name]
            self.read[name] = Channel(loop, path.read.bandwidth)
            self.write[name] = (
                Channel(loop, path.write.bandwidth) if path.duplex else self.read[name]
            )
        self.in_flight = 0  # transfers running, loads and writes
