"""The `[compression]` table: the KV compression pipeline every request of a served engine
gets, a preset or a list of presses (kvtier.compress builds it)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvtier.errors import KvtierError


class CompressionSection(BaseModel):
    """The `[compression]` table of kvtier.toml: `preset` (a scenario preset of
    kvtier.compress.presets, "full" or "auto") or `presses` (a pipeline, in order: tables of
    name, ratio or keep_tokens, options), not both; neither means no compression."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    preset: str | None = Field(
        None,
        description='a scenario preset ([compression.md](../compression.md)), "full" or "auto"',
    )
    presses: list[dict[str, Any]] | None = Field(
        None,
        description="a pipeline, in order: tables of `name`, `ratio` or `keep_tokens`, `options`",
    )

    @model_validator(mode="after")
    def _one_pipeline(self) -> CompressionSection:
        from kvtier.compress.config import PressSpec
        from kvtier.compress.presets import PRESETS

        if self.preset is not None and self.presses is not None:
            raise ValueError("give either preset or presses, not both")
        if self.preset is not None and self.preset not in (*PRESETS, "full", "auto"):
            raise ValueError(
                f"unknown preset {self.preset!r}; choose one of "
                f"{', '.join((*PRESETS, 'full', 'auto'))}"
            )
        if self.presses is not None and not self.presses:
            raise ValueError("presses is empty: list at least one press, or leave it out")
        for index, press in enumerate(self.presses or []):
            try:
                PressSpec(**press)
            except KvtierError as exc:
                raise ValueError(f"presses[{index}]: {exc}") from None
        return self

    @property
    def is_auto(self) -> bool:
        return self.preset == "auto"

    def build(self, auto: Any = None) -> Any:
        """The pipeline for `EngineConfig.compression` (a CompressionConfig, or None for no
        compression). `auto` is `kvtier.compress.auto`'s AutoChoice for preset "auto": only a
        command that knows its workload can supply it."""
        from kvtier.compress import CompressionConfig, PressSpec, parse_method

        if self.presses is not None:
            return CompressionConfig(presses=[PressSpec(**press) for press in self.presses])
        if self.is_auto:
            if auto is None:
                raise KvtierError(
                    '[compression] preset = "auto" picks by observed workload, which this '
                    "command does not see; name a preset or list presses (kvtier bench "
                    "resolves auto from the workload it replays)"
                )
            return parse_method(auto.method)
        return None if self.preset is None else parse_method(self.preset)
