"""SamplingParams (what a request asks for) and the Sampler (logits -> next token ids)."""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.errors import KvtierError

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing logits by 1e-40
# overflows to inf and the softmax to NaN, and anything this cold is an argmax anyway.
SAMPLING_EPS = 1e-5
# Seeds are 64-bit signed integers (OpenAI's and vLLM's range); torch refuses larger ones.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass
class SamplingParams:
    """How to pick tokens, and when to stop (names follow vLLM / OpenAI).

    temperature 0 (or below SAMPLING_EPS, 1e-5) is greedy. top_k 0 or -1 means off; top_p 1
    means off. `seed` (a 64-bit signed integer) makes a sampled request reproducible whatever
    else shares its batch (each request draws from its own generator). `stop` strings end
    generation and are trimmed from the text; `stop_token_ids` end it too (the model's eos
    does unless `ignore_eos`).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise KvtierError(f"temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise KvtierError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise KvtierError(f"top_k must be -1 or 0 (off) or a positive count, got {self.top_k}")
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise KvtierError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise KvtierError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list):
            raise KvtierError(f"stop_token_ids must be a list, got {self.stop_token_ids!r}")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids entry", token_id)
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not INT64_MIN <= self.seed <= INT64_MAX:
                raise KvtierError(f"seed must be a 64-bit signed integer, got {self.seed}")
        if not isinstance(self.ignore_eos, bool):
            raise KvtierError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SamplingParams:
        """Build from user input (JSON body, YAML); unknown keys are errors, not ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise KvtierError(
                f"unknown sampling parameter(s) {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(sorted(known))}"
            )
        return cls(**values)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def make_generator(self, device: str | torch.device) -> torch.Generator | None:
        """The request's own random stream; None for greedy requests (nothing to draw)."""
        if self.greedy:
            return None
        generator = torch.Generator(device=device)
        generator.manual_seed(self.seed if self.seed is not None else secrets.randbits(63))
        return generator


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise KvtierError(f"{name} must be a finite number, got {value!r}")


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise KvtierError(f"{name} must be an integer, got {value!r}")


class Sampler:
    """Next token per row of a [B, vocab] float32 logits batch.

    Greedy rows share one argmax; sampled rows each draw from their own generator (a short
    loop over sampled requests, not over tokens), which is what makes seeds reproducible
    independent of batch composition.
    """

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        next_ids = logits.argmax(dim=-1)
        for row, (p, generator) in enumerate(zip(params, generators, strict=True)):
            if not p.greedy:
                next_ids[row] = _sample_row(logits[row], p, generator)
        return next_ids.tolist()


def _sample_row(
    logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    if p.top_k == 1:
        # Top-1 is greedy; the threshold mask below would keep every token tied for first
        # (bf16 logits tie often) and draw between them at random.
        return logits.argmax()
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if p.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens before it already reach top_p; the first always stays.
        drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, -math.inf))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)[0]
