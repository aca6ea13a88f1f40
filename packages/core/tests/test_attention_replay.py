"""A fused attention under replay (:mod:`torchstash.engine.attention`): its output and
log-sum-exp, recomputed from its coded ``q``, ``k``, ``v``, are rebuilt on replayed steps
behind the call's node, with no region and no op tracker; a call that changes is a guard
miss that leaves nothing of it coded."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

import torchstash
from torchstash.testing.replay import Tracked, tally_rows
from torchstash.testing.replay import twins as replay_twins
from torchstash.testing.steps import grads
from torchstash.testing.toys import DerivableHalf


class ReplayingHalf(DerivableHalf):
    """``test.derive_half`` that replays (its code reads nothing of the call)."""

    name = "test.replaying_half"
    replays = True


class Block(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.causal = True
        self.dense_values = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        if self.dense_values:  # saved after ``k`` and ``q``: a miss once those are coded
            v = v.contiguous()
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return x + self.proj(out.transpose(1, 2).reshape(b, n, c))


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), Block(), nn.Tanh(), Block(), nn.Linear(32, 4))


@pytest.fixture
def strategy() -> Iterator[str]:
    reg = torchstash.REGISTRY
    reg.register(ReplayingHalf.name, ReplayingHalf, lossless=False, summary="test")
    try:
        yield ReplayingHalf.name
    finally:
        reg.unregister(ReplayingHalf.name)


def twins(strategy: str) -> tuple[nn.Module, nn.Module, torchstash.Handle, torchstash.Handle]:
    return replay_twins(strategy, build, min_bytes=0)


def test_a_fused_attention_replays_as_the_full_path(
    strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tracked = Tracked(monkeypatch)
    full, ours, a, b = twins(strategy)
    x = torch.randn(2, 8, 16)
    try:
        for step in range(5):
            a.tally.reset()
            b.tally.reset()
            want = grads(full, x)
            calls = tracked.during(lambda: grads(ours, x))
            got = [p.grad for p in ours.parameters() if p.grad is not None]
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=0, atol=0)
            assert tally_rows(b.tally) == tally_rows(a.tally)
            assert (calls == 0) == (step >= 2), (step, calls)
        trace = b.engine.replayer.trace
        assert trace is not None and not trace.regions
        assert [m.attend.which for m in trace.moves if m.attend is not None] == [1, 0, 1, 0]
        assert sum(m.attends for m in trace.moves) == 6
    finally:
        a.remove()
        b.remove()


@pytest.mark.parametrize("change", ["causal", "layout"])
def test_a_call_that_changes_leaves_nothing_of_it_coded(strategy: str, change: str) -> None:
    """``is_causal`` flipped is seen on the output's node (after ``q``, ``k``, ``v`` were
    coded and the log-sum-exp rebuilt with the recorded arguments); ``v`` of another layout
    on its own save. Without turning what was made back into the tensors, the flipped call's
    gradients had a cosine of 0.73 to stock's under int8."""
    torch.manual_seed(0)
    stock = build()
    full, ours, a, b = twins(strategy)
    x = torch.randn(2, 8, 16)
    try:
        for _ in range(3):
            grads(full, x), grads(ours, x)
        replayer = b.engine.replayer
        assert (replayer.replayed, replayer.missed) == (1, 0)
        for model in (stock, ours):
            if change == "causal":
                model[1].causal = False
            else:
                model[1].dense_values = True
        b.tally.reset()
        got, exact = grads(ours, x), grads(stock, x)
        assert replayer.missed == 1
        row = b.tally.rows["1"]  # the first block's own saves: the attention's
        assert row.compressed == 0 and row.derived == 0, row
        assert row.stored_bytes == row.raw_bytes, row
        for g, e in zip(got, exact, strict=True):
            cosine = torch.nn.functional.cosine_similarity(g.flatten(), e.flatten(), dim=0)
            assert cosine > 0.999, float(cosine)
    finally:
        a.remove()
        b.remove()
