"""SimRequest: one turn inside a simulated replica, from arrival to its last token: how much of
its history it reuses, the prefill segments it still has to compute, and the load phases that
let each segment in.

A request's prefill runs its recomputed chunks front to back, then the new prompt. The loads
the restore planner chose come in phases, each opening a gate: a segment may run once the gate
it waits for is open (`next_chunk`).
"""

from __future__ import annotations

from kvtier.results.records import RequestRecord
from kvtier.sim.session import SimSession
from kvtier.workload.model import Request

# How far a request's prefill may go: recomputed chunks with no load before them, then those
# behind the planner's early loads, then the new prompt after every load.
GATE_NONE, GATE_EARLY, GATE_ALL = 0, 1, 2


class SimRequest:
    __slots__ = (
        "allocated",
        "committed",
        "cursor",
        "device_base",
        "first_run",
        "join_context",
        "join_count",
        "load_bytes",
        "loads_started",
        "open_gate",
        "output",
        "pending",
        "phases",
        "prompt",
        "record",
        "request",
        "reserve",
        "segment",
        "segments",
        "session",
        "shared",
        "valid",
    )

    def __init__(self, request: Request, session: SimSession, record: RequestRecord) -> None:
        self.record = record
        self.request = request  # what the workload says of the turn (how its reply ends)
        self.session = session
        self.prompt = request.prompt_tokens
        self.output = max(1, request.output_tokens)
        self.valid = 0  # history tokens whose KV the session holds
        self.shared = 0  # of those, leading tokens other sessions computed (shared prefixes)
        self.committed = False  # restore planned, session KV pinned
        self.segments: list[tuple[int, int, int]] = []  # (start, end, gate) to prefill, in order
        self.segment = 0
        self.cursor = 0
        # load phases in order: (gate they open, tier -> chunk indices)
        self.phases: list[tuple[int, dict[str, list[int]]]] = []
        self.pending = 0  # transfers of the current phase still running
        self.open_gate = GATE_ALL
        self.loads_started = False
        self.load_bytes = 0
        self.reserve = 0  # device bytes of the whole context
        self.device_base = 0  # of those, already on the device at arrival
        self.allocated = 0  # allocated since (loads, admission)
        self.join_count = 0
        self.join_context = 0
        self.first_run = 0

    def next_chunk(self, budget: int) -> int:
        """Tokens this request can prefill in the next step, within `budget`."""
        if self.segment >= len(self.segments):
            return 0
        _, end, gate = self.segments[self.segment]
        return min(budget, end - self.cursor) if gate <= self.open_gate else 0

    def advance(self, tokens: int) -> None:
        self.cursor += tokens
        if self.cursor == self.segments[self.segment][1]:
            self.segment += 1
            if self.segment < len(self.segments):
                self.cursor = self.segments[self.segment][0]

    @property
    def prefill_done(self) -> bool:
        return self.segment >= len(self.segments)
