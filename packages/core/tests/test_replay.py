"""Decide once, then replay (:mod:`torchstash.engine.replay`): what runs on a steady step, and
that every guard miss records again and stays exact."""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchstash
from torchstash.engine.replay import MAX_MISSES, MISSED_REASON
from torchstash.errors import CompressionError
from torchstash.testing.replay import Tracked, tally_rows

from ._helpers import LinearThen


class Skipper(nn.Module):
    """Runs its middle block only on even calls: the saves differ from step to step."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(16, 32), nn.GELU())
        self.b = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
        self.c = nn.Linear(32, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.a(x)
        if self.calls % 2 == 0:
            h = self.b(h)
        return self.c(h)


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )


def pair(build: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    stock = build()
    return stock, copy.deepcopy(stock)


def grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def same_as_stock(stock: nn.Module, ours: nn.Module, x: torch.Tensor) -> None:
    for a, b in zip(grads(stock, x), grads(ours, x), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.fixture
def tracked(monkeypatch: pytest.MonkeyPatch) -> Tracked:
    return Tracked(monkeypatch)


def test_a_steady_model_runs_without_the_op_tracker_after_two_recordings(
    tracked: Tracked,
) -> None:
    stock, model = pair(mlp)
    x = torch.randn(8, 16)
    with torchstash.apply(model, "none") as handle:
        counts = [tracked.during(lambda: grads(model, x)) for _ in range(5)]
        replayer = handle.engine.replayer
        assert counts[0] > 0 and counts[1] > 0
        assert counts[2:] == [0, 0, 0]
        assert (replayer.recorded, replayer.replayed, replayer.missed) == (2, 3, 0)
        same_as_stock(stock, model, x)


@pytest.mark.parametrize("batch", [8, 300])
def test_a_replayed_step_counts_what_a_recorded_one_counts(batch: int) -> None:
    """Every row's counts and bytes, with tensors under and over ``min_bytes``."""
    _, model = pair(mlp)
    x = torch.randn(batch, 16)
    with torchstash.apply(model, "none") as handle:
        seen = []
        for _ in range(4):
            handle.tally.reset()
            grads(model, x)
            seen.append((tally_rows(handle.tally), handle.tally.param_refs))
        assert handle.engine.replayer.replayed == 2
        assert seen[0] == seen[1] == seen[2] == seen[3]


def test_a_save_shared_by_two_ops_is_shared_when_replayed() -> None:
    stock, model = pair(lambda: LinearThen(64, lambda h: (h * h).sum(-1) + torch.sin(h).sum(-1)))
    x = torch.randn(16, 64)
    with torchstash.apply(model, "none") as handle:
        seen = []
        for _ in range(4):
            handle.tally.reset()
            grads(model, x)
            seen.append(tally_rows(handle.tally))
        assert handle.engine.replayer.replayed == 2
        assert seen[0] == seen[3]
        assert sum(r[1] for r in seen[3].values()) > 0  # h saved by mul twice and by sin
        same_as_stock(stock, model, x)


def test_a_new_shape_misses_records_again_and_stays_exact(tracked: Tracked) -> None:
    stock, model = pair(mlp)
    with torchstash.apply(model, "none") as handle:
        for _ in range(3):
            same_as_stock(stock, model, torch.randn(8, 16))
        replayer = handle.engine.replayer
        assert replayer.replayed >= 1
        handle.tally.reset()
        same_as_stock(stock, model, torch.randn(5, 16))  # replayed, misses at the first save
        assert replayer.missed == 1
        declined = sum(r.declined[MISSED_REASON] for r in handle.tally.rows.values())
        assert declined > 0
        assert tracked.during(lambda: grads(model, torch.randn(5, 16))) > 0  # records again
        for _ in range(3):
            same_as_stock(stock, model, torch.randn(5, 16))
        assert replayer.trace is not None


