"""KVConnector: the contract between the engine and a store that supplies and keeps KV blocks.

Modelled on vLLM's `KVConnectorBase_V1` split, in the engine's own words, so that one tier
core (kvtier.cache) can sit behind this engine and, later, behind vLLM:

    scheduler side                          worker side (around the forward pass)
    --------------                          -------------------------------------
    on_request_added     queued             start_loads      begin this step's loads
    num_loadable_tokens  what it can give   wait_for_loads   -> {request: first bad block}
    next_load_position   where to stop      layer_ready(i)   in the forward, before layer i
    on_blocks_allocated  blocks to fill     finish_layer_loads -> {request: first bad block}
                                            after_step       saves reaped, policy timer
                                            (block events: BlockEventListener, the saves)
    on_admitted          sources counted
    on_preempted         before release
    on_request_finished  before release

Ownership, and what happens on failure:
- **The scheduler allocates and frees every device block.** The connector promises tokens
  (`num_loadable_tokens`); the scheduler allocates blocks for them and hands their ids over
  (`on_blocks_allocated`); the connector fills exactly those blocks, through the pool's
  block port (`KVBlockPort.read_blocks` / `write_blocks`, which a quantized pool implements
  in its own form), and never allocates, frees or registers a block in the prefix cache.
  Loaded blocks enter the prefix cache the way computed ones do: after the step that counts
  them as computed.
- **Loads finish within the step**: the engine calls `start_loads` and `wait_for_loads`
  before the forward pass (so `num_loadable_tokens` is never asynchronous here). Loads the
  connector overlaps with the forward, layer by layer (an engine that says so with
  `EngineContext.layer_hook`), finish within the forward: it calls `layer_ready(i)` before
  layer i's attention reads the pool, which returns once layer i of every such load is in
  the blocks and verified, or failed, or late; nothing unverified is reported ready.
  After the forward the engine calls `finish_layer_loads` (also when the forward raised):
  the connector's loads have stopped writing, and the requests it names had a layer fail or
  come late, so their step is thrown away (no token sampled, the new KV not counted) and
  they recompute from the named block in the next step; the other requests of the batch
  are unaffected. See docs/tiers.md.
- **A load that fails** (missing, late, corrupt, forged) is reported by `wait_for_loads`
  as the first block index of that request that was not filled. The engine rolls the request
  back to that block: it is recomputed from there, so a failing tier costs time, never
  correctness. The connector forgets that request's later loads.
- **Saves never stall the step.** The connector copies blocks out (`read_blocks`) when it
  is told a block is evicted, a request finished or was preempted, and writes them below on
  its own threads. `on_request_finished` runs before the scheduler releases the blocks.
- Every call is made on the engine thread with the engine lock held: a connector needs no
  lock of its own for state only these calls touch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from kvtier.engine.hooks import BlockEventListener

if TYPE_CHECKING:
    from kvtier.engine.block_pool import BlockPool
    from kvtier.engine.request import Request
    from kvtier.engine.sessions import SessionTracker


class KVBlockPort(Protocol):
    """The device pool's door for whole blocks, in full precision ([n, *block_shape]).

    A packed pool (`kv_quant`) dequantizes on the way out and quantizes on the way in; the
    connector never touches the pool's tensors."""

    block_shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    def read_blocks(
        self, block_ids: Sequence[int], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """A copy of these blocks ([n, *block_shape], into `out` when given)."""
        ...

    def write_blocks(self, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        """Fill these blocks from [n, *block_shape] (any device; copied)."""
        ...

    def block_view(self, block_ids: Sequence[int]) -> torch.Tensor | None:
        """The blocks themselves, [n, *block_shape] and writable, when the pool holds them
        adjacent and in full precision: a restore reads a chunk straight into them (one copy,
        not two). None otherwise (a packed pool, scattered ids): use `write_blocks`."""
        ...


@dataclass(frozen=True)
class QueueDemand:
    """Requests waiting for admission, head first (the scheduler's queue, read-only).

    Read where asked: a check after every step needs the head alone, and only a policy view
    sums the whole queue."""

    waiting: Sequence[Request] = ()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def head_tokens(self) -> int:
        """The first waiting request's tokens (0: none waits)."""
        return self.waiting[0].num_tokens if self.waiting else 0

    @property
    def num_tokens(self) -> int:
        """All waiting requests' tokens."""
        return sum(r.num_tokens for r in self.waiting)


@dataclass(frozen=True)
class EngineContext:
    """What an engine shows a connector when it is bound: read-only views and the block port.

    `block_pool` is for lookups (`lookup`, `forms`, counts) and for `drop_cached` (a policy
    evicting idle cached blocks): never for allocating. `queue` and `sessions` feed a
    retention policy's view."""

    block_pool: BlockPool
    kv_port: KVBlockPort
    block_size: int
    kv_quant: str | None
    sessions: SessionTracker
    queue: Callable[[], QueueDemand]
    # The forward calls `KVConnector.layer_ready` before each layer's attention and the
    # engine `finish_layer_loads` after it: loads may overlap the forward layer by layer.
    layer_hook: bool = False
    # The engine can prefill a run and then take loaded KV after it within one prompt (its
    # scheduler asks `next_load_position`); vLLM takes loaded KV only right after its hits.
    loads_after_recompute: bool = True


@runtime_checkable
class KVConnector(BlockEventListener, Protocol):
    """A store beside the device pool. See the module docstring for who owns what."""

    def bind(self, context: EngineContext) -> None:
        """Called once when the engine takes the connector; raise KvtierError to refuse."""
        ...

    # ----- scheduler side --------------------------------------------------------------

    def on_request_added(self, request: Request) -> None:
        """The request is queued: loads may start in the background (prefetch)."""
        ...

    def num_loadable_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """How many prompt tokens from `num_computed_tokens` (block aligned) on the connector
        can load now: a multiple of the block size, never reaching the last prompt token."""
        ...

    def next_load_position(self, request: Request, after: int) -> int | None:
        """The first token position past `after` where the connector will be able to supply
        again (the request's history resumes after a run the prefill recomputes): the
        prefill stops there, and the scheduler asks `num_loadable_tokens` at it. None:
        nothing further."""
        ...

    def on_blocks_allocated(self, request: Request, block_ids: list[int]) -> None:
        """The blocks the scheduler allocated for the tokens `num_loadable_tokens` promised,
        in order from that position; empty when it had no room (the tokens are recomputed)."""
        ...

    def on_admitted(self, request: Request) -> None:
        """First admission, after this step's loads: the prompt tokens' sources go onto
        `request.metrics.prompt_token_sources`."""
        ...

    def on_preempted(self, request: Request) -> None:
        """Before the scheduler releases a preempted request's blocks."""
        ...

    def on_request_finished(self, request: Request) -> None:
        """Before the scheduler releases a finished request's blocks (its saves copy out)."""
        ...

    # ----- worker side -----------------------------------------------------------------

    def start_loads(self) -> None:
        """Begin the loads of the blocks handed over this step."""
        ...

    def wait_for_loads(self) -> dict[str, int]:
        """Wait for this step's loads: request id -> index of its first block that was not
        filled (the engine recomputes from there). Requests fully loaded are absent."""
        ...

    def layer_ready(self, layer: int) -> None:
        """In the forward, before layer `layer`'s attention reads the pool: return when that
        layer of every load overlapping this step's forward is written and verified, failed,
        or past the deadline. Immediate when nothing overlaps."""
        ...

    def finish_layer_loads(self) -> dict[str, int]:
        """After the forward (also a failed one): the overlapping loads stopped; request id
        -> first block not filled, for requests whose step the engine must throw away."""
        ...

    def after_step(self) -> None:
        """After each step: finished saves accounted, timers (a retention policy) run."""
        ...

    # ----- reporting and lifecycle -----------------------------------------------------

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...
