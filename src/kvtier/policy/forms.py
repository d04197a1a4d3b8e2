"""Which form a chunk moved to disk or remote is stored in: the allowed form that restores
fastest.

A form is allowed when the accuracy budget admits it (`accuracy.form_budget`). For a chunk of
F full-precision bytes going to tier T, form f restores in

    L_T(bytes_f(F)) + decode_f(F)

(`cost_model.load_s` over the form's bytes, plus its decode), and the chooser takes the form
with the smallest. On a slow link (NVMe, a network store) the fewer bytes win once decoding
is faster than the link; on a fast one (host DRAM over PCIe, the page cache) the decode costs
more than the bytes save. Smaller forms also hold and move fewer bytes, which only adds to
their case; encoding runs on the mover's worker and costs no latency. Ties go to the more
precise form. Precision only goes down: a chunk is never stored more precisely than it is
(cache/forms.py), so a chunk already at int4 stays int4.

Only disk and remote take lossy forms: the host tier is the fast path restores come from
most, and its link outruns any CPU decoder (docs/cost-model.md, "Stored forms as a decision").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.policy.cost_model import CostModel
from kvtier.policy.ledger import form_bytes
from kvtier.policy.view import ChunkView
from kvtier.vocab import DEVICE, DISK, FORM_PRECISION, FULL, REMOTE

LOSSY_TIERS = (DISK, REMOTE)


@dataclass(frozen=True)
class FormChooser:
    model: CostModel
    allowed: tuple[str, ...] = (FULL,)  # forms within the accuracy budget

    def choose(self, chunk: ChunkView, tier: str) -> str:
        """The form a move of `chunk` to `tier` stores it in."""
        if tier not in LOSSY_TIERS or self.allowed == (FULL,):
            return chunk.form
        precision = FORM_PRECISION[chunk.form]
        candidates = {chunk.form, *(f for f in self.allowed if FORM_PRECISION[f] <= precision)}
        full = full_bytes(chunk)
        return min(
            candidates,
            key=lambda form: (self.restore_s(full, form, tier), -FORM_PRECISION[form]),
        )

    def choose_many(self, chunks: Sequence[ChunkView], tiers: Sequence[str]) -> list[str]:
        """`choose` of each chunk and its tier (a decision moves hundreds of chunks)."""
        if self.allowed == (FULL,):
            return [chunk.form for chunk in chunks]
        return list(map(self.choose, chunks, tiers))

    def restore_s(self, full: int, form: str, tier: str) -> float:
        """Loading a chunk of `full` full-precision bytes stored in `form` from `tier`, then
        decoding it."""
        return self.model.load_s(form_bytes(full, FULL, form), tier) + self.model.decode_s(
            full, form
        )


def chunk_restore_s(model: CostModel, chunk: ChunkView) -> float:
    """Bringing a chunk to the device: its load, plus its decode when it is stored quantized
    (a device chunk is already decoded; one stored nowhere is the caller's to recompute)."""
    if chunk.tier is None or chunk.tier == DEVICE:
        return 0.0
    return model.load_s(chunk.size_bytes, chunk.tier) + model.decode_s(
        full_bytes(chunk), chunk.form
    )


def full_bytes(chunk: ChunkView) -> int:
    """The chunk's full-precision size: on the device it is held decoded (whatever its form)."""
    if chunk.tier == DEVICE or chunk.form == FULL:
        return chunk.size_bytes
    return form_bytes(chunk.size_bytes, chunk.form, FULL)
