"""Restorer: how much of a turn's history a simulated replica reuses, which of its chunks are
loaded and which recomputed, and the loads, as the engine's `kvtier.cache.restore` does them.

- `valid_tokens`: the history's KV the new prompt still starts with (a history budget that
  dropped old turns cuts it where the prefix block ids part).
- `plan`: the restore planner (`policy.restore.plan_restore`) splits it into chunks to load
  and chunks to recompute.
- `commit`: the plan is taken (the session's KV is in use from there): the prefill segments
  and the load phases are laid out (`SimRequest`).
- `start_loads`: the loads run on each tier's read link, shared with every other transfer on
  it, a phase at a time; each phase opens its gate when its last chunk has arrived (and been
  decoded, for a chunk stored in a quantized form). One copy per chunk: a loaded chunk leaves
  its tier.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from kvtier.policy.cost_model import CostModel
from kvtier.policy.restore import plan_restore
from kvtier.policy.view import ChunkView
from kvtier.sim.chunks import Chunks
from kvtier.sim.deployment import Deployment
from kvtier.sim.events import EventLoop
from kvtier.sim.links import Links
from kvtier.sim.prefixes import SharedPrefixes
from kvtier.sim.requests import GATE_ALL, GATE_EARLY, GATE_NONE, SimRequest
from kvtier.sim.session import SimSession
from kvtier.workload.model import Request

# (chunks to recompute, chunks to load in issue order)
Plan = tuple[set[int], Sequence[int]]


class Restorer:
    def __init__(
        self,
        loop: EventLoop,
        deployment: Deployment,
        chunks: Chunks,
        links: Links,
        cost_model: CostModel,
        prefixes: SharedPrefixes,
        histories: Mapping[str, int],
        form_tokens: Counter[str],
        codec_s: Counter[str],
        on_loaded: Callable[[], None],
    ) -> None:
        self.loop = loop
        self.deployment = deployment
        self.chunks = chunks
        self.links = links
        self.cost_model = cost_model
        self.prefixes = prefixes
        self.histories = histories  # request id -> measured history tokens (a cap)
        self.form_tokens = form_tokens  # tokens restored from lower tiers, per form
        self.codec_s = codec_s  # seconds spent decoding (`decode`) and encoding stored forms
        self.on_loaded = on_loaded  # a phase arrived: the prefill may go on

    def valid_tokens(self, session: SimSession, request: Request) -> int:
        """How much of the session's KV the new prompt still starts with: all of it when the
        prompt extends the previous one, else the common prefix (a history budget dropped old
        turns), at most the measured history where one is given; cut at a whole block, or at
        a chunk's start if that chunk is not on the device. Never the last prompt token: a
        step must compute one."""
        if not session.tokens:
            return 0
        old, new = session.hash_ids, request.hash_ids
        whole = min(int(session.prompt_tokens // session.block_tokens), len(old))
        if old[:whole] == new[:whole]:
            valid = session.tokens
        else:
            low, high = 0, whole  # longest common prefix, by bisection on slices
            while low < high:
                middle = (low + high + 1) // 2
                low, high = (middle, high) if old[:middle] == new[:middle] else (low, middle - 1)
            valid = int(low * request.block_tokens)
        measured = self.histories.get(request.request_id)
        if measured is not None and measured < valid:
            valid = measured
        if valid < session.tokens:
            # The device's prefix cache reuses whole blocks; a lower tier holds whole chunks
            # (its key names all of a chunk's blocks), so a prefix ending in a stored chunk
            # stops at that chunk's start.
            chunk, block = self.deployment.chunk_tokens, self.deployment.block_size
            valid = valid // block * block
            index = valid // chunk
            if index < len(session.tiers) and session.tiers[index] != "device":
                valid = index * chunk
        return min(valid, request.prompt_tokens - 1)

    def plan(self, r: SimRequest) -> Plan:
        """(chunks to recompute, chunks to load in issue order): the restore planner's split
        when some chunk is in a lower tier; otherwise only missing chunks are recomputed,
        which is what the planner would say too."""
        tiers = r.session.tiers
        if all(tier is None or tier == "device" for tier in tiers):
            return {i for i, tier in enumerate(tiers) if tier is None}, ()
        chunks = [
            ChunkView(i, *r.session.chunk_range(i), tier, r.session.sizes[i], r.session.forms[i])
            for i, tier in enumerate(tiers)
        ]
        plan = plan_restore(chunks, self.cost_model)
        return set(plan.recompute), plan.loads

    def commit(self, r: SimRequest, plan: Plan) -> None:
        """Take the plan: the session's KV is in use from here (no policy moves it), and the
        prefill segments and load phases are laid out."""
        session = r.session
        session.active, session.idle_since = True, None
        session.changed()
        r.committed = True
        if self.deployment.shared_prefixes and not session.tokens:
            # looked up when the scheduler takes the request, as the engine's prefix cache
            # is: blocks other conversations computed while this one waited count
            r.valid = r.shared = session.tokens = self.prefixes.shared_tokens(r)
        count = len(session.tiers)
        recompute, loads = plan
        restored: Counter[str] = Counter()
        r.device_base = 0
        for i in range(count):
            start, end = session.chunk_range(i)
            tier = session.tiers[i]
            if i in recompute:
                restored["recomputed"] += end - start
                if tier is not None:  # stored, but recomputing it is faster: one copy only
                    self.chunks.drop(session, i)
            else:
                restored[tier] += end - start
                if tier == "device":
                    r.device_base += session.sizes[i]
                else:
                    self.form_tokens[session.forms[i]] += end - start
        if r.shared:
            restored["device"] += r.shared
        r.record.restored_tokens = dict(restored)
        last_recompute = max(recompute, default=-1)
        early = [i for i in loads if i < last_recompute]
        late = [i for i in loads if i > last_recompute]
        first_early = min(early, default=count)
        for i in sorted(recompute):
            start, end = session.chunk_range(i)
            gate = GATE_EARLY if first_early < i else GATE_NONE
            if r.segments and r.segments[-1][1] == start and r.segments[-1][2] == gate:
                r.segments[-1] = (r.segments[-1][0], end, gate)
            else:
                r.segments.append((start, end, gate))
        r.segments.append((r.valid, r.prompt, GATE_ALL))
        r.cursor = r.segments[0][0]
        for indices in (early, late):
            if indices:
                by_tier: dict[str, list[int]] = {}
                for i in indices:
                    by_tier.setdefault(session.tiers[i], []).append(i)
                r.phases.append((GATE_EARLY, by_tier))
        if r.phases:  # the last phase to arrive lets the new prompt in
            r.phases[-1] = (GATE_ALL, r.phases[-1][1])
        r.open_gate = GATE_NONE if early else GATE_EARLY if late else GATE_ALL
        r.load_bytes = sum(session.device_bytes(i) for i in loads)

    def start_loads(self, r: SimRequest) -> None:
        """Start the committed request's loads (its device memory for them is allocated)."""
        r.loads_started = True
        store = self.chunks.store
        for _, by_tier in r.phases:
            for indices in by_tier.values():
                for i in indices:  # the store reads each chunk for the device
                    store.promote(r.session.chunk(i).id)
        self._start_phase(r, 0)

    def _start_phase(self, r: SimRequest, phase: int) -> None:
        for tier, indices in r.phases[phase][1].items():
            link, session = self.links.paths[tier].read, r.session
            work = sum(session.sizes[i] for i in indices)
            work += len(indices) * link.latency_s * link.bandwidth
            # a quantized chunk is decoded as it arrives, on the restore's path: counted as
            # link time, the one pipeline a chunk's load and decode run through here
            decode = sum(
                self.cost_model.decode_s(session.device_bytes(i), session.forms[i]) for i in indices
            )
            if decode:
                self.codec_s["decode"] += decode
                work += decode * link.bandwidth
            self.links.in_flight += 1
            r.pending += 1
            self.links.read[tier].submit(work, self._loaded, r, phase)

    def _loaded(self, r: SimRequest, phase: int) -> None:
        self.links.in_flight -= 1
        r.pending -= 1
        if r.pending:
            return
        gate, by_tier = r.phases[phase]
        session, now = r.session, self.loop.now
        store = self.chunks.store
        for indices in by_tier.values():
            for i in indices:
                store.delete(session.chunk(i).id)
                session.tiers[i], session.access[i] = "device", now
                session.sizes[i] = session.full.pop(i, session.sizes[i])
        session.changed()
        r.open_gate = gate
        if phase + 1 < len(r.phases):
            self._start_phase(r, phase + 1)
        self.on_loaded()