def test_a_model_that_skips_a_block_on_odd_steps_stays_exact() -> None:
    torch.manual_seed(0)
    stock = Skipper()
    model = copy.deepcopy(stock)
    x = torch.randn(8, 16)
    with torchstash.apply(model, "none") as handle:
        for _ in range(12):
            same_as_stock(stock, model, x)  # both step their call counters alike
        replayer = handle.engine.replayer
        assert replayer.missed <= MAX_MISSES
        assert replayer.replayed == 0  # two recordings in a row never agree


def test_train_and_eval_switches_and_no_grad() -> None:
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.BatchNorm1d(32), nn.Linear(32, 4))
    model = copy.deepcopy(stock)
    x = torch.randn(8, 16)
    with torchstash.apply(model, "none"):
        for i in range(8):
            mode = i % 3 != 2
            stock.train(mode)
            model.train(mode)
            torch.manual_seed(i)
            a = grads(stock, x)
            torch.manual_seed(i)
            b = grads(model, x)
            for u, v in zip(a, b, strict=True):
                torch.testing.assert_close(v, u, rtol=0, atol=0)
            with torch.no_grad():
                torch.manual_seed(i)
                want = stock(x)
                torch.manual_seed(i)
                torch.testing.assert_close(model(x), want, rtol=0, atol=0)


@contextlib.contextmanager
def replaying(
    model: nn.Module, x: torch.Tensor, *, hookless: bool = False
) -> Iterator[torchstash.Handle]:
    """``model`` under ``none`` after two recorded steps and one replayed on ``x``: its next
    step on ``x`` replays, behind every save's guard or (``hookless``) with no hook."""
    with torchstash.apply(model, "none") as handle:
        replayer = handle.engine.replayer
        replayer.may_go_hookless = hookless
        for _ in range(3):
            grads(model, x)
        assert replayer.replayed == 1
        yield handle


@pytest.mark.parametrize("hookless", [False, True])
def test_a_replayed_forward_that_raises_leaves_no_hook_behind(hookless: bool) -> None:
    class Fails(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16)
            self.fail = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.sin(self.fc(x))
            if self.fail:
                raise ValueError("boom")
            return h

    stock, model = pair(Fails)
    x = torch.randn(4, 16)
    with replaying(model, x, hookless=hookless) as handle:
        model.fail = True
        with pytest.raises(ValueError, match="boom"):
            model(x)
        assert not handle.engine.active
        # no saved-tensor hook of the engine's is left on: stock code outside saves as stock
        y = torch.randn(4, requires_grad=True)
        saved = torch.sin(y)
        assert saved.grad_fn._saved_self is y  # a hook would have handed back its own tensor
        model.fail = False
        same_as_stock(stock, model, x)
        assert handle.engine.replayer.replayed >= 2


@pytest.mark.parametrize("hookless", [False, True])
def test_an_in_place_change_after_a_replayed_save_is_an_error(hookless: bool) -> None:
    class Changes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16)
            self.change = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            y = torch.sin(h)
            if self.change:
                with torch.no_grad():
                    h.add_(1)
            return y

    _, model = pair(Changes)
    x = torch.randn(4, 16)
    with replaying(model, x, hookless=hookless):
        model.change = True
        with pytest.raises(RuntimeError, match="modified"):
            grads(model, x)


@pytest.mark.parametrize("hookless", [False, True])
def test_nested_stash_inside_a_replaying_model(hookless: bool) -> None:
    stock, model = pair(mlp)
    x = torch.randn(8, 16)
    with replaying(model, x, hookless=hookless):
        for _ in range(3):
            with torchstash.stash("none") as block:
                a = grads(stock, x)
                b = grads(model, x)
            for u, v in zip(a, b, strict=True):
                torch.testing.assert_close(v, u, rtol=0, atol=0)
        assert block.tally.raw_bytes > 0


def test_two_threads_replay_one_trace() -> None:
    stock, model = pair(mlp)
    xs = [torch.randn(8, 16) for _ in range(2)]
    want = [grads(stock, x) for x in xs]
    errors: list[BaseException] = []
    with torchstash.apply(model, "none") as handle:

        def run(i: int) -> None:
            try:
                for _ in range(20):
                    out = model(xs[i]).square().sum()
                    got = torch.autograd.grad(out, list(model.parameters()))
                    for u, v in zip(want[i], got, strict=True):
                        torch.testing.assert_close(v, u, rtol=1e-6, atol=1e-7)
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert handle.engine.replayer.replayed > 0


