"""The order in which methods timed side by side in one process take their steps.

What ran just before a step moves its time on a CPU: a method's Python and its kernels' code
are cold after another method's step and warm after its own, as they are in training. In a
fixed order (stock, then each method, every round) the method that follows another torchstash
method finds much of its code warm: two copies of one strategy (``quant.int8``) on the small
CNN read 1.533x and 1.479x stock's step, and ``quant.int4`` after them 1.427x; shuffled each
round 1.557x, 1.511x and 1.528x. So each round here shuffles the methods (a seeded
generator) and runs each one for a block of steps in a row, the block's first step untimed:
every timed step follows a step of its own method, as in training (1.475x, 1.472x and
1.462x; on the zoo's GPT 1.521x, 1.524x and 1.520x, where the fixed order read 1.540x,
1.519x and 1.514x). The rounds still interleave the methods, so a machine that slows down
slows them all.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from typing import TypeVar

__all__ = ["BLOCK", "turns"]

T = TypeVar("T")

#: steps a method runs in a row: one untimed, then the timed ones
BLOCK = 3


def turns(
    items: Sequence[T], timed: int, *, block: int = BLOCK, seed: int = 0
) -> Iterator[tuple[T, bool]]:
    """``(item, timed)`` for each step: rounds in a shuffled order, each item ``block`` steps
    in a row, the first untimed, until each has ``timed`` timed steps or a few more."""
    if block < 2:
        raise ValueError(f"block must be at least 2 (one untimed step, then timed), got {block}")
    rng = random.Random(seed)
    for _ in range(math.ceil(timed / (block - 1))):
        order = list(items)
        rng.shuffle(order)
        for item in order:
            yield item, False
            for _ in range(block - 1):
                yield item, True
