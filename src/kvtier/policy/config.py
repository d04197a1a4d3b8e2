"""The `[policy]` table: its typed model (PolicyConfig and its sections, pydantic) and its
merge, the file's table, then `KVTIER_POLICY__*` environment variables, then `KEY=VALUE`
settings and the policy's name, validated in one place with errors that name the key, where it
came from and what is allowed. `kvtier.settings` calls it with every command's sources.

Environment variables spell the key path in capitals with `__` between levels:
`KVTIER_POLICY__NAME=offload`, `KVTIER_POLICY__COST__HORIZON_S=10`. Values are read as TOML
values (`10`, `true`, `{device = 30}`), else as strings. docs/reference/config.md has every
key.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from kvtier.errors import KvtierError
from kvtier.plan.geometry import load_geometry
from kvtier.plan.hardware import DEFAULT_EFFICIENCY, get_accelerator
from kvtier.policy.accuracy import FormBudget, form_budget, load_figures
from kvtier.policy.cost_model import (
    DEFAULT_BASE_SHARE,
    DEFAULT_FLOOR_DOLLARS_PER_GB_HOUR,
    DEFAULT_GPU_DOLLARS_PER_HOUR,
    DEFAULT_LINKS,
    CodecSpeed,
    CostModel,
    CostProfile,
    Prices,
    TierLink,
)
from kvtier.policy.predictor import GapPrior, ReusePredictor
from kvtier.policy.ttl import DEFAULT_TTL_S
from kvtier.policy.view import SessionHints
from kvtier.toml_table import read_table, setting_value

ENV_PREFIX = "KVTIER_POLICY__"

TierName = Literal["device", "host", "disk", "remote"]
LowerTier = Literal["host", "disk", "remote"]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]
Share = Annotated[float, Field(ge=0, lt=1)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CostSection(_Section):
    horizon_s: PositiveFloat | None = Field(
        None, description="first step of the decision grid, s; default: `interval_s`"
    )
    gpu_dollars_per_hour: PositiveFloat = Field(
        DEFAULT_GPU_DOLLARS_PER_HOUR, description="what an accelerator hour costs"
    )
    dollars_per_gb_hour: dict[TierName, NonNegativeFloat] = Field(
        default_factory=dict,
        description="rent of a GB-hour per tier (`{device = ..., host = ...}`); tiers left "
        "out: the shipped prices",
    )
    headroom: dict[TierName, Share] = Field(
        default_factory=dict,
        description="share of each tier kept free; tiers left out: device 0.5, others 0.9",
    )
    # one share for every tier, or per tier (tiers left out get the default)
    base_rent_share: (
        Annotated[float, Field(ge=0, le=1)] | dict[TierName, Annotated[float, Field(ge=0, le=1)]]
    ) = Field(
        default_factory=lambda: dict(DEFAULT_BASE_SHARE),
        description="share of the rent charged at any occupancy, one for all tiers or per tier",
    )
    floor_dollars_per_gb_hour: NonNegativeFloat = Field(
        DEFAULT_FLOOR_DOLLARS_PER_GB_HOUR,
        description="the least a GB-hour costs anywhere (0: KV stays while there is room)",
    )
    # (policy.demand)
    forecast_window_s: PositiveFloat = Field(
        60.0, description="arrivals counted towards the device-demand forecast's rate, s"
    )
    # fewer rows per decision, coarser placements
    pricing_chunks: Annotated[int, Field(ge=1, le=1024)] = Field(
        8,
        description="adjacent chunks of a session in one tier priced and placed as one unit, "
        "at most (1: chunk by chunk)",
    )


class PredictorSection(_Section):
    max_age_s: PositiveFloat = Field(
        3600.0, description='idle longer = "never returned"; p_reuse is 0 beyond'
    )
    min_gap_s: PositiveFloat = Field(1.0, description="shortest gap the histograms resolve, s")
    bins: Annotated[int, Field(ge=2, le=4096)] = Field(
        64, description="log-spaced bins of each gap histogram"
    )
    max_keys: Annotated[int, Field(ge=1)] = Field(
        1024, description="histograms kept (one per tenant and prompt prefix)"
    )
    prior_median_s: PositiveFloat = Field(
        GapPrior.median_s, description="the prior's median gap, s"
    )
    prior_sigma: PositiveFloat = Field(GapPrior.sigma, description="the prior's log-normal sigma")
    prior_no_return: Share = Field(
        GapPrior.no_return, description="the prior's share of sessions that never return"
    )
    prior_weight: NonNegativeFloat = Field(
        GapPrior.weight, description="observations the prior counts as"
    )

    @model_validator(mode="after")
    def _gap_range(self) -> PredictorSection:
        if self.min_gap_s >= self.max_age_s:
            raise ValueError("min_gap_s must be below max_age_s")
        return self

    def build(self) -> ReusePredictor:
        prior = GapPrior(
            self.prior_median_s, self.prior_sigma, self.prior_no_return, self.prior_weight
        )
        return ReusePredictor(
            max_age_s=self.max_age_s,
            min_gap_s=self.min_gap_s,
            bins=self.bins,
            prior=prior,
            max_keys=self.max_keys,
        )


class TtlSection(_Section):
    seconds: dict[TierName, PositiveFloat] = Field(
        default_factory=lambda: dict(DEFAULT_TTL_S),
        description="the ttl policy: idle seconds before KV leaves each tier",
    )


class OffloadSection(_Section):
    watermark: Annotated[float, Field(gt=0, le=1)] = Field(
        0.9, description="the offload policy: device occupancy that starts moving KV down"
    )


class LinkSection(_Section):
    bandwidth: PositiveFloat = Field(description="bytes/s")
    latency_s: NonNegativeFloat = Field(0.0, description="s")


class CodecSection(_Section):
    encode_bytes_per_s: PositiveFloat  # bytes of full-precision KV encoded per second
    decode_bytes_per_s: PositiveFloat


class ProfileSection(_Section):
    """Prefill coefficients given outright, or derived from a model and an accelerator."""

    model: str = Field(
        "llama-3.1-8b",
        description="prefill coefficients derived from this model (a bundled name or "
        "config.json) ...",
    )
    hardware: str = Field("h100-sxm", description="... on this accelerator (`kvtier plan`)")
    gpus: Annotated[int, Field(ge=1)] = Field(1, description="... with this many of them")
    efficiency: Annotated[float, Field(gt=0, le=1)] = Field(
        DEFAULT_EFFICIENCY, description="... at this share of peak FLOPs"
    )
    prefill_fixed_s: NonNegativeFloat | None = Field(
        None, description="measured prefill coefficients: all three or none (derived)"
    )
    prefill_token_s: NonNegativeFloat | None = Field(None, description="per prompt token, s")
    prefill_pair_s: NonNegativeFloat | None = Field(
        None, description="per (token, earlier token) pair of attention, s"
    )
    links: dict[LowerTier, LinkSection] = Field(
        default_factory=dict,
        description="`{host = {bandwidth = 25e9, latency_s = 1e-5}}`; tiers left out: PCIe4 "
        "/ NVMe4 / 100 GbE",
    )
    # default: this machine's CPU, measured, with coefficients given; derived from the
    # accelerator's memory bandwidth otherwise
    codecs: dict[Literal["int8", "int4"], CodecSection] = Field(
        default_factory=dict,
        description="stored form -> `{encode_bytes_per_s, decode_bytes_per_s}`",
    )

    @model_validator(mode="after")
    def _all_or_no_coefficients(self) -> ProfileSection:
        given = [self.prefill_fixed_s, self.prefill_token_s, self.prefill_pair_s]
        if any(x is not None for x in given) and any(x is None for x in given):
            raise ValueError(
                "give all three of prefill_fixed_s, prefill_token_s, prefill_pair_s, or none "
                "(then they are derived from model and hardware)"
            )
        return self

    def build(self) -> CostProfile:
        links = {**DEFAULT_LINKS}
        links.update(
            {tier: TierLink(link.bandwidth, link.latency_s) for tier, link in self.links.items()}
        )
        codecs = {
            form: CodecSpeed(codec.encode_bytes_per_s, codec.decode_bytes_per_s)
            for form, codec in self.codecs.items()
        }
        if self.prefill_fixed_s is not None:
            profile = CostProfile(
                self.prefill_fixed_s, self.prefill_token_s, self.prefill_pair_s, links
            )
        else:
            profile = CostProfile.from_geometry(
                load_geometry(self.model),
                get_accelerator(self.hardware),
                gpus=self.gpus,
                efficiency=self.efficiency,
                links=links,
            )
        return dataclasses.replace(profile, codecs={**profile.codecs, **codecs})


class PolicyConfig(_Section):
    name: str = Field(
        "cost",
        description="retain, recompute, offload, ttl, cost, an entry point in "
        "`kvtier.policies`, or `module:Class`",
    )
    interval_s: PositiveFloat = Field(
        5.0, description="how often the engine calls `decide()` on its timer, s"
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of a custom policy"
    )
    cost: CostSection = Field(default_factory=CostSection)
    predictor: PredictorSection = Field(default_factory=PredictorSection)
    ttl: TtlSection = Field(default_factory=TtlSection)
    offload: OffloadSection = Field(default_factory=OffloadSection)
    profile: ProfileSection = Field(default_factory=ProfileSection)
    # (policy.accuracy)
    max_accuracy_loss: Annotated[float, Field(ge=0, allow_inf_nan=False)] = Field(
        0.0,
        description="points of `kvtier eval` score a stored form may lose (0: full precision only)",
    )
    accuracy_file: str | None = Field(
        None,
        description="a `forms.json` from `kvtier eval --kv-forms`; default: the bundled "
        "figures for the model",
    )
    # commands set it to the model they run
    accuracy_model: str | None = Field(
        None, description="the model the bundled figures are looked up for"
    )

    @field_validator("accuracy_file")
    @classmethod
    def _readable_figures(cls, path: str | None) -> str | None:
        if path is not None:
            try:
                load_figures(path)
            except KvtierError as exc:
                raise ValueError(str(exc)) from None
        return path

    def form_budget(self) -> FormBudget:
        """The forms `max_accuracy_loss` allows for `accuracy_model`."""
        return form_budget(self.max_accuracy_loss, self.accuracy_model, self.accuracy_file)

    def for_model(self, model: str | Path | None) -> PolicyConfig:
        """This configuration, looking accuracy figures up for `model` unless it names one."""
        if self.accuracy_model is not None or model is None:
            return self
        return self.model_copy(update={"accuracy_model": str(model)})

    @property
    def horizon_s(self) -> float:
        return self.cost.horizon_s or self.interval_s

    def cost_model(self, profile: CostProfile | None = None) -> CostModel:
        prices = Prices.from_dollars(
            self.cost.gpu_dollars_per_hour,
            self.cost.dollars_per_gb_hour,
            self.cost.headroom,
            self.cost.base_rent_share,
            self.cost.floor_dollars_per_gb_hour,
        )
        return CostModel(profile or self.profile.build(), prices)


class RequestOverrides(_Section):
    """A request's session hints as a client sends them (`SessionHints` documents each);
    every request path (`kvtier serve`'s body and headers, vLLM's `kv_transfer_params`,
    trace files) validates them here."""

    close: bool = False
    expect_return_s: Annotated[float, Field(ge=0, le=7 * 24 * 3600)] | None = None
    priority: Annotated[int, Field(ge=-8, le=8)] = 0
    pin: bool = False
    ttl_s: Annotated[float, Field(gt=0, le=7 * 24 * 3600)] | None = None

    def hints(self) -> SessionHints:
        return SessionHints(**self.model_dump())


def parse_request_overrides(data: Mapping[str, Any]) -> RequestOverrides:
    try:
        return RequestOverrides.model_validate(data)
    except ValidationError as exc:
        lines = [_describe(error, "request", {}, RequestOverrides) for error in exc.errors()]
        raise KvtierError("invalid session hints: " + "; ".join(lines)) from None


def parse_session_hints(data: Mapping[str, Any]) -> SessionHints:
    """`data` validated (a one-line KvtierError naming the field otherwise)."""
    return parse_request_overrides(data).hints()


# One assignment to the [policy] table: its key path, the value, and where it came from.
Assignment = tuple[tuple[str, ...], Any, str]


def load_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    settings: Sequence[str] = (),
    policy: str | None = None,
) -> PolicyConfig:
    """Merge the file's [policy] table, `env` (KVTIER_POLICY__*), `settings` (KEY=VALUE) and
    `policy` (a name), in that order, and validate. The policy name must resolve."""
    assignments = [] if path is None else table_assignments(read_table(path, "policy"), str(path))
    assignments += env_assignments(env or {})
    assignments += setting_assignments(settings)
    if policy is not None:
        assignments.append((("name",), policy, "--policy"))
    return load_config_traced(assignments)[0]


def load_config_traced(
    assignments: Sequence[Assignment],
) -> tuple[PolicyConfig, dict[str, str]]:
    """The [policy] table the assignments make, each later one winning, validated; and where
    each key given came from (dotted key -> source)."""
    from kvtier.policy.registry import resolve_policy  # registry imports every policy

    merged: dict[str, Any] = {}
    source: dict[tuple[str, ...], str] = {}
    for keys, value, label in assignments:
        _set(merged, source, keys, value, label)
    try:
        config = PolicyConfig.model_validate(merged)
    except ValidationError as exc:
        lines = [_describe(error, "policy", source, PolicyConfig) for error in exc.errors()]
        raise KvtierError("invalid policy configuration: " + "; ".join(lines)) from None
    resolve_policy(config.name)
    return config, {".".join(keys): label for keys, label in source.items()}


def table_assignments(
    table: Mapping[str, Any],
    label: str,
    *,
    whole: Collection[str] = (),
    prefix: tuple[str, ...] = (),
) -> list[Assignment]:
    """A nested table's leaves (a key in `whole` is one value, not a table to descend)."""
    assignments: list[Assignment] = []
    for key, value in table.items():
        if isinstance(value, Mapping) and key not in whole:
            assignments += table_assignments(value, label, whole=whole, prefix=(*prefix, key))
        else:
            assignments.append(((*prefix, key), value, label))
    return assignments


