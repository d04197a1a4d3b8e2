"""What a simulated replica knows about one conversation: its turns, and where each chunk of
its KV is. It hands policies the same `SessionView` the engine builds, cached until something
changes, so a timer decision over thousands of idle sessions rebuilds only the ones that moved.

KV covers tokens [0, tokens) of the conversation on a fixed grid of `chunk_tokens`; chunk i is
tokens [i C, min((i + 1) C, tokens)). Each chunk is in one tier (device, host, disk, remote) or
nowhere (None: recompute it), with the bytes it holds there, in a form (`forms`: full, or
int8 / int4 once a policy stored it so; it stays lossy after a restore, as the engine's blocks
do). A chunk stored in a quantized form remembers its full-precision bytes (`full`), which it
takes again on the device.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from kvtier.policy.view import NO_HINTS, ChunkView, SessionView, TurnView
from kvtier.tiers.store import Chunk
from kvtier.vocab import FULL

if TYPE_CHECKING:
    from kvtier.workload.model import Request


class SimSession:
    __slots__ = (
        "_chunks",
        "_view",
        "access",
        "active",
        "app_class",
        "block_tokens",
        "busy",
        "chunk_tokens",
        "copied",
        "forms",
        "full",
        "hash_ids",
        "hints",
        "idle_since",
        "pending",
        "prompt_tokens",
        "session_id",
        "sizes",
        "tenant",
        "tiers",
        "tokens",
        "turns",
    )

    def __init__(self, request: Request, chunk_tokens: int) -> None:
        self.session_id = request.session_id
        self.tenant = request.tenant
        self.app_class = request.app_class
        self.chunk_tokens = chunk_tokens
        self.turns: list[TurnView] = []
        self.tokens = 0
        self.tiers: list[str | None] = []
        self.sizes: list[int] = []
        self.forms: list[str] = []
        self.full: dict[int, int] = {}  # chunk -> full-precision bytes, while stored quantized
        self.access: list[float] = []
        # write-through: chunk i (on the device) also has a clean copy in the top lower tier
        self.copied: list[bool] = []
        self.busy = False  # a turn is queued or running
        self.active = False  # ... and its KV is in use: restored, loading or computed
        self.idle_since: float | None = None
        self.hints = NO_HINTS  # what the client said with its latest finished turn
        self.hash_ids: tuple[int, ...] = ()  # prefix block ids of the last prompt
        self.block_tokens = 1.0
        self.prompt_tokens = 0  # of the last turn
        self.pending: deque[Request] = deque()  # turns sent before the previous one ended
        self._chunks: list[Chunk] = []
        self._view: SessionView | None = None

    @property
    def last_end(self) -> float | None:
        """When the previous turn ended (None for a new session or while one runs)."""
        return self.turns[-1].finished if self.turns else None

    def chunk(self, index: int) -> Chunk:
        """The store's key for chunk `index`: the session and the chunk's place in it, in the
        tenant's namespace. (Chunks are not shared across sessions here.)"""
        while len(self._chunks) <= index:
            key = f"{self.session_id}#{len(self._chunks)}".encode()
            self._chunks.append(Chunk((key,), self.tenant))
        return self._chunks[index]

    def chunk_range(self, index: int, tokens: int | None = None) -> tuple[int, int]:
        end = self.tokens if tokens is None else tokens
        return index * self.chunk_tokens, min((index + 1) * self.chunk_tokens, end)

    def device_bytes(self, index: int) -> int:
        """What chunk `index` takes on the device: its full-precision bytes."""
        return self.full.get(index, self.sizes[index])

    def stored(self) -> list[int]:
        return [i for i, tier in enumerate(self.tiers) if tier is not None]

    def reset(self, tokens: int, sizes: list[int], now: float) -> None:
        """The whole context is on the device now (a turn just ended). Copies of chunks the
        turn kept stay valid: the caller deleted those of chunks it changed."""
        self.tokens = tokens
        self.copied = self.copied[: len(sizes)] + [False] * (len(sizes) - len(self.copied))
        self.forms = self.forms[: len(sizes)] + [FULL] * (len(sizes) - len(self.forms))
        self.full = {}
        self.tiers = ["device"] * len(sizes)
        self.sizes = sizes
        self.access = [now] * len(sizes)
        self._view = None

    def truncate(self, chunks: int) -> None:
        """Forget chunks from `chunks` on (the caller has freed them)."""
        del self.tiers[chunks:], self.sizes[chunks:], self.access[chunks:], self.copied[chunks:]
        del self.forms[chunks:]
        self.full = {i: size for i, size in self.full.items() if i < chunks}
        self.tokens = min(self.tokens, chunks * self.chunk_tokens)
        self._view = None

    def changed(self) -> None:
        self._view = None

    def view(self) -> SessionView:
        """The policy's view; it lists stored chunks only (the rest has nothing to place)."""
        if self._view is None:
            chunks = tuple(
                ChunkView(
                    i, *self.chunk_range(i), tier, self.sizes[i], self.forms[i], self.access[i]
                )
                for i, tier in enumerate(self.tiers)
                if tier is not None
            )
            self._view = SessionView(
                self.session_id,
                tenant=self.tenant,
                app_class=self.app_class,
                turns=tuple(self.turns),
                chunks=chunks,
                active=self.active,
                idle_since=self.idle_since,
                pinned=self.hints.pins,
                priority=self.hints.priority,
                ttl_s=self.hints.ttl_s,
                hints=self.hints,
            )
        return self._view
