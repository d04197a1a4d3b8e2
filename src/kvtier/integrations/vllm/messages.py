"""What the scheduler-side connector tells the worker side each step, and what comes back.

vLLM runs the two connector objects in different processes by default on CPU (the mp
executor) and, on GPUs, one worker per device: they share nothing but vLLM's per-step
metadata (scheduler -> worker) and worker metadata (worker -> scheduler, next step). These
are plain picklable records; `connector.py` wraps them in vLLM's metadata classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.integrations.vllm.requests import RequestRecord


@dataclass(frozen=True)
class Lookup:
    """A request the scheduler met (new, or re-admitted after a preemption): the worker
    tracks it and, when `ask`, plans how many tokens from `num_computed_tokens` (vLLM's own
    hits) kvtier can fill; the answer comes back next step."""

    record: RequestRecord
    num_computed_tokens: int
    ask: bool
    readmitted: bool = False


@dataclass(frozen=True)
class Allocation:
    """vLLM allocated the request's blocks: `block_ids` for the `num_external_tokens` kvtier
    promised from `num_computed_tokens` on (empty: vLLM took none, they are recomputed)."""

    request_id: str
    num_computed_tokens: int
    num_external_tokens: int
    block_ids: list[int]


@dataclass(frozen=True)
class Save:
    """Chunks of a request that this step's forward completes: after the forward, copy
    chunks [first_chunk, end_chunk) out of `block_ids` (the request's blocks from its first).
    `tokens` extend the worker's copy of the request's tokens from `tokens_from`; with vLLM's
    KV events on, `block_hashes` extend its copy of vLLM's block hashes from `hashes_from`."""

    request_id: str
    first_chunk: int
    end_chunk: int
    block_ids: list[int]
    tokens_from: int
    tokens: list[int]
    hashes_from: int = 0
    block_hashes: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class Finish:
    """The request finished (or was aborted): session bookkeeping. `cached_block_ids` are its
    blocks from its first that vLLM keeps in its prefix cache, idle, until it reuses them: the
    retention policy sees them as the session's KV on the device (`idle_blocks.py`)."""

    request_id: str
    num_computed_tokens: int
    tokens_from: int
    tokens: list[int]
    cached_block_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class DeviceState:
    """vLLM's device as of this step's schedule, for the retention policy's view and its
    pressure trigger: each waiting request's tokens (head first), vLLM's free blocks (its idle
    cached blocks among them: vLLM evicts those on demand, LRU first), and the finished
    requests' cached blocks vLLM has handed to a request since the last step (`gone`: no longer
    the finished request's KV, or in use)."""

    waiting_tokens: tuple[int, ...] = ()
    free_blocks: int = 0
    gone: tuple[int, ...] = ()


@dataclass
class StepMessages:
    # vLLM reset the connector's cache (`reset_prefix_cache(reset_connector=True)`): every
    # stored chunk is dropped before anything else this step
    reset: bool = False
    lookups: list[Lookup] = field(default_factory=list)
    allocations: list[Allocation] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)
    finishes: list[Finish] = field(default_factory=list)
    device: DeviceState | None = None  # None: vLLM bound no block pool to the connector


@dataclass
class WorkerReply:
    """request id -> (the vLLM hit it was asked from, tokens kvtier can fill); whether any
    request could hit (something is stored, or a shared tier may hold more)."""

    answers: dict[str, tuple[int, int]] = field(default_factory=dict)
    may_hit: bool = True
    # request id -> the answer's tokens per tier they load from (vLLM's hit sources)
    sources: dict[str, dict[str, int]] = field(default_factory=dict)
    # the retention policy's orders on finished requests' idle blocks in vLLM's pool: `evict`
    # (no longer hittable, reused first: a tier holds the chunk, or the policy dropped it) and
    # `keep` (hittable until reused, reused first)
    evict: list[int] = field(default_factory=list)
    keep: list[int] = field(default_factory=list)