def env_assignments(env: Mapping[str, str]) -> list[Assignment]:
    """`KVTIER_POLICY__COST__HORIZON_S=10` -> (("cost", "horizon_s"), 10, ...), sorted."""
    return [
        (
            tuple(variable.removeprefix(ENV_PREFIX).lower().split("__")),
            setting_value(text),
            f"environment variable {variable}",
        )
        for variable, text in sorted(env.items())
        if variable.startswith(ENV_PREFIX)
    ]


def setting_assignments(settings: Sequence[str], label: str = "--policy-set") -> list[Assignment]:
    """`KEY=VALUE` settings, KEY dotted below [policy]."""
    assignments: list[Assignment] = []
    for setting in settings:
        key, sep, text = setting.partition("=")
        if not sep or not key.strip():
            raise KvtierError(f"{label} takes KEY=VALUE (e.g. cost.horizon_s=10), not {setting!r}")
        keys = tuple(key.strip().split("."))
        assignments.append((keys, setting_value(text.strip()), f"{label} {setting}"))
    return assignments


def _set(
    into: dict[str, Any],
    source: dict[tuple[str, ...], str],
    keys: tuple[str, ...],
    value: Any,
    label: str,
) -> None:
    node = into
    for depth, key in enumerate(keys[:-1]):
        child = node.get(key)
        if not isinstance(child, dict):
            child = node[key] = {}
            source[keys[: depth + 1]] = label
        node = child
    node[keys[-1]] = value
    source[keys] = label


def _describe(
    error: Mapping[str, Any],
    root: str,
    source: Mapping[tuple[str, ...], str],
    model: type[BaseModel],
) -> str:
    loc = tuple(str(part) for part in error["loc"] if part != "[key]")
    key = ".".join((root, *loc))
    origin = next((source[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in source), None)
    where = f" (from {origin})" if origin else ""
    if error["type"] == "extra_forbidden":
        allowed = _allowed_keys(model, loc[:-1])
        close = difflib.get_close_matches(loc[-1], allowed, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        return f"{key}{where}: unknown key; allowed here: {', '.join(allowed)}{hint}"
    message = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] not in ("missing", "value_error"):
        message += f", got {error['input']!r}"
    return f"{key}{where}: {message}"


def _allowed_keys(model: type[BaseModel], loc: tuple[str, ...]) -> list[str]:
    for part in loc:
        annotation = model.model_fields[part].annotation if part in model.model_fields else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)
