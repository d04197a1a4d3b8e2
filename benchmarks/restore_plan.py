"""A resumed session behind a slow link: pure load vs pure recompute vs the restore plan.

    .venv/bin/python benchmarks/restore_plan.py \
        --out out/restore_plan.json [--tokens 1024] [--link-mb-s 8] [--repeats 3] [--threads 1]

On this CPU every real tier loads KV about 70x faster than the model recomputes it (see
docs/tiers.md), so the restore planner always says "load" and its bidirectional plan (Cake:
recompute the front while the back loads) never shows. This benchmark gives the engine a
link slow enough for the two to be comparable: the KV sits in host memory behind an emulated
link of `--link-mb-s` MB/s, one transfer at a time (each read sleeps bytes / bandwidth, which
releases the GIL, as a DMA would leave the CPU free). The cost model gets the same link and
prefill coefficients fitted to prefills measured here first.

Per repeat, side by side on one engine (the embedded SmolLM2, bf16): `recompute` (no tiers,
empty prefix cache), then with the session's KV moved to the slow tier, `restore="load"`
and `restore="plan"`. TTFT = first token time - arrival of the resumed turn (history + 16
new tokens). Medians of the repeats, with where the prompt tokens came from.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from pathlib import Path

from resume import ids, timed  # the sibling benchmark's helpers (run from benchmarks/)

from kvtier.cache import TiersConfig
from kvtier.cache.setup import attach_connector
from kvtier.engine import Engine, EngineConfig
from kvtier.engine.outputs import RequestOutput
from kvtier.policy.actions import Move
from kvtier.policy.config import PolicyConfig
from kvtier.policy.cost_model import CostProfile, TierLink
from kvtier.tiers import HostTier

MIB = 1 << 20


class SlowLinkHost(HostTier):
    """Host memory read through an emulated link: one transfer at a time, `bandwidth` B/s."""

    bandwidth = 8e6
    _link = threading.Lock()

    def _get(self, key, namespace, out):
        payload = super()._get(key, namespace, out)
        if payload is not None:
            with self._link:
                time.sleep(payload.nbytes / self.bandwidth)
        return payload


def measured_profile(engine: Engine, bandwidth: float) -> CostProfile:
    """Prefill coefficients fitted to prefills of a few lengths on this engine, and the
    emulated link."""
    attach_connector(engine, None)
    r = random.Random(7)
    samples = []
    for tokens in (128, 256, 512, 1024):
        engine.reset_prefix_cache()
        samples.append((tokens, 0, timed(engine, ids(r, tokens)).metrics.ttft_s))
    return CostProfile.from_measurements(samples, links={"host": TierLink(bandwidth)})


def resumed(
    engine: Engine, tokens: int, seed: int, restore: str, profile: CostProfile
) -> RequestOutput:
    engine.reset_prefix_cache()
    tiers = TiersConfig(host_bytes=256 * MIB, restore=restore, cost_profile=profile)
    connector = attach_connector(engine, tiers, "retain", PolicyConfig())
    host = connector.store.tiers["host"]
    r = random.Random(seed)
    session = f"bench-{seed}"
    history = ids(r, tokens)
    history += timed(engine, history, session).new_token_ids
    connector.runner.execute(Move(session, None, "host"))
    if not connector.flush(timeout=120):
        raise RuntimeError("moving the session to the host tier did not finish")
    host.__class__ = SlowLinkHost  # writes ran at memory speed; reads now cross the link
    out = timed(engine, history + ids(r, 16))
    plans = {k: v for k, v in connector.counters.items() if k.startswith("restore_plan_")}
    print(f"   {restore}: plans {plans}")
    attach_connector(engine, None)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--link-mb-s", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    SlowLinkHost.bandwidth = args.link_mb_s * 1e6
    engine = Engine(
        EngineConfig(
            kv_cache_bytes=256 * MIB,
            max_model_len=max(args.tokens, 1024) + 64,
            num_threads=args.threads,
        )
    )
    modes = ["recompute", "load", "plan"]
    results: dict[str, dict] = {m: {"ttft_s": [], "sources": None} for m in modes}
    try:
        profile = measured_profile(engine, SlowLinkHost.bandwidth)
        print(f"fitted prefill: {profile}")
        for repeat in range(args.repeats):
            for mode in modes:
                if mode == "recompute":
                    attach_connector(engine, None)
                    engine.reset_prefix_cache()
                    out = timed(engine, ids(random.Random(repeat), args.tokens + 17))
                else:
                    out = resumed(engine, args.tokens, 100 + repeat, mode, profile)
                where = {k: v for k, v in out.metrics.prompt_token_sources.items() if v}
                results[mode]["ttft_s"].append(out.metrics.ttft_s)
                results[mode]["sources"] = where
                ms = out.metrics.ttft_s * 1000
                print(f"repeat {repeat} {mode:9s} ttft {ms:8.1f} ms  {where}")
    finally:
        engine.close()
    best_pure = min(
        statistics.median(results["recompute"]["ttft_s"]),
        statistics.median(results["load"]["ttft_s"]),
    )
    print(
        f"\nresumed {args.tokens}-token session, KV behind a {args.link_mb_s:g} MB/s link, "
        f"SmolLM2 bf16, {args.threads} torch thread(s), medians of {args.repeats}\n"
    )
    print("| restore | TTFT per repeat (ms) | median (ms) | best pure / this | tokens by source |")
    print("|---|---|---:|---:|---|")
    for mode in modes:
        runs = results[mode]["ttft_s"]
        median = statistics.median(runs)
        results[mode]["median_ttft_ms"] = median * 1000
        per = " / ".join(f"{t * 1000:,.0f}" for t in runs)
        print(
            f"| {mode} | {per} | {median * 1000:,.0f} | {best_pure / median:.2f}x | "
            f"{results[mode]['sources']} |"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, **results}))


if __name__ == "__main__":
    main()
