"""Hookless replay (:mod:`torchstash.engine.hookless`): a steady forward whose trace only keeps
tensors runs with no saved-tensor hook, and every change its guards see counts exactly what the
full path counts, with stock's gradients."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import torchstash
from torchstash.engine import replay
from torchstash.engine.tally import Tally
from torchstash.testing.replay import tally_rows


class Blocks(nn.Module):
    """Three blocks; ``skip`` leaves the middle one out, ``cut`` slices the batch inside the
    forward (a data-dependent shape no module call shows), ``frozen`` freezes the last."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(16, 32), nn.GELU())
        self.b = nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.25), nn.Tanh())
        self.c = nn.Linear(32, 4)
        self.skip = False
        self.cut = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.cut:
            h = torch.sin(h[: self.cut]).sum(0, keepdim=True) + h
        if not self.skip:
            h = self.b(h)
        return self.c(h)


class Pair:
    """The model under test (hookless replay allowed) and a reference copy whose engine takes
    the full path on every forward: each step, both from the same weights and seed, must
    give the same gradients and count the same rows."""

    def __init__(self, build: Callable[[], nn.Module], strategy: str = "none") -> None:
        torch.manual_seed(0)
        self.stock = build()
        self.model = copy.deepcopy(self.stock)
        self.ref = copy.deepcopy(self.stock)
        self.handle = torchstash.apply(self.model, strategy)
        self.ref_handle = torchstash.apply(self.ref, strategy)
        self.ref_handle.engine.replayer.enabled = False  # the full path, every forward
        self.packs = 0
        engine = self.handle.engine
        real = engine.pack

        def pack(t: torch.Tensor) -> Any:
            self.packs += 1
            return real(t)

        engine.pack = pack  # type: ignore[method-assign]

    @property
    def replayer(self) -> replay.Replayer:
        return self.handle.engine.replayer

    def each(self, fn: Callable[[nn.Module], None]) -> None:
        for m in (self.stock, self.model, self.ref):
            fn(m)

    def step(
        self, x: torch.Tensor, seed: int = 0, autocast: bool = False, missed_inside: bool = False
    ) -> int:
        """One step on each model; returns the engine's pack calls (0: hookless).
        ``missed_inside``: the step leaves its trace part way through (see :func:`counted`)."""
        packs = self.packs
        results = []
        for m, h in ((self.stock, None), (self.model, self.handle), (self.ref, self.ref_handle)):
            if h is not None:
                h.tally.reset()
            m.zero_grad(set_to_none=True)
            torch.manual_seed(seed)
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                loss = m(x).float().square().sum()
            loss.backward()
            results.append([p.grad.clone() for p in m.parameters() if p.grad is not None])
        for got in results[1:]:
            assert len(got) == len(results[0])
            for a, b in zip(results[0], got, strict=True):
                torch.testing.assert_close(b, a, rtol=0, atol=0)
        got, want = counted(self.handle.tally), counted(self.ref_handle.tally)
        if missed_inside:
            assert {k: r[0] for k, r in got[0].items()} == {k: r[0] for k, r in want[0].items()}
            assert want[1] <= got[1] <= 2 * want[1]
        else:
            assert got == want
        return self.packs - packs

    def close(self) -> None:
        self.handle.remove()
        self.ref_handle.remove()


def counted(tally: Tally) -> tuple[Any, ...]:
    """What a step saved, by module: tensors, stock's bytes, the bytes kept (a forward that
    missed a guard names the reason and op of what it kept after the miss as such, and does
    not look for a second save of a tensor: those fields differ from the full path's).

    A forward that leaves its trace part way counts the saves after that point one by one.
    After a hookless stretch, a storage saved both before and after that point is counted
    twice (the engine knows those earlier saves by their trace, not by their tensors): its
    stock's bytes are never under the full path's, and at most twice them. After a guarded
    replay's miss they are exact (the replayed saves' storages are known)."""
    rows = {k: (r[0], r[2], r[3]) for k, r in tally_rows(tally).items()}
    return rows, tally.raw_bytes, tally.stored_bytes, tally.param_refs


