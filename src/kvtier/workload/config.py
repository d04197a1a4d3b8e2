"""What the workload generator draws from: every distribution's parameters, validated.

Lengths are lognormal, given by their mean and coefficient of variation (std / mean) and
clipped to [min_tokens, max_tokens]: message and answer lengths in chat logs are right-skewed
with a long tail, which a lognormal matches with two intuitive numbers.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvtier.errors import KvtierError


class LengthDist(BaseModel):
    """Token counts: lognormal with this mean and cv, clipped to [min_tokens, max_tokens]."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mean: float = Field(gt=0)
    cv: float = Field(ge=0)
    min_tokens: int = Field(1, ge=1)
    max_tokens: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> LengthDist:
        if not self.min_tokens <= self.mean <= self.max_tokens:
            raise ValueError(
                f"need min_tokens <= mean <= max_tokens, got {self.min_tokens} <= {self.mean} "
                f"<= {self.max_tokens}"
            )
        return self

    def sample(self, rng: np.random.Generator) -> int:
        sigma2 = math.log1p(self.cv**2)
        value = rng.lognormal(math.log(self.mean) - sigma2 / 2, math.sqrt(sigma2))
        return int(min(max(round(value), self.min_tokens), self.max_tokens))


class AppClassSpec(BaseModel):
    """One app class of a multi-class population: its share of sessions, and the generator
    fields its sessions draw from instead of the population's (e.g. think times, turns,
    system prompt length)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    share: float = Field(gt=0, description="relative share of sessions in this class")
    set: dict[str, Any] = Field(default_factory=dict, description="fields that differ")


class ToolSpec(BaseModel):
    """One tool an agent calls: how often it is picked among the tools, how long it runs
    (lognormal: median and sigma, seconds) and how long its result is."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    share: float = Field(gt=0, description="relative share of the calls")
    duration_median_s: float = Field(gt=0, description="median run time, s")
    duration_sigma: float = Field(0.8, ge=0, description="lognormal sigma of the run time")
    result_tokens: LengthDist

    def duration(self, rng: np.random.Generator) -> float:
        return float(rng.lognormal(math.log(self.duration_median_s), self.duration_sigma))


# population-level fields a class may not override: they shape arrivals, not sessions
POPULATION_FIELDS = ("sessions", "session_rate", "arrival_cv", "apps", "tenants", "classes")


class GeneratorConfig(BaseModel):
    """A population of chat sessions. Times in seconds, lengths in tokens."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sessions: int = Field(ge=1, description="sessions to generate")
    session_rate: float = Field(gt=0, description="mean session arrivals per second")
    arrival_cv: float = Field(
        1.0, gt=0, description="cv of the gaps between session arrivals: 1 Poisson, >1 bursty"
    )
    mean_turns: float = Field(
        ge=1,
        description="mean turns per session; after each turn the user leaves with "
        "probability 1/mean_turns (abandonment)",
    )
    max_turns: int = Field(ge=1, description="cap on turns per session")
    followup_share: float = Field(
        ge=0, le=1, description="share of returns that are quick follow-ups (vs pauses)"
    )
    followup_median_s: float = Field(gt=0, description="median think time of a follow-up")
    followup_sigma: float = Field(0.5, ge=0, description="lognormal sigma of follow-ups")
    pause_median_s: float = Field(gt=0, description="median length of a pause")
    pause_sigma: float = Field(0.8, ge=0, description="lognormal sigma of pauses")
    system_prompt_tokens: int = Field(ge=0, description="length of each app's system prompt")
    apps: int = Field(1, ge=1, description="distinct system prompts (app classes)")
    tenants: int = Field(1, ge=1, description="tenants sessions are spread over")
    user_tokens: LengthDist
    answer_tokens: LengthDist
    document_share: float = Field(
        0.0, ge=0, le=1, description="share of sessions whose first message carries a document"
    )
    document_tokens: LengthDist | None = None
    max_history_tokens: int | None = Field(
        None, ge=1, description="resent history budget; the oldest turns are dropped beyond it"
    )
    decode_tok_s: float = Field(
        50.0, gt=0, description="answer speed assumed to place the next turn on the trace clock"
    )
    block_size: int = Field(16, ge=1, description="tokens per prefix block id")
    tools: dict[str, ToolSpec] | None = Field(
        None, description="tools its sessions call (name -> share, run time, result length)"
    )
    tool_call_share: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="share of replies that end in a tool call (with tools): the agent comes "
        "back when the tool returns, with its result as the next message",
    )
    hints: bool = Field(
        False,
        description="the client sends session hints: the expected return after a tool call "
        "(the tool's median run time) and close on a session's last turn",
    )
    classes: dict[str, AppClassSpec] | None = Field(
        None,
        description="app classes whose sessions behave differently (name -> share and "
        "fields); the class name is the session's app_class, as an API key's app would be",
    )

    @model_validator(mode="after")
    def _consistent(self) -> GeneratorConfig:
        if self.document_share > 0 and self.document_tokens is None:
            raise ValueError("document_share > 0 needs document_tokens")
        if self.tool_call_share > 0 and not self.tools:
            raise ValueError("tool_call_share > 0 needs tools")
        if self.mean_turns > self.max_turns:
            raise ValueError(f"mean_turns {self.mean_turns} exceeds max_turns {self.max_turns}")
        for name, spec in (self.classes or {}).items():
            fixed = sorted(set(spec.set) & set(POPULATION_FIELDS))
            if fixed:
                raise ValueError(f"class {name!r} cannot set population fields {fixed}")
            self.of_class(name)  # validates the class's fields
        return self

    def of_class(self, name: str) -> GeneratorConfig:
        """The config a session of class `name` draws its turns from."""
        spec = (self.classes or {})[name]
        base = self.model_dump(exclude={"classes"}, exclude_none=True)
        return GeneratorConfig.model_validate({**base, **spec.set})

    @property
    def abandon_prob(self) -> float:
        return 1.0 / self.mean_turns

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GeneratorConfig:
        """Validate, turning pydantic's report into one KvtierError line per problem."""
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(part) for part in err['loc']) or 'config'}: {err['msg']}"
                for err in exc.errors()
            )
            raise KvtierError(f"invalid workload generator config: {problems}") from None
