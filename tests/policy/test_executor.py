"""The action executor: how every Keep/Move/Drop is read, the same for engine and simulator."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.policy.actions import Action, Drop, Keep, Move
from kvtier.policy.executor import ActionExecutor

TIERS = ("host", "disk")  # lower tiers, fastest first


class RecordingTarget:
    """Chunks in a dict, each call recorded; `refuse` makes `move` refuse with that reason."""

    def __init__(self, sessions: dict[str, list[str | None]], refuse: str | None = None):
        self.sessions = sessions
        self.refuse = refuse
        self.calls: list[tuple] = []

    @property
    def tiers(self) -> Sequence[str]:
        return TIERS

    def chunks(self, session_id: str) -> Sequence[str | None] | None:
        return self.sessions.get(session_id)

    def move(self, session_id: str, index: int, tier: str, form: str) -> str | None:
        self.calls.append(("move", session_id, index, tier, form))
        if self.refuse is None:
            self.sessions[session_id][index] = tier
        return self.refuse

    def drop(self, session_id: str, index: int) -> None:
        self.calls.append(("drop", session_id, index))
        self.sessions[session_id][index] = None

    def flush(self) -> None:
        self.calls.append(("flush",))


def run(actions: list[Action], **sessions: list[str | None]):
    target = RecordingTarget(dict(sessions))
    executor = ActionExecutor(target)
    executor.run(actions)
    return executor, target.calls


def test_keep_is_counted_and_touches_nothing():
    executor, calls = run([Keep("s"), Keep("s", 0)], s=["device"])
    assert executor.decisions["keep"] == 2
    assert calls == [("flush",)]


def test_an_unknown_session_is_skipped_and_not_counted_as_a_decision():
    executor, calls = run([Move("ghost", 0, "host"), Drop("ghost")], s=["device"])
    assert executor.skipped["unknown_session"] == 2
    assert executor.decisions["move"] == executor.decisions["drop"] == 0
    assert calls == [("flush",)]


def test_a_whole_session_means_its_stored_chunks():
    executor, calls = run([Move("s", None, "disk")], s=["device", None, "host", None, "disk"])
    assert calls == [("move", "s", 0, "disk", "full"), ("move", "s", 2, "disk", "full"), ("flush",)]
    assert executor.decisions["move"] == 1  # one action, however many chunks
    assert not executor.skipped  # the chunks stored nowhere were never asked about

    _, calls = run([Drop("s")], s=[None, "device", "disk"])
    assert calls == [("drop", "s", 1), ("drop", "s", 2), ("flush",)]


def test_an_index_outside_the_session_is_skipped():
    executor, calls = run([Move("s", 2, "host"), Drop("s", -1)], s=["device", "device"])
    assert executor.skipped["bad_chunk"] == 2
    assert calls == [("flush",)]


def test_moves_only_go_down_to_a_tier_the_target_has():
    actions = [
        Move("s", 0, "host"),  # already there: nothing
        Move("s", 1, "host"),  # up from disk
        Move("s", 0, "device"),  # the device is above every tier
        Move("s", 0, "remote"),  # a tier this target lacks
        Move("s", 2, "disk"),  # stored nowhere
    ]
    executor, calls = run(actions, s=["host", "disk", None])
    assert calls == [("flush",)]
    assert executor.skipped == {"move_up": 1, "move_target": 2, "not_stored": 1}
    assert executor.decisions["move"] == 5


def test_a_move_down_carries_its_form():
    _, calls = run([Move("s", 0, "host", "int8"), Move("s", 1, "disk")], s=["device", "host"])
    assert calls[:2] == [("move", "s", 0, "host", "int8"), ("move", "s", 1, "disk", "full")]


def test_drop_of_a_chunk_stored_nowhere_is_nothing():
    executor, calls = run([Drop("s", 0)], s=[None])
    assert calls == [("flush",)]
    assert executor.decisions["drop"] == 1
    assert not executor.skipped


def test_a_refused_move_is_counted_under_the_targets_reason():
    target = RecordingTarget({"s": ["device"]}, refuse="in_use")
    executor = ActionExecutor(target)
    executor.run([Move("s", 0, "host")])
    assert executor.skipped["in_use"] == 1
    assert target.sessions["s"] == ["device"]


def test_actions_run_in_order_on_the_state_each_one_leaves():
    # dropped first, so the move finds the chunk stored nowhere; then a move down, and a
    # second one that now asks to go up
    actions = [Drop("a", 0), Move("a", 0, "host"), Move("b", 0, "disk"), Move("b", 0, "host")]
    executor, calls = run(actions, a=["device"], b=["device"])
    assert calls == [("drop", "a", 0), ("move", "b", 0, "disk", "full"), ("flush",)]
    assert executor.skipped == {"not_stored": 1, "move_up": 1}


def test_flush_comes_once_after_the_last_action():
    _, calls = run([Move("a", 0, "host"), Move("b", 0, "host")], a=["device"], b=["device"])
    assert [c[0] for c in calls] == ["move", "move", "flush"]


RANK = {"device": 0, "host": 1, "disk": 2}
tier_names = st.sampled_from(["device", "host", "disk", "remote", "tape"])
chunk_tiers = st.lists(st.sampled_from(["device", "host", "disk", None]), max_size=5)
index = st.one_of(st.none(), st.integers(-2, 6))
session_ids = st.sampled_from(["a", "b", "ghost"])
action = st.one_of(
    st.builds(Keep, session_ids, index),
    st.builds(Move, session_ids, index, tier_names),
    st.builds(Drop, session_ids, index),
)


@settings(max_examples=300, deadline=None)
@given(a=chunk_tiers, b=chunk_tiers, actions=st.lists(action, max_size=12))
def test_the_target_is_only_asked_for_valid_downward_moves_and_real_drops(a, b, actions):
    class Checking(RecordingTarget):
        def move(self, session_id, index, tier, form):
            tiers = self.sessions[session_id]
            assert 0 <= index < len(tiers)
            assert tiers[index] is not None and tier in TIERS
            assert RANK[tier] > RANK[tiers[index]]
            return super().move(session_id, index, tier, form)

        def drop(self, session_id, index):
            tiers = self.sessions[session_id]
            assert 0 <= index < len(tiers) and tiers[index] is not None
            super().drop(session_id, index)

    target = Checking({"a": list(a), "b": list(b)})
    executor = ActionExecutor(target)
    executor.run(actions)
    assert target.calls[-1] == ("flush",)
    assert sum(executor.decisions.values()) + executor.skipped["unknown_session"] == len(actions)
