"""The policy executor's target over a simulated replica (`kvtier.policy.executor`): one chunk
of a session moved down or dropped in the size-only store, as `kvtier.cache.chunk_actions` does
on the engine's real blocks and tiers.

- `move` of a chunk on the device: its bytes are stored in the target tier now (in the store
  index) and copied there when the decision's actions are all done (`flush`): one spill per
  tier, whose chunks land in the order they were moved; the device frees each chunk's bytes
  when it lands. A chunk with a write-through copy needs no transfer: the copy becomes the
  chunk, and the device frees its bytes at once.
- `move` of a chunk in a lower tier: the store demotes it, and the copy takes the target's
  write link.
- A moved chunk is stored at the less precise of its own form and the asked one, in that
  form's bytes, encoded on the mover's worker (`codec_s["encode"]`).
- As the engine's store would, with budgets the policy's obligation: a move that would not fit
  is dropped instead of overfilling a tier.
- `drop`: the chunk is freed everywhere (`Chunks.drop`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from kvtier.policy.cost_model import CostModel
from kvtier.policy.ledger import form_bytes
from kvtier.sim.chunks import Chunks
from kvtier.sim.pool import DevicePool
from kvtier.sim.session import SimSession
from kvtier.sim.spill import Spill, Spiller
from kvtier.tiers.payload import Payload
from kvtier.vocab import FULL, lossiest


class ReplicaChunks:
    """`ChunkTarget` for a simulated replica: sessions are the replica's (`sessions`)."""

    def __init__(
        self,
        sessions: Mapping[str, SimSession],
        chunks: Chunks,
        pool: DevicePool,
        spiller: Spiller,
        cost_model: CostModel,
        codec_s: Counter[str],
    ) -> None:
        self.sessions = sessions
        self._chunks = chunks  # where chunks are; `chunks()` is the executor's question
        self.pool = pool
        self.spiller = spiller
        self.cost_model = cost_model
        self.codec_s = codec_s  # seconds spent encoding (`encode`) and decoding stored forms
        # tier -> the chunks spilled there by the decision being run, in the order moved
        self.spills: dict[str, list[Spill]] = {}

    @property
    def tiers(self) -> Sequence[str]:
        store = self._chunks.store
        return list(store.tiers) if store is not None else []

    def chunks(self, session_id: str) -> Sequence[str | None] | None:
        session = self.sessions.get(session_id)
        return session.tiers if session is not None else None

    def move(self, session_id: str, index: int, tier: str, form: str) -> str | None:
        chunks, pool, store = self._chunks, self.pool, self._chunks.store
        session = self.sessions[session_id]
        size, source, chunk = session.sizes[index], session.tiers[index], session.chunk(index)
        target = store.tiers[tier]
        session.changed()
        if source == "device" and session.copied[index]:
            # the copy becomes the chunk: the device frees its bytes now, with no transfer
            chunks.forget_copy(session, index)
            session.tiers[index] = source = chunks.top_tier
            pool.used -= size
            pool.keep(session, index, size)
            pool.epoch += 1
            if tier == source:
                return None
        # precision only goes down (cache/forms.py): the chunk is stored at the lossier of
        # its own form and the asked one, in that form's bytes, encoded on the mover's worker
        form = lossiest(session.forms[index], form)
        stored = size
        if form != session.forms[index] or (source == "device" and form != FULL):
            full = session.device_bytes(index)
            stored = form_bytes(full, FULL, form)
            self.codec_s["encode"] += self.cost_model.encode_s(full, form)
        if tier == chunks.top_tier:
            chunks.reclaim(target, stored)
        if not target.fits(stored):
            chunks.drop(session, index)
        elif source == "device":
            if store.put(chunk, Payload.sized(stored), tier=tier):
                self._stored(session, index, tier, form, stored)
                pool.pending_free += size
                self.spills.setdefault(tier, []).append((stored, size, session, index))
            else:
                chunks.drop(session, index)
        elif stored == size:
            moved = store.demote(chunk.id, to=tier)
            session.tiers[index] = tier if moved else None
            if moved:
                self.spiller.write(tier, [size])
        else:  # re-encoded on the way down: the size-only store holds the new size
            store.delete(chunk.id)
            if store.put(chunk, Payload.sized(stored), tier=tier):
                self._stored(session, index, tier, form, stored)
                self.spiller.write(tier, [stored])
            else:
                chunks.drop(session, index)
        return None

    @staticmethod
    def _stored(session: SimSession, index: int, tier: str, form: str, stored: int) -> None:
        if stored != session.sizes[index]:
            session.full.setdefault(index, session.sizes[index])
        session.tiers[index], session.forms[index], session.sizes[index] = tier, form, stored

    def drop(self, session_id: str, index: int) -> None:
        self._chunks.drop(self.sessions[session_id], index)

    def flush(self) -> None:
        """Start the decision's spills: one transfer per tier."""
        for tier, spills in self.spills.items():
            self.spiller.spill(tier, spills)
        self.spills = {}
