"""How much of `cost`'s distance from the oracle is its predictor still learning, and how much is
information no predictor has: `cost` with its reuse predictor warm-started from the gaps of the
same preset drawn at another seed (each reuse key's true distribution: tenant, app class and how
the turn before the gap ended, including how often a session never returns; not the individual
returns that the oracle is told).

    PYTHONPATH=src:benchmarks python benchmarks/informed_predictor.py --workload multiclass \
        --seed 0 -- --workload-set sessions=150 --device-kv-bytes 40GB --host-bytes 256GB \
        --disk-bytes 2TB --policies cost,oracle --no-plots --out out/informed

runs `kvtier simulate` with the given arguments plus the policy `informed` (`--policies` lists
the others to run beside it); with `--seeds 0-9` among them it runs `kvtier simulate seeds`
instead, whose pooled table is the preset's verdict. `--sample-sessions` sets how many sessions
the warm start draws (1,000). `--finished-only` leaves the sessions' ends out of the warm start
(the gaps of returns only), to see what knowing P(no return) is worth by itself. Results are in
docs/policy.md ("The amount priced over the stay").
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from kvtier.cli import main as kvtier_main
from kvtier.policy.cost_policy import CostPolicy
from kvtier.policy.key_codes import Key

if TYPE_CHECKING:
    from kvtier.policy.base import RetentionPolicy
    from kvtier.policy.config import PolicyConfig
    from kvtier.policy.cost_model import CostModel
    from kvtier.workload.model import Session, Turn

SAMPLE_SEED = 99  # the warm start's draw: never one of the seeds it is compared on
SAMPLE_SESSIONS = 1000


@dataclass
class InformedCost(CostPolicy):
    """`cost` whose predictor starts from `gaps` (per reuse key; inf: the session ended)."""

    name = "informed"
    gaps: ClassVar[dict[Key, list[float]]] = {}

    @classmethod
    def from_config(cls, config: PolicyConfig, model: CostModel) -> RetentionPolicy:
        policy = super().from_config(config, model)
        assert isinstance(policy, CostPolicy)
        for key, gaps in cls.gaps.items():
            policy.predictor.record_gaps(key, gaps)
        return policy


def preset_gaps(
    preset: str, finished_only: bool, sessions: int = SAMPLE_SESSIONS
) -> dict[Key, list[float]]:
    """Every gap of `sessions` sessions of `preset` at `SAMPLE_SEED`, per reuse key; each
    session's end counts as a gap past any cut-off unless `finished_only`."""
    from kvtier.workload.generator import generate
    from kvtier.workload.presets import preset_config

    config = preset_config(preset).model_copy(update={"sessions": sessions})
    gaps: dict[Key, list[float]] = defaultdict(list)
    for session in generate(config, seed=SAMPLE_SEED).sessions:
        turns = session.turns
        # each gap under the key the policy learns it by: how the turn before it ended
        for before, turn in itertools.pairwise(turns):
            if turn.think_s is not None:
                gaps[_key_after(session, before)].append(turn.think_s)
        if not finished_only and turns:
            gaps[_key_after(session, turns[-1])].append(math.inf)
    return dict(gaps)


def _key_after(session: Session, turn: Turn) -> Key:
    """`SessionView.key_after` of a generated turn."""
    return (session.tenant, session.app_class, turn.end, turn.tool)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", required=True, help="a generator preset")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-sessions", type=int, default=SAMPLE_SESSIONS)
    parser.add_argument("--finished-only", action="store_true")
    parser.add_argument("simulate", nargs=argparse.REMAINDER, help="-- kvtier simulate args")
    args = parser.parse_args()
    rest = [a for a in args.simulate if a != "--"]
    InformedCost.gaps = preset_gaps(args.workload, args.finished_only, args.sample_sessions)
    policies = "cost"
    if "--policies" in rest:
        at = rest.index("--policies")
        policies = rest.pop(at + 1)
        rest.pop(at)
    # the registry resolves the class by module name: that name is this module, whose
    # `InformedCost.gaps` were just set (run as a script it would otherwise import a fresh copy)
    sys.modules.setdefault("informed_predictor", sys.modules[__name__])
    informed = "informed_predictor:InformedCost"
    if "--seeds" in rest:  # every seed of the list, and their pooled verdict
        argv = ["simulate", "seeds", "--workload", args.workload]
    else:
        argv = ["simulate", "--workload", args.workload, "--seed", str(args.seed)]
    return kvtier_main([*argv, "--policies", f"{policies},{informed}", *rest])


if __name__ == "__main__":
    sys.exit(main())