@pytest.fixture
def blocks() -> Iterator[Pair]:
    pair = Pair(Blocks)
    yield pair
    pair.close()


def steady(pair: Pair, x: torch.Tensor) -> None:
    """Two recorded forwards and one replayed behind its guards: the next one is hookless."""
    packs = [pair.step(x, seed=i) for i in range(4)]
    assert all(p > 0 for p in packs[:3])
    assert packs[3] == 0
    assert pair.replayer.hookless == 1


def test_a_steady_model_saves_with_no_hook_and_counts_what_the_full_path_counts(
    blocks: Pair,
) -> None:
    x = torch.randn(8, 16)
    steady(blocks, x)
    for i in range(5):
        assert blocks.step(x, seed=10 + i) == 0
    assert (blocks.replayer.hookless, blocks.replayer.missed) == (6, 0)
    assert blocks.handle.tally.raw_bytes > 0


def test_a_hookless_forward_leaves_no_hook_and_stock_saves_the_tensors(blocks: Pair) -> None:
    x = torch.randn(8, 16)
    steady(blocks, x)
    out = blocks.model(x)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    node = out.grad_fn  # the last Linear's addmm: stock saved its input itself
    assert isinstance(node._saved_mat1, torch.Tensor)
    out.sum().backward()


def test_a_new_batch_shape_takes_the_guarded_replay(blocks: Pair) -> None:
    steady(blocks, torch.randn(8, 16))
    assert blocks.step(torch.randn(5, 16)) > 0  # the root's key differs: guarded, a miss
    assert blocks.replayer.missed == 1
    assert blocks.replayer.may_go_hookless  # a root that differs is no check that failed
    for i in range(4):
        blocks.step(torch.randn(5, 16), seed=i)
    assert blocks.step(torch.randn(5, 16)) == 0


@pytest.mark.parametrize("at", [1, 2, 4])
def test_a_block_skipped_mid_forward_is_a_guard_miss_counted_exactly(blocks: Pair, at: int) -> None:
    """The middle block is left out (its call does not come where the trace has it), then
    comes back: the saves before the miss count as recorded, the rest one by one."""
    x = torch.randn(8, 16)
    steady(blocks, x)
    for _ in range(at):
        assert blocks.step(x) == 0
    blocks.each(lambda m: setattr(m, "skip", True))
    # the miss puts the hooks on for the rest of the forward
    assert blocks.step(x, missed_inside=True) > 0
    assert blocks.replayer.missed == 1
    for i in range(4):
        blocks.step(x, seed=i)
    assert blocks.step(x) == 0  # steady again, skipping
    blocks.each(lambda m: setattr(m, "skip", False))
    blocks.step(x, missed_inside=True)
    assert blocks.replayer.missed == 2


def test_a_submodule_switched_to_eval_is_a_guard_miss(blocks: Pair) -> None:
    x = torch.randn(8, 16)
    steady(blocks, x)
    blocks.each(lambda m: m.b.eval())
    blocks.step(x, missed_inside=True)  # Dropout in eval saves no mask
    assert blocks.replayer.missed == 1
    blocks.each(lambda m: m.train())
    for i in range(5):
        blocks.step(x, seed=i)


def test_a_frozen_layer_is_seen_before_the_forward(blocks: Pair) -> None:
    x = torch.randn(8, 16)
    steady(blocks, x)
    blocks.each(lambda m: m.c.requires_grad_(False))
    # which parameters train is part of the root's key: the guarded replay, which misses
    # at the frozen layer (its input, the Tanh's saved output, counted once: exact)
    assert blocks.step(x) > 0
    for i in range(5):
        blocks.step(x, seed=i)
    blocks.each(lambda m: m.c.requires_grad_(True))
    assert blocks.step(x) > 0


def test_autocast_is_seen_before_the_forward(blocks: Pair) -> None:
    x = torch.randn(8, 16)
    steady(blocks, x)
    assert blocks.step(x, autocast=True) > 0
    for i in range(5):
        blocks.step(x, seed=i, autocast=True)
    assert blocks.step(x, autocast=True) == 0
    assert blocks.step(x) > 0


