"""A dynamic graph's byte counts evaluated at a call's sizes (:mod:`torchstash.graphcount`)."""

from __future__ import annotations

import sympy
import torch

from torchstash.compiling import arguments
from torchstash.engine.totals import Totals
from torchstash.graphcount import Bytes, at, resolved, symbolic


def _bytes() -> Bytes:
    s = sympy.Symbol("s0", positive=True, integer=True)
    return Bytes(8 * s + 4, ((s, (("idx",), 1)),), {s: 12})


def test_a_count_is_read_at_the_call_s_sizes() -> None:
    b = _bytes()
    assert b.at({"idx": torch.zeros(2, 5)}) == 44
    assert b.resolved({"idx": torch.zeros(2, 5)})


def test_a_size_not_among_the_arguments_is_taken_as_traced() -> None:
    b = _bytes()
    for args in ({}, {"idx": 3}, {"idx": torch.zeros(4)}):
        assert b.at(args) == 100
        assert not b.resolved(args)


def test_totals_mix_numbers_and_expressions() -> None:
    t = [Totals("m", "Linear", (1, 0, _bytes(), 7), {"linear": 1}, {})]
    assert symbolic(t)
    got = at(t, {"idx": torch.zeros(1, 2)})
    assert got[0].counts == (1, 0, 20, 7) and not symbolic(got)
    assert resolved(t, {"idx": torch.zeros(1, 2)}) and not resolved(t, {})
    assert Bytes.of(5) == 5 and Bytes.of(torch.tensor(3).item()) == 3


def test_arguments_bind_to_forward() -> None:
    class M(torch.nn.Module):
        def forward(self, idx: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
            return idx

    x = torch.zeros(2)
    assert arguments(M(), (x,), {}) == {"idx": x}
    assert arguments(M(), (x, x, x), {}) == {}  # does not bind
