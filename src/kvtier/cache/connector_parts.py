"""What the policy runner and the chunk actions use of the tiered connector, as a protocol:
they take the connector's parts through it rather than the connector's class, so the
connector, which builds them, is the only module that knows all three (no import cycle)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvtier.cache.chunks import Chunks
    from kvtier.cache.config import TiersConfig
    from kvtier.cache.writes import BackgroundWrites
    from kvtier.engine.block_pool import BlockPool
    from kvtier.engine.connector import EngineContext
    from kvtier.tiers import Payload, TieredStore


class ConnectorParts(Protocol):
    config: TiersConfig
    context: EngineContext
    block_pool: BlockPool
    block_size: int
    bytes_per_block: int
    store: TieredStore
    chunks: Chunks
    writes: BackgroundWrites
    counters: Counter[str]

    def chunk_keys(self, keys: Sequence[bytes]) -> list[tuple[bytes, ...]]: ...

    def locate(self, chunk_id: bytes) -> str | None: ...

    def form_of(self, block_ids: Sequence[int]) -> str: ...

    def gather(self, block_ids: Sequence[int]) -> tuple[Payload, Callable[[], None]]: ...

    def drop_device_blocks(self, keys: Sequence[bytes]) -> int: ...

    def free_moved_blocks(self, keys: Sequence[bytes]) -> int: ...