def test_apply_after_remove_records_afresh(tracked: Tracked) -> None:
    stock, model = pair(mlp)
    x = torch.randn(8, 16)
    for _ in range(2):
        with torchstash.apply(model, "none") as handle:
            counts = [tracked.during(lambda: grads(model, x)) for _ in range(3)]
            assert counts[0] > 0 and counts[2] == 0
            assert handle.engine.replayer.recorded == 2
        same_as_stock(stock, model, x)


def self_attention() -> nn.Module:
    """Written-out attention: which operand of which matmul a tensor is reads the call."""
    return LinearThen(16, lambda h: (h @ h.transpose(-1, -2)).softmax(-1) @ h)


def test_a_code_that_reads_the_op_call_records_every_step(tracked: Tracked) -> None:
    """Attention's codes read the call (which operand of which matmul): their module call is
    left to the full path (a region, :mod:`torchstash.engine.regions`); written in the
    model's own forward, that call is the whole forward, which is then not replayed."""
    pytest.importorskip("torchstash_quant")
    _, model = pair(self_attention)
    x = torch.randn(4, 64, 16)
    with torchstash.apply(model, "quant.int8") as handle:
        counts = [tracked.during(lambda: grads(model, x)) for _ in range(4)]
        assert all(c > 0 for c in counts)
        assert handle.engine.replayer.trace is None
        assert handle.engine.replayer.recorded == 2  # then no record is kept, to throw away
        assert handle.tally.stored_bytes < handle.tally.raw_bytes


def test_a_released_graph_after_a_replayed_forward() -> None:
    """The fault path (an unpack that fails releases its forward's entries) still finds the
    replayed entries: they belong to their forward's graph."""
    _, model = pair(mlp)
    x = torch.randn(8, 16)
    with replaying(model, x) as handle:
        loss = model(x).sum()
        graph = handle.engine._tls.graph
        assert graph is not None and len(graph.entries) > 0
        count, nbytes = graph.release()
        assert count > 0 and nbytes > 0
        with pytest.raises(CompressionError, match="released"):
            loss.backward()


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_stash_blocks_of_one_strategy_share_a_replayer() -> None:
    """A training loop opens a new ``stash`` block each step: the blocks of one strategy on
    one thread share their record, so from the third block on the forward is replayed, each
    block counting in its own tally what the first counted, the gradients stock's."""
    w = torch.randn(32, 32, requires_grad=True)
    x = torch.randn(16, 32)
    layer = nn.Linear(32, 32)

    def step() -> torch.Tensor:
        return layer(F.gelu(x @ w)).tanh().sum()

    want = torch.autograd.grad(step(), [w, layer.weight])
    seen = []
    for _ in range(4):
        block = torchstash.stash("none", min_bytes=64)
        with block:
            loss = step()
        got = torch.autograd.grad(loss, [w, layer.weight])
        for a, b in zip(want, got, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
        seen.append((tally_rows(block.tally), block.tally.param_refs))
    replayer = block.engine.replayer
    assert replayer.replayed == 2 and replayer.missed == 0
    assert seen[0] == seen[3] and seen[0][0]
    other = torchstash.stash("none", min_bytes=64)  # another line of code: its own record
    assert other.engine.replayer is not replayer


@pytest.mark.parametrize("strategy", ["quant.int8", "quant.auto"])
def test_stash_blocks_at_one_line_share_their_compressors(strategy: str) -> None:
    """The blocks a loop opens at one line share their plan: the codes' state goes on from
    step to step (``quant.auto`` measures, then allocates, as under ``apply``), and the codes
    replay (each block's own compressors had new identities: none ever replayed)."""
    pytest.importorskip("torchstash_quant")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.Tanh())
    x = torch.randn(64, 32)
    plans = []
    for _ in range(24):
        block = torchstash.stash(strategy)
        with block:
            loss = model(x).square().sum()
        loss.backward()
        plans.append(block.plan)
    assert all(p is plans[0] for p in plans)
    replayer = block.engine.replayer
    assert replayer.replayed > 0 and replayer.missed == 0
    assert torchstash.stash(strategy).plan is not plans[0]  # another line: its own


