"""`kvtier bench`'s stored-forms line, from the tiered connector's stats."""

from __future__ import annotations

from kvtier.bench.console import forms_line as _forms_line


def test_the_line_counts_blocks_restored_per_form_and_the_encodes():
    tiers = {
        "counters": {"restored_blocks": 100, "restored_blocks_int4": 81},
        "recodes": {"full->int4": {"ops": 27, "bytes_in": 1, "seconds": 1.584}},
    }
    assert _forms_line(tiers) == (
        "blocks restored from tiers: full 19 / int4 81; encoded: full->int4 27 chunks, "
        "1.58 s on the mover's worker"
    )


def test_no_line_when_everything_stayed_in_full_precision():
    assert _forms_line({"counters": {"restored_blocks": 40}, "recodes": {}}) is None
    assert _forms_line({}) is None
