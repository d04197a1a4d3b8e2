"""The cyclic collector is off while a workload is built, and as it was after."""

from __future__ import annotations

import gc

import pytest

from kvtier.sim.quiet_gc import without_cyclic_gc


@pytest.fixture
def collector_on():
    was_on = gc.isenabled()
    gc.enable()
    yield
    if not was_on:
        gc.disable()


def test_the_collector_is_off_inside_and_on_again_after_even_on_an_error(collector_on):
    with without_cyclic_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), without_cyclic_gc():
        raise ValueError("a workload that fails to load")
    assert gc.isenabled()


def test_a_collector_already_off_stays_off(collector_on):
    gc.disable()
    with without_cyclic_gc():
        pass
    assert not gc.isenabled()
