"""Regions of a replayed forward (:mod:`torchstash.engine.regions`): the module calls whose
saves read the op call run down the full path with the op tracker on, the rest of the forward
replays, and each replayed step has the full path's gradients, tally and sites."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

import torchstash
from torchstash.optrack import STATE
from torchstash.site import Site
from torchstash.testing.replay import Tracked, tally_rows
from torchstash.testing.replay import twins as replay_twins
from torchstash.testing.toys import HalfCompressor


class MatmulReader(HalfCompressor):
    """``test.half`` whose code of a matmul's operands reads the call (as attention's codes
    do): those saves need a region. It notes the site key of each code it makes."""

    name = "test.matmul_reader"
    #: set by a test: matmul operands are declined (kept as they are) from then on
    decline = False

    def __init__(self) -> None:
        self.keys: list[str] = []

    def replays_at(self, x: torch.Tensor, site: Site) -> bool:
        return site.op != "matmul"

    def compress(self, x: torch.Tensor, site: Site) -> torchstash.Packed | torch.Tensor:
        if site.op == "matmul" and MatmulReader.decline:
            return x
        self.keys.append(site.key)
        return super().compress(x, site)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return (q @ k.transpose(-1, -2) / 4).softmax(-1) @ v


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.act = nn.GELU()
        self.attn = Attention()
        self.mid = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh())
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.inp(x))
        return self.out(self.mid(h + self.attn(h)))


@pytest.fixture
def reader() -> Iterator[str]:
    reg = torchstash.REGISTRY
    reg.register(MatmulReader.name, MatmulReader, lossless=False, summary="test")
    MatmulReader.decline = False
    try:
        yield MatmulReader.name
    finally:
        reg.unregister(MatmulReader.name)
        MatmulReader.decline = False


@pytest.fixture
def tracked(monkeypatch: pytest.MonkeyPatch) -> Tracked:
    return Tracked(monkeypatch)


def grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def twins(
    strategy: str, build: type[nn.Module] = Net
) -> tuple[nn.Module, nn.Module, torchstash.Handle, torchstash.Handle]:
    """The full path on every step (``full``) and a model that replays (``ours``)."""
    return replay_twins(strategy, build, min_bytes=0)


def step_both(
    full: nn.Module,
    ours: nn.Module,
    a: torchstash.Handle,
    b: torchstash.Handle,
    x: torch.Tensor,
    tracked: Tracked,
) -> int:
    """One step of each; their gradients equal bit for bit. Returns the tracker's calls in
    ``ours``'s step."""
    a.tally.reset()
    b.tally.reset()
    want = grads(full, x)
    calls = tracked.during(lambda: grads(ours, x))
    got = [p.grad for p in ours.parameters() if p.grad is not None]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    return calls


def compressor(handle: torchstash.Handle) -> MatmulReader:
    found = handle.engine.resolve(Site(op="matmul", role="input"), frozenset())
    assert isinstance(found, MatmulReader)
    return found


def test_an_attention_module_is_a_region_and_the_rest_replays(
    reader: str, tracked: Tracked
) -> None:
    full, ours, a, b = twins(reader)
    x = torch.randn(4, 8, 16)
    calls = []
    for _ in range(6):
        ca, cb = compressor(a), compressor(b)
        ca.keys.clear()
        cb.keys.clear()
        calls.append(step_both(full, ours, a, b, x, tracked))
        assert tally_rows(b.tally) == tally_rows(a.tally)
        assert cb.keys == ca.keys  # the region's sites are named as the full path names them
        assert any(":matmul" in k for k in cb.keys)
    replayer = b.engine.replayer
    assert (replayer.recorded, replayer.replayed, replayer.missed) == (2, 4, 0)
    trace = replayer.trace
    assert trace is not None
    assert [r.owner() for r in trace.regions.values()] == [ours.attn]
    assert any(m.full for m in trace.moves) and not all(m.full for m in trace.moves)
    assert 0 < calls[-1] < calls[0]  # the tracker runs in the attention's call only


