"""One request's state as it moves waiting -> running (<-> preempted) -> finished."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from kvtier.engine.hashing import extend_block_keys
from kvtier.engine.sampling import SamplingParams
from kvtier.load_limit import NO_LOAD_LIMIT


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # eos, a stop token or a stop string
    LENGTH = "length"  # max_tokens, the model context or the KV pool ran out
    ABORT = "abort"  # the caller gave up (abort(), a cancelled stream)
    ERROR = "error"  # the request cannot be served (e.g. prompt longer than the context)


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.perf_counter) for TTFT / ITL / end-to-end latency."""

    arrival_time: float
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    # Where the prompt's KV came from at first admission, in tokens: "device" (prefix cache),
    # "host" / "disk" / "remote" (restored by the tiered connector), "recomputed".
    prompt_token_sources: dict[str, int] = field(default_factory=dict)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.arrival_time if self.token_times else None

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.token_times)]

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


class Request:
    """Token ids (prompt + generated so far), progress, and the bookkeeping around them.

    `num_computed_tokens` counts tokens whose KV is in the pool; the next step computes from
    there. After a preemption it drops to 0 and the request recomputes (mostly from cached
    blocks). `block_keys` holds the keys of the full blocks of `token_ids`, extended as
    tokens arrive, so each block is hashed once.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        namespace: bytes,
        generator: torch.Generator | None = None,
        session_id: str | None = None,
        tenant: str | None = None,
        return_prompt_logits: bool = False,
    ) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.namespace = namespace
        self.generator = generator
        self.session_id = session_id
        self.tenant = tenant
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache at first admission (None until admitted).
        self.num_cached_tokens: int | None = None
        self.block_keys: list[bytes] = []
        # which tiers a restore may load this request's history from, and how much of it
        self.load_limit = NO_LOAD_LIMIT
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.metrics = RequestMetrics(arrival_time=time.perf_counter())
        # Scoring mode: keep the logits of every computed position, sample one token only.
        self.return_prompt_logits = return_prompt_logits
        self.prompt_logits: list[torch.Tensor] = []
        self.prompt_logits_start = 0  # position of the first row of `prompt_logits`

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def keys_of_full_blocks(self, block_size: int) -> list[bytes]:
        return extend_block_keys(self.block_keys, self.token_ids, block_size, self.namespace)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.metrics.token_times.append(time.perf_counter())
