"""The sentence that ends `make demo`: the winner on resumed-turn TTFT p50, by how much, and
when the run is too small or too close to call."""

from __future__ import annotations

from kvtier.results.verdict import MIN_RESUMED, closing


def document(**p50_and_count: tuple[float | None, int]) -> dict:
    """A results document with only what the sentence reads: each policy's resumed turns."""
    runs = []
    for policy, (p50, count) in p50_and_count.items():
        resumed = {"count": count} | ({} if p50 is None else {"median_ms": p50})
        runs.append({"policy": policy, "summary": {"ttft_by_turn_kind": {"resumed": resumed}}})
    return {"runs": runs}


def test_the_winner_is_named_with_its_ratio_to_the_next_best_and_to_retain():
    sentence = closing(
        document(retain=(2000.0, 12), offload=(500.0, 12), cost=(400.0, 12), oracle=(100.0, 12))
    )
    assert sentence == (
        "On this run, cost restores resumed turns fastest: p50 resumed TTFT 400 ms, 0.80x "
        "offload's 500 ms (the next best) and 0.20x retain's 2,000 ms; oracle, which knows "
        "when each session returns, 100 ms."
    )


def test_the_oracle_is_a_bound_and_never_the_winner():
    sentence = closing(document(oracle=(10.0, 20), offload=(300.0, 20), retain=(900.0, 20)))
    assert sentence.startswith("On this run, offload restores resumed turns fastest")
    assert "0.33x retain's 900 ms (the next best); oracle" in sentence


def test_fewer_resumed_turns_than_a_call_needs_is_too_small_to_call():
    few = MIN_RESUMED - 1
    sentence = closing(document(retain=(2000.0, 40), cost=(400.0, few)))
    assert sentence.endswith(
        f"Too small to call: {few} resumed turns for a policy, and a call needs "
        f"{MIN_RESUMED} or more each (replay more sessions)."
    )
    assert "Too small" not in closing(document(retain=(2000.0, 40), cost=(400.0, MIN_RESUMED)))


def test_the_top_two_within_ten_percent_is_too_close_to_call():
    close = closing(document(offload=(460.0, 30), cost=(420.0, 30)))  # 0.91x
    assert close.endswith("Too close to call: cost is within 10% of offload, inside a run's noise.")
    clear = closing(document(offload=(470.0, 30), cost=(420.0, 30)))  # 0.89x
    assert "to call" not in clear and clear.endswith("0.89x offload's 470 ms (the next best).")


def test_without_two_policies_that_had_resumed_turns_there_is_nothing_to_compare():
    for doc in (document(offload=(300.0, 4)), document(offload=(300.0, 4), cost=(None, 0))):
        assert "nothing to compare" in closing(doc)


def test_the_sentence_names_the_run_it_is_about():
    """Under `simulate --beside`'s table of two runs it says which run it calls."""
    doc = document(retain=(2000.0, 12), cost=(400.0, 12))
    assert closing(doc, "the run measured here").startswith(
        "On the run measured here, cost restores resumed turns fastest"
    )
