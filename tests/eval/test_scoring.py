"""RULER string-match metrics on hand-made outputs."""

from __future__ import annotations

import pytest

from kvtier.eval.scoring import score, string_match_all, string_match_part


def test_all_counts_the_share_of_references_found():
    refs = ["1234567", "7654321", "1111111", "2222222"]
    assert string_match_all(" 1234567, 7654321, 1111111 and 2222222.", refs) == 1.0
    assert string_match_all(" 1234567 and 7654321", refs) == 0.5
    assert string_match_all(" I do not know.", refs) == 0.0


def test_matching_ignores_case_and_control_characters():
    assert string_match_all("\n\n- VDIUH\n- pieil", ["PIEIL", "VDIUH"]) == 1.0
    assert string_match_all("Universal\tKind", ["universal", "kind"]) == 1.0


def test_part_is_one_when_any_reference_is_found():
    assert string_match_part("the answer is 42", ["41", "42"]) == 1.0
    assert string_match_part("the answer is 43", ["41", "42"]) == 0.0


def test_truncated_numbers_do_not_count():
    assert score("all", " 7087.", ["7087435"]) == 0.0
    assert score("all", " 7087435.", ["7087435"]) == 1.0


def test_a_sample_needs_references():
    with pytest.raises(ValueError):
        score("all", "anything", [])