def test_two_regions_of_code_alternating_each_replay() -> None:
    """A GAN's generator and discriminator steps, each in a block of the same strategy: the
    blocks of each line keep their own record, so both replay instead of missing in turn."""
    a, b = nn.Linear(32, 32), nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1))
    x = torch.randn(16, 32)
    blocks = []
    for _ in range(4):
        first = torchstash.stash("none")
        with first:
            loss = a(x).tanh().sum()
        loss.backward()
        second = torchstash.stash("none")
        with second:
            loss = b(x).sum()
        loss.backward()
        blocks = [first, second]
    for block in blocks:
        replayer = block.engine.replayer
        assert (replayer.replayed, replayer.missed) == (2, 0)


def test_an_entry_keeps_every_field_of_its_site_but_the_call() -> None:
    """``without_call`` copies the fields one by one: a field added to ``Site`` is copied
    too, or this fails."""
    import dataclasses

    from torchstash.engine.entries import without_call
    from torchstash.site import NO_CALL, OpCall, Site

    values = {
        f.name: (f"v{i}" if isinstance(f.default, str) else i + 2)
        for i, f in enumerate(dataclasses.fields(Site))
        if f.name not in ("opcall", "training")
    }
    site = Site(**values, training=False, opcall=OpCall((1,)))
    bare = without_call(site)
    assert bare.opcall is NO_CALL
    for f in dataclasses.fields(Site):
        if f.name != "opcall":
            assert getattr(bare, f.name) == getattr(site, f.name), f.name


def test_a_buffer_replaced_between_steps_is_still_state() -> None:
    """A replayed parameter save is guarded by its storage; a buffer swapped for another
    tensor (``load_state_dict(assign=True)`` does this) is found among the model's buffers."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(64, 64)
            self.register_buffer("scale", torch.full((64,), 0.5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sin(self.fc(x) * self.scale)

    stock, model = pair(Scaled)
    x = torch.randn(16, 64)
    with torchstash.apply(model, "none") as handle:
        for _ in range(3):
            same_as_stock(stock, model, x)
        model.scale = torch.full((64,), 0.25)
        stock.scale = torch.full((64,), 0.25)
        handle.tally.reset()
        same_as_stock(stock, model, x)
        replayer = handle.engine.replayer
        assert (replayer.replayed, replayer.missed) == (2, 0)
        raw = handle.tally.raw_bytes
        with torch.no_grad():
            kept = (x, model.fc(x) * model.scale)  # the linear's input, the sine's
        assert raw == sum(t.untyped_storage().nbytes() for t in kept)
        assert handle.tally.param_refs == 1  # the buffer (the input needs no gradient)


def test_autocast_copies_of_a_frozen_weight_replay() -> None:
    """Under autocast a frozen Linear saves a bf16 copy of its weight, a new tensor each step
    with no graph: the recording kept it as a parameter's, and so does the replay."""
    stock, model = pair(mlp)
    for m in (stock, model):
        m[2].weight.requires_grad_(False)
    x = torch.randn(64, 16)

    def step(m: nn.Module) -> list[torch.Tensor]:
        m.zero_grad(set_to_none=True)
        with torch.autocast("cpu", torch.bfloat16):
            loss = m(x).float().square().sum()
        loss.backward()
        return [p.grad.clone() for p in m.parameters() if p.grad is not None]

    with torchstash.apply(model, "none") as handle:
        for _ in range(5):
            for a, b in zip(step(stock), step(model), strict=True):
                torch.testing.assert_close(b, a, rtol=0, atol=0)
        replayer = handle.engine.replayer
        assert (replayer.replayed, replayer.missed) == (3, 0)