def test_eval_and_no_grad_forwards_between_hookless_ones(blocks: Pair) -> None:
    """A validation pass (eval, no_grad) leaves the engine out; one in eval mode with grad
    on is another forward: the root's training flag differs, the guarded replay misses."""
    x = torch.randn(8, 16)
    steady(blocks, x)
    for m in (blocks.model, blocks.stock):
        with torch.no_grad():
            m.eval()
            m(x)
            m.train()
            m(x)
    assert blocks.step(x) == 0
    blocks.each(lambda m: m.eval())
    assert blocks.step(x) > 0
    assert blocks.replayer.missed == 1
    blocks.each(lambda m: m.train())
    for i in range(4):
        blocks.step(x, seed=i)
    assert blocks.step(x) == 0


def test_a_change_no_guard_sees_is_found_by_the_check_and_ends_hookless(
    blocks: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slice inside the forward changes what is saved while every module call looks the
    same: between two checks the tally counts the recording's saves (the gradients are
    stock's regardless); the check that misses ends hookless forwards for this model."""
    monkeypatch.setattr(replay, "CHECK_EVERY", 4)
    x = torch.randn(8, 16)
    steady(blocks, x)  # the first of four
    assert blocks.step(x) == 0
    model, handle = blocks.model, blocks.handle
    blocks.each(lambda m: setattr(m, "cut", 3))
    handle.tally.reset()
    loss = model(x).square().sum()  # hookless: counted as recorded, not as run
    loss.backward()
    assert blocks.replayer.hookless == 3
    stale = handle.tally.raw_bytes
    for m in (blocks.stock, blocks.ref):
        m(x).square().sum().backward()  # their step counters as the model's
    blocks.step(x)  # the fourth: the check, guarded, misses
    assert not blocks.replayer.may_go_hookless
    assert handle.tally.raw_bytes != stale
    for i in range(6):
        assert blocks.step(x, seed=i) > 0
    assert blocks.replayer.hookless == 3


def test_the_environment_keeps_the_hooks_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHSTASH_HOOKLESS", "off")
    pair = Pair(Blocks)
    try:
        x = torch.randn(8, 16)
        for i in range(6):
            assert pair.step(x, seed=i) > 0
        assert (pair.replayer.replayed, pair.replayer.hookless) == (4, 0)
    finally:
        pair.close()


def test_hooks_already_on_keep_the_engine_on_every_save(blocks: Pair) -> None:
    """A forward run under someone else's saved-tensor hooks: with none of ours, those would
    take the saves; the engine's go on, innermost, and the outer hooks see none."""
    x = torch.randn(8, 16)
    steady(blocks, x)
    seen = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(t)
        return t

    packs = blocks.packs
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        blocks.model(x).sum().backward()
    assert blocks.packs > packs
    assert not seen
    assert blocks.step(x) == 0


@pytest.mark.parametrize("strategy", ["memsave", "quant.int8", "dropit.mink"])
def test_a_plugin_strategy_whose_trace_keeps_everything_goes_hookless(strategy: str) -> None:
    """Every tensor of this model is under ``min_bytes``: whatever the strategy codes,
    here it keeps them all, and the steady forwards have no hook."""
    name = strategy.split(".")[0]
    pytest.importorskip(f"torchstash_{name}")
    pair = Pair(Blocks, strategy)
    try:
        x = torch.randn(2, 16)
        for i in range(3):
            pair.step(x, seed=i)
        assert pair.step(x) == 0
    finally:
        pair.close()


def test_a_trace_with_a_code_keeps_its_hooks() -> None:
    pytest.importorskip("torchstash_quant")
    torch.manual_seed(0)
    model = Blocks()
    x = torch.randn(64, 16)
    with torchstash.apply(model, "quant.int8") as handle:
        for _ in range(6):
            model(x).square().sum().backward()
        replayer = handle.engine.replayer
        assert replayer.trace is not None and not replayer.trace.lean
        assert (replayer.replayed, replayer.hookless) == (4, 0)
        assert handle.tally.stored_bytes < handle.tally.raw_bytes


class ConvNet(nn.Module):
    """Conv-BN-ReLU twice, then a mean: under memsave the last ReLU's mask is a code no later
    save stands in for (a mean saves nothing), so its module call keeps the hooks on."""

    def __init__(self) -> None:
        super().__init__()
        self.one = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.two = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, 4)
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.one(x)
        if not self.skip:
            h = self.two(h)
        return self.head(h.mean((2, 3)))


