"""The order methods timed side by side take their steps in (``torchstash_bench.turns``)."""

from __future__ import annotations

import itertools

import pytest

from torchstash_bench.turns import turns


def test_each_timed_step_follows_a_step_of_its_own_method() -> None:
    steps = list(turns(["stock", "a", "b"], timed=7))
    for (before, _), (item, timed) in itertools.pairwise(steps):
        if timed:
            assert before == item
    assert not steps[0][1]  # a block opens untimed


def test_every_method_gets_its_timed_steps_and_the_rounds_are_shuffled() -> None:
    names = ["stock", "a", "b", "c"]
    steps = list(turns(names, timed=20, block=3))
    counts = {n: sum(1 for item, timed in steps if timed and item == n) for n in names}
    assert set(counts.values()) == {20}
    openers = [item for i, (item, timed) in enumerate(steps) if not timed and i % 12 == 0]
    assert len(set(openers)) > 1  # not the same method first every round
    assert steps == list(turns(names, timed=20, block=3))  # seeded: the same order again


def test_a_block_needs_an_untimed_step_and_a_timed_one() -> None:
    with pytest.raises(ValueError, match="block"):
        list(turns(["a"], timed=3, block=1))
