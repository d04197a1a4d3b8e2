"""Hardware profiles: the accelerator, its efficiencies, the tensor-parallel interconnect and the
links to each lower KV tier, as files validated by pydantic.

Bundled profiles are `kvtier/data/hardware/<name>.toml` (`h100-sxm`, `h200`, `a100-80gb`,
`l40s`, and `local-cpu`, whose placeholders `kvtier calibrate` replaces); any TOML or JSON file
with the same fields works. Facts kvtier already holds are referenced, not copied: an
`accelerator = "h100-sxm"` names a `kvtier.plan.hardware` preset (peak FLOP/s, HBM bandwidth,
memory), and `[links.disk] link = "nvme5"` names one of its links (read bandwidth), completed by
`data/hardware/links.toml` (latency, write bandwidth, duplex). A profile can give any of these
numbers itself instead, which is what a measured profile does.

A name is looked up in this order: an existing file of that path; a calibrated profile
`$KVTIER_CACHE/profiles/<name>.toml` (what `kvtier calibrate` writes); the bundled file.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvtier.errors import KvtierError
from kvtier.paths import cache_dir
from kvtier.plan.hardware import ACCELERATORS, DEFAULT_EFFICIENCY, LINKS, Accelerator
from kvtier.policy.cost_model import CodecSpeed, TierLink, memory_bound_codecs

PositiveFloat = Annotated[float, Field(gt=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]
Share = Annotated[float, Field(gt=0, le=1)]
LowerTier = Literal["host", "disk", "remote"]

_LINK_BANDWIDTH = {link.key: link.bandwidth for link in LINKS}
_LINKS_FILE = "links.toml"
CALIBRATED_FOLDER = "profiles"  # under $KVTIER_CACHE


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AcceleratorSpec(_Strict):
    """An accelerator given by its numbers (one GPU, or a measured machine)."""

    name: str
    peak_flops: PositiveFloat  # dense bf16 FLOP/s
    memory_bandwidth: PositiveFloat  # bytes/s
    memory_bytes: Annotated[int, Field(gt=0)]


class Efficiency(_Strict):
    compute: Share = DEFAULT_EFFICIENCY  # share of peak FLOP/s that GEMMs reach
    memory: Share = 0.8  # share of memory bandwidth that weight and KV reads reach


class CodecSpec(_Strict):
    """A stored form's codec speed on this hardware, in bytes of full-precision KV per second
    (measured; without it, derived from memory bandwidth: cost_model.CodecSpeed.memory_bound)."""

    encode_bytes_per_s: PositiveFloat
    decode_bytes_per_s: PositiveFloat


class Interconnect(_Strict):
    """What tensor parallelism's all-reduces run over, per GPU and direction."""

    bandwidth: PositiveFloat  # bytes/s
    latency_s: NonNegativeFloat = 0.0  # per all-reduce


class LinkFacts(_Strict):
    """An entry of links.toml."""

    latency_s: NonNegativeFloat
    write_bandwidth: PositiveFloat | None = None
    duplex: bool = True


class LinkSpec(_Strict):
    """A tier's link: a named link of kvtier.plan.hardware, and/or its numbers."""

    link: str | None = None
    bandwidth: PositiveFloat | None = None  # bytes/s towards the device
    write_bandwidth: PositiveFloat | None = None  # bytes/s into the tier
    latency_s: NonNegativeFloat | None = None
    duplex: bool | None = None

    @model_validator(mode="after")
    def _known(self) -> LinkSpec:
        if self.link is None and (self.bandwidth is None or self.latency_s is None):
            raise ValueError("give `link` (a link name) or both `bandwidth` and `latency_s`")
        if self.link is not None and self.link not in _LINK_BANDWIDTH:
            raise ValueError(f"unknown link {self.link!r}; known: {', '.join(_LINK_BANDWIDTH)}")
        return self


@dataclass(frozen=True)
class TierPath:
    """A resolved link: transfers towards the device (`read`) and into the tier (`write`);
    `duplex=False` means the two directions share one bandwidth."""

    read: TierLink
    write: TierLink
    duplex: bool


class HardwareProfile(_Strict):
    name: str
    description: str = ""
    sources: list[str] = Field(default_factory=list)
    accelerator: str | AcceleratorSpec  # a kvtier.plan.hardware preset, or the numbers
    efficiency: Efficiency = Field(default_factory=Efficiency)
    step_overhead_s: NonNegativeFloat = 0.0  # per step, outside the GPU's work
    sequence_overhead_s: NonNegativeFloat = 0.0  # per sequence in a step (bookkeeping, sampling)
    # per key a query attends to, outside the roofline: gathering paged KV and masks (a CPU
    # engine pays it; fused GPU kernels fold it into the memory term, so 0 there)
    key_overhead_s: NonNegativeFloat = 0.0
    interconnect: Interconnect | None = None  # None: one GPU per replica only
    links: dict[LowerTier, LinkSpec] = Field(default_factory=dict)
    codecs: dict[Literal["int8", "int4"], CodecSpec] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _known_preset(self) -> HardwareProfile:
        if isinstance(self.accelerator, str) and self.accelerator not in ACCELERATORS:
            raise ValueError(
                f"accelerator {self.accelerator!r} is not a kvtier.plan.hardware preset "
                f"({', '.join(ACCELERATORS)}); give a table with name, peak_flops, "
                "memory_bandwidth and memory_bytes instead"
            )
        return self

    def device(self) -> Accelerator:
        """One accelerator's peak numbers."""
        spec = self.accelerator
        if isinstance(spec, str):
            return ACCELERATORS[spec]
        return Accelerator(
            spec.name, spec.name, spec.peak_flops, spec.memory_bytes, spec.memory_bandwidth
        )

    def codec_speeds(self, gpus: int = 1) -> dict[str, CodecSpeed]:
        """Each stored form's codec on `gpus` accelerators that each code their share of a
        chunk: measured where the profile gives it, else memory-bound at the profile's memory
        efficiency."""
        derived = memory_bound_codecs(
            gpus * self.device().memory_bandwidth * self.efficiency.memory
        )
        measured = {
            form: CodecSpeed(spec.encode_bytes_per_s * gpus, spec.decode_bytes_per_s * gpus)
            for form, spec in self.codecs.items()
        }
        return {**derived, **measured}

    def tier_paths(self) -> dict[str, TierPath]:
        """Each configured lower tier's link, named links completed from links.toml."""
        return {tier: _resolve(spec) for tier, spec in self.links.items()}

    def with_links(self, links: dict[str, str]) -> HardwareProfile:
        """The same profile with some tiers on other named links (e.g. {"disk": "nvme4"})."""
        specs = {tier: spec.model_dump(exclude_none=True) for tier, spec in self.links.items()}
        specs.update({tier: {"link": key} for tier, key in links.items()})
        return validate_profile({**self.model_dump(), "links": specs}, f"profile {self.name}")