def test_a_decision_that_changes_in_a_region_misses_and_stays_exact(
    reader: str, tracked: Tracked
) -> None:
    full, ours, a, b = twins(reader)
    x = torch.randn(4, 8, 16)
    for _ in range(3):
        step_both(full, ours, a, b, x, tracked)
    replayer = b.engine.replayer
    assert replayer.replayed == 1
    MatmulReader.decline = True  # the region's codes are now kept as they are: a guard miss
    want = grads(full, x)
    got = grads(ours, x)  # the saves after the miss are kept as they are: closer than full's
    assert replayer.missed == 1
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0.2, atol=1e-3)
    for _ in range(3):  # recorded again, then replayed: the full path's tally again
        step_both(full, ours, a, b, x, tracked)
        assert tally_rows(b.tally) == tally_rows(a.tally)
    assert replayer.replayed == 2


def test_a_region_that_would_be_the_whole_forward_is_not_replayed(
    reader: str, tracked: Tracked
) -> None:
    """Attention written in the model's own forward: its region is the model's call."""
    torch.manual_seed(0)
    model = Attention()
    with torchstash.apply(model, reader, min_bytes=0) as handle:
        counts = [tracked.during(lambda: grads(model, torch.randn(4, 8, 32))) for _ in range(4)]
        assert all(c > 0 for c in counts)
        assert handle.engine.replayer.trace is None


def test_a_code_that_never_replays_is_not_left_to_regions(
    toy_strategies: list[str], tracked: Tracked
) -> None:
    """Every save reads the call (``test.half`` replays nothing): regions would be most of
    the forward, and cost more than the full path."""
    torch.manual_seed(0)
    model = Net()
    with torchstash.apply(model, "test.half", min_bytes=0) as handle:
        counts = [tracked.during(lambda: grads(model, torch.randn(4, 8, 16))) for _ in range(4)]
        assert all(c > 0 for c in counts)
        assert handle.engine.replayer.trace is None


class Twice(nn.Module):
    """One attention module called twice a step (shared weights): a region per call."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.attn = Attention()
        self.mid = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mid(torch.tanh(self.inp(x)))
        h = h + self.attn(h)
        return self.out(self.mid(h + self.attn(h)))


def test_a_module_called_twice_is_a_region_per_call(reader: str, tracked: Tracked) -> None:
    full, ours, a, b = twins(reader, Twice)
    x = torch.randn(4, 8, 16)
    for _ in range(5):
        step_both(full, ours, a, b, x, tracked)
        assert tally_rows(b.tally) == tally_rows(a.tally)
    trace = b.engine.replayer.trace
    assert trace is not None and b.engine.replayer.replayed == 3
    assert sorted(r.call for r in trace.regions.values()) == [0, 1]


def test_regions_under_autocast(reader: str, tracked: Tracked) -> None:
    """bfloat16 autocast on the CPU: the region's ops run under the autocast state they were
    recorded under, and a replayed step is the full path's."""
    full, ours, a, b = twins(reader)
    x = torch.randn(4, 8, 16)
    for _ in range(5):
        a.tally.reset()
        b.tally.reset()
        got = []
        for model in (full, ours):
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().square().sum()
            loss.backward()
            got.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        for g, w in zip(got[1], got[0], strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        assert tally_rows(b.tally) == tally_rows(a.tally)
    assert b.engine.replayer.replayed == 3 and b.engine.replayer.trace is not None


class Raises(Net):
    """Its attention raises on demand, inside the region's call."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.inp(x))
        a = self.attn(h)
        if self.fail:
            raise RuntimeError("out of memory (simulated)")
        return self.out(self.mid(h + a))


def test_a_forward_that_raises_in_a_region_leaves_the_engine_usable(
    reader: str, tracked: Tracked
) -> None:
    """An exception inside a replayed forward (after the region ran, as an out-of-memory
    would): the region's tracker and scratch tally are gone, the next steps are the full
    path's again."""
    full, ours, a, b = twins(reader, Raises)
    x = torch.randn(4, 8, 16)
    for _ in range(3):
        step_both(full, ours, a, b, x, tracked)
    assert b.engine.replayer.replayed == 1
    ours.fail = True
    with pytest.raises(RuntimeError, match="simulated"):
        ours(x)
    ours.fail = False
    tls = b.engine._tls
    assert tls.region is None and tls.scratch is None
    assert STATE.depth == 0 and STATE.engines == 0
    for _ in range(4):
        step_both(full, ours, a, b, x, tracked)
        assert tally_rows(b.tally) == tally_rows(a.tally)
    assert b.engine.replayer.trace is not None
