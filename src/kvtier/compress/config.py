"""What compression a request's KV gets: a pipeline of presses, each named with its budget.

`ratio` is the share of the sequence's KV removed (0 keeps everything); `keep_tokens` is an
absolute budget instead (a press with `keep_tokens` keeps at most that many tokens, and for
StreamingLLM also bounds the cache while decoding). Validated once, with messages that say
what to change.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvtier.errors import KvtierError

EVICTION_PRESSES = ("streaming_llm", "h2o", "scissorhands", "snapkv", "tova", "knorm")
PRESS_NAMES = (*EVICTION_PRESSES, "kivi", "lowrank")


class PressSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    ratio: float = 0.0
    keep_tokens: int | None = None
    options: dict[str, Any] = Field(default_factory=dict)

    def __init__(self, **data: Any) -> None:
        # Raise KvtierError (the CLI's clear one-liner), not pydantic's ValidationError.
        try:
            super().__init__(**data)
        except ValueError as exc:
            raise KvtierError(_first_message(exc)) from None

    @field_validator("name")
    @classmethod
    def _known_name(cls, name: str) -> str:
        if name not in PRESS_NAMES:
            raise ValueError(f"unknown press {name!r}; known presses: {', '.join(PRESS_NAMES)}")
        return name

    @field_validator("ratio")
    @classmethod
    def _ratio_in_range(cls, ratio: float) -> float:
        if not 0.0 <= ratio < 1.0:
            raise ValueError(
                f"compression ratio must be in [0, 1) (share of the KV removed), got {ratio!r}"
            )
        return ratio

    @field_validator("keep_tokens")
    @classmethod
    def _positive_keep(cls, keep: int | None) -> int | None:
        if keep is not None and keep < 1:
            raise ValueError(f"keep_tokens must be a positive number of tokens, got {keep!r}")
        return keep

    @model_validator(mode="after")
    def _one_budget(self) -> PressSpec:
        if self.keep_tokens is not None and self.ratio > 0:
            raise ValueError(
                f"press {self.name!r}: give either ratio or keep_tokens, not both "
                f"(ratio={self.ratio}, keep_tokens={self.keep_tokens})"
            )
        return self

    @model_validator(mode="after")
    def _lowrank_keeps_tokens(self) -> PressSpec:
        if self.name == "lowrank" and self.keep_tokens is not None:
            raise ValueError(
                "press 'lowrank' keeps every token and removes dimensions: give ratio "
                "(share of the bytes removed) or options.rank, not keep_tokens"
            )
        return self

    @property
    def is_identity(self) -> bool:
        """True when this press changes nothing (an eviction press with no budget, or low
        rank at ratio 0 with no rank given)."""
        if self.name == "lowrank":
            return self.ratio == 0 and "rank" not in self.options
        return self.name in EVICTION_PRESSES and self.ratio == 0 and self.keep_tokens is None


class CompressionConfig(BaseModel):
    """A pipeline: presses applied in order to each request once its prompt is prefilled."""

    model_config = ConfigDict(extra="forbid")

    presses: list[PressSpec]

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except KvtierError:
            raise
        except ValueError as exc:
            raise KvtierError(_first_message(exc)) from None

    @property
    def is_identity(self) -> bool:
        return all(p.is_identity for p in self.presses)


def _first_message(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        message = str(first.get("msg", exc)).removeprefix("Value error, ")
        return f"{where}: {message}" if where else message
    return str(exc)