def bundled_profiles() -> list[str]:
    folder = resources.files("kvtier") / "data" / "hardware"
    return sorted(
        p.name.removesuffix(".toml")
        for p in folder.iterdir()
        if p.name.endswith(".toml") and p.name != _LINKS_FILE
    )


def calibrated_path(name: str) -> Path:
    """Where `kvtier calibrate` puts the profile called `name`, and where lookup finds it."""
    return cache_dir() / CALIBRATED_FOLDER / f"{name}.toml"


def profile_origin(name_or_path: str, *, calibrated: bool = True) -> str:
    """Which file `load_profile` takes for this name: "file PATH", "calibrated PATH" or
    "bundled" (a name that is none of them raises as load_profile does)."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return f"file {path}"
    if calibrated and _plain_name(name_or_path) and calibrated_path(name_or_path).is_file():
        return f"calibrated {calibrated_path(name_or_path)}"
    if name_or_path not in bundled_profiles():
        raise KvtierError(
            f"unknown hardware profile {name_or_path!r}: not a bundled name, a calibrated "
            f"profile in {cache_dir() / CALIBRATED_FOLDER} or an existing file; "
            f"bundled: {', '.join(bundled_profiles())}"
        )
    return "bundled"


def load_profile(name_or_path: str, *, calibrated: bool = True) -> HardwareProfile:
    """A .toml / .json file holding a profile, else the calibrated profile of that name
    (unless `calibrated=False`), else the bundled one."""
    origin = profile_origin(name_or_path, calibrated=calibrated)
    if origin != "bundled":
        path = Path(origin.split(" ", 1)[1])
        return validate_profile(_read(path, str(path)), str(path))
    resource = resources.files("kvtier") / "data" / "hardware" / f"{name_or_path}.toml"
    with resources.as_file(resource) as file:
        return validate_profile(_read(file, file.name), f"bundled profile {name_or_path}")


def _plain_name(name: str) -> bool:
    return bool(name) and Path(name).name == name and not name.startswith(".")


def validate_profile(data: dict[str, Any], source: str) -> HardwareProfile:
    """Validate profile contents; every problem becomes part of one KvtierError line."""
    try:
        return HardwareProfile.model_validate(data)
    except ValidationError as exc:
        raise KvtierError(f"invalid hardware profile {source}: {_describe(exc)}") from None


def _read(path: Path, source: str) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except OSError as exc:
        raise KvtierError(f"cannot read hardware profile {source}: {exc}") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise KvtierError(f"hardware profile {source} is not valid TOML/JSON: {exc}") from None
    if not isinstance(data, dict):
        raise KvtierError(f"hardware profile {source} does not hold a table/object")
    return data


@cache
def _link_facts() -> dict[str, LinkFacts]:
    resource = resources.files("kvtier") / "data" / "hardware" / _LINKS_FILE
    with resources.as_file(resource) as file:
        data = _read(file, _LINKS_FILE)
    try:
        return {key: LinkFacts.model_validate(value) for key, value in data.items()}
    except ValidationError as exc:
        raise KvtierError(f"invalid {_LINKS_FILE}: {_describe(exc)}") from None


def _resolve(spec: LinkSpec) -> TierPath:
    facts = _link_facts().get(spec.link) if spec.link is not None else None
    if spec.link is not None and facts is None:
        raise KvtierError(f"link {spec.link!r} has no entry in data/hardware/{_LINKS_FILE}")
    read_bw = spec.bandwidth or _LINK_BANDWIDTH[spec.link]
    latency = spec.latency_s if spec.latency_s is not None else facts.latency_s
    write_bw = spec.write_bandwidth or (facts.write_bandwidth if facts else None) or read_bw
    duplex = spec.duplex if spec.duplex is not None else (facts.duplex if facts else True)
    return TierPath(TierLink(read_bw, latency), TierLink(write_bw, latency), duplex)


def _describe(exc: ValidationError) -> str:
    problems = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "profile"
        message = error["msg"]
        if error["type"] not in ("missing", "value_error"):
            message += f", got {error['input']!r}"
        problems.append(f"{where}: {message}")
    return "; ".join(problems)