@pytest.fixture
def convnet() -> Iterator[Pair]:
    pytest.importorskip("torchstash_memsave")
    pair = Pair(ConvNet, "memsave")
    yield pair
    pair.close()


def test_a_module_call_holding_a_code_keeps_its_hooks_and_the_rest_goes_without(
    convnet: Pair,
) -> None:
    x = torch.randn(2, 3, 8, 8)
    for i in range(3):
        convnet.step(x, seed=i)
    trace = convnet.replayer.trace
    assert trace is not None and trace.lean and len(trace.islands) == 1
    ((start, end, _),) = trace.islands.values()
    assert [m.kind for m in trace.moves[start:end]] == ["code"]
    for i in range(4):
        assert convnet.step(x, seed=i) == 1  # the ReLU's save alone, behind its guard
    assert (convnet.replayer.hookless, convnet.replayer.missed) == (4, 0)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_a_save_that_misses_inside_a_hooked_call_counts_the_rest_one_by_one(
    convnet: Pair,
) -> None:
    """A channels-last batch (the same shapes, other strides) reaches the ReLU's code in
    another layout: its guard misses inside the call."""
    x = torch.randn(2, 3, 8, 8)
    for i in range(4):
        convnet.step(x, seed=i)
    assert convnet.replayer.hookless == 1
    y = x.contiguous(memory_format=torch.channels_last)
    convnet.handle.tally.reset()
    convnet.ref_handle.tally.reset()
    grads = []
    for m in (convnet.stock, convnet.model, convnet.ref):
        m.zero_grad(set_to_none=True)
        m(y).float().square().sum().backward()
        grads.append([p.grad.clone() for p in m.parameters() if p.grad is not None])
    for got in grads[1:]:
        for a, b in zip(grads[0], got, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert convnet.replayer.missed == 1
    got, want = counted(convnet.handle.tally), counted(convnet.ref_handle.tally)
    assert {k: r[0] for k, r in got[0].items()} == {k: r[0] for k, r in want[0].items()}
    assert want[1] <= got[1] <= 2 * want[1]
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    for i in range(4):
        convnet.step(x, seed=i)
    assert convnet.step(x) == 1


def test_a_hooked_call_skipped_is_a_guard_miss(convnet: Pair) -> None:
    x = torch.randn(2, 3, 8, 8)
    for i in range(4):
        convnet.step(x, seed=i)
    convnet.each(lambda m: setattr(m, "skip", True))
    convnet.step(x, missed_inside=True)
    assert convnet.replayer.missed == 1
    for i in range(4):
        convnet.step(x, seed=i)
    convnet.each(lambda m: setattr(m, "skip", False))
    convnet.step(x, missed_inside=True)
    for i in range(4):
        convnet.step(x, seed=i)
    assert convnet.step(x) == 1


class Checkpointed(Blocks):
    """The middle block under non-reentrant checkpointing (its saves are the checkpoint's
    hook's; its recomputation in backward is left to it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = torch.utils.checkpoint.checkpoint(self.b, h, use_reentrant=False)
        return self.c(h)


def test_a_checkpointed_block_inside_a_hookless_forward() -> None:
    pair = Pair(Checkpointed)
    try:
        x = torch.randn(8, 16)
        for i in range(3):
            pair.step(x, seed=i)
        for i in range(3):
            assert pair.step(x, seed=10 + i) == 0
        assert pair.replayer.hookless == 3
    finally:
        pair.close()
