"""Policy names -> classes: the shipped ones, installed plugins, or a `module:Class` path.

A plugin package registers a class under the entry point group `kvtier.policies`:

    [project.entry-points."kvtier.policies"]
    mine = "my_package.policy:MyPolicy"
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from kvtier.errors import KvtierError
from kvtier.policy.base import RetentionPolicy
from kvtier.policy.close_lru import CloseAwareLruPolicy
from kvtier.policy.continuum import ContinuumPolicy
from kvtier.policy.cost_model import CostProfile
from kvtier.policy.cost_policy import CostPolicy
from kvtier.policy.offload import OffloadPolicy
from kvtier.policy.oracle import OraclePolicy
from kvtier.policy.recompute import RecomputePolicy
from kvtier.policy.retain import RetainPolicy
from kvtier.policy.ttl import TtlPolicy

if TYPE_CHECKING:
    from kvtier.policy.config import PolicyConfig

ENTRY_POINT_GROUP = "kvtier.policies"

POLICIES: dict[str, type[RetentionPolicy]] = {
    cls.name: cls
    for cls in (
        RetainPolicy,
        RecomputePolicy,
        OffloadPolicy,
        TtlPolicy,
        ContinuumPolicy,
        CloseAwareLruPolicy,
        CostPolicy,
        OraclePolicy,
    )
}


def resolve_policy(name: str) -> type[RetentionPolicy]:
    """The class a policy name stands for; a clear error naming the choices otherwise."""
    if name in POLICIES:
        return POLICIES[name]
    plugins = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    if name in plugins:
        try:
            cls = plugins[name].load()
        except Exception as exc:  # a broken plugin must not take the command down unexplained
            raise KvtierError(
                f"policy {name!r} (entry point {plugins[name].value}) failed to load: {exc}"
            ) from exc
        return _check(cls, f"entry point {name!r}")
    if ":" in name:
        return _check(_import(name), repr(name))
    choices = ", ".join([*POLICIES, *sorted(plugins)])
    raise KvtierError(
        f"unknown policy {name!r}; choose one of {choices}, or give a class as module:Class"
    )


def build_policy(config: PolicyConfig, profile: CostProfile | None = None) -> RetentionPolicy:
    """The configured policy. `profile` (measured by the engine or a simulator's hardware)
    replaces `[policy.profile]`; prices always come from `[policy.cost]`."""
    cls = resolve_policy(config.name)
    return cls.from_config(config, config.cost_model(profile))


def _import(path: str) -> object:
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise KvtierError(f"policy path {path!r} must look like package.module:ClassName")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise KvtierError(f"policy {path!r}: cannot import module {module_name!r} ({exc})") from exc
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise KvtierError(f"policy {path!r}: module {module_name!r} has no {attribute!r}") from None


def _check(cls: object, where: str) -> type[RetentionPolicy]:
    if not (isinstance(cls, type) and issubclass(cls, RetentionPolicy)):
        raise KvtierError(
            f"policy {where} is {cls!r}, not a subclass of kvtier.policy.base.RetentionPolicy"
        )
    return cls
