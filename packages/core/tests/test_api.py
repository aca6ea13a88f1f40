"""apply/remove/stash/measure: in place, exactly undone, clear errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchstash as ts
from torchstash.errors import ApplyError, NothingToRewriteWarning
from torchstash.testing.hooks import hook_counts
from torchstash.testing.models import zoo

ENTRIES = {e.name: e for e in zoo("tiny")}


def test_apply_in_place_and_remove_restores_exactly(toy_strategies: list[str]) -> None:
    model = ENTRIES["resnet"].build()
    keys = list(model.state_dict())
    before = hook_counts(model)
    params = [id(p) for p in model.parameters()]
    h = ts.apply(model, "test.clone")
    assert hook_counts(model) != before  # each module is told of: the check below can fail
    assert list(model.state_dict()) == keys
    assert [id(p) for p in model.parameters()] == params  # no copy
    assert ts.handle_of(model) is h
    ts.remove(model)
    assert h.removed and ts.handle_of(model) is None
    assert hook_counts(model) == before
    with pytest.raises(ApplyError, match="not applied"):
        ts.remove(model)


def test_apply_twice_is_an_error() -> None:
    model = ENTRIES["gpt"].build()
    with ts.apply(model.blocks[0], "none"), pytest.raises(ApplyError, match="submodule 'blocks.0'"):
        ts.apply(model, "none")


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((), {}, "give a strategy name"),
        (("none",), {"policy": [{"strategy": "none"}]}, "not both"),
        ((), {"policy": [{"strategy": "none"}], "bits": 2}, "inside the policy"),
        ((3,), {}, "must be a name"),
    ],
)
def test_apply_argument_errors(args: tuple[Any, ...], kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ApplyError, match=message):
        ts.apply(nn.Linear(2, 2), *args, **kwargs)


def test_apply_needs_a_module() -> None:
    with pytest.raises(ApplyError, match="nn.Module"):
        ts.apply(lambda x: x, "none")  # type: ignore[arg-type]


def test_stash_reaches_functional_code(toy_strategies: list[str]) -> None:
    w = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(64, 256)

    def f() -> torch.Tensor:
        h = F.gelu(x @ w)
        return (h @ h.t()).softmax(-1).sum()

    f().backward()
    ref = w.grad.clone()
    w.grad = None
    with ts.stash("test.clone") as s:
        loss = f()
    loss.backward()
    assert torch.equal(ref, w.grad)
    ops = {op for r in s.tally.rows.values() for op in r.ops}
    assert {"matmul", "gelu", "softmax"} <= ops
    # Stock holds x, gelu's input, h (saved as h and as its view h.t(): one storage) and the
    # softmax output; test.clone copies h and h.t() apart, two layouts of one storage.
    h_bytes = 64 * 256 * 4
    assert s.tally.raw_bytes == 3 * h_bytes + 64 * 64 * 4
    assert s.tally.stored_bytes == s.tally.raw_bytes + h_bytes


def test_stash_sees_module_types(toy_strategies: list[str]) -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    x = torch.randn(32, 64)
    with ts.stash(policy=[{"strategy": "test.clone"}, {"type": "gelu", "strategy": "none"}]) as s:
        loss = model(x).sum()
    loss.backward()
    rows = s.tally.rows
    assert rows["<GELU>"].saved == 1 and rows["<GELU>"].compressed == 0
    assert rows["<Linear>"].compressed == 2
    assert not nn.modules.module._global_forward_hooks  # hooks gone after the block


class SelfStashing(nn.BatchNorm1d):
    """A layer that runs its own forward in a stash block bound to it."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.block = ts.stash("test.clone", module=self, min_bytes=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert not self.block.active
        with self.block:
            assert self.block.active
            return super().forward(x)


def test_stash_bound_to_a_module_names_its_saves_and_skips_its_state(
    toy_strategies: list[str],
) -> None:
    """``stash(..., module=m)`` entered inside ``m``'s forward: the saves are ``m``'s row, and
    its Parameters and buffers (a BatchNorm's running statistics) are kept as they are."""
    layer = SelfStashing(64)
    x = torch.randn(32, 64, requires_grad=True)
    ref_layer = nn.BatchNorm1d(64)
    ref_layer(x * 1.0).square().sum().backward()
    layer(x * 1.0).square().sum().backward()
    assert torch.equal(ref_layer.weight.grad, layer.weight.grad)
    rows = layer.block.tally.rows
    assert list(rows) == ["<SelfStashing>"] and rows["<SelfStashing>"].compressed >= 1
    assert layer.block.tally.param_refs >= 1  # the weight: referenced, not copied
    assert not layer.block.active


def test_stash_applies_only_inside_the_block(toy_strategies: list[str]) -> None:
    x = torch.randn(512, requires_grad=True)
    with ts.stash("test.half") as s:
        a = x.exp()
    b = x.exp()
    (a + b).sum().backward()
    assert sum(r.saved for r in s.tally.rows.values()) == 1


class Doubler(nn.Module):
    def __init__(self, inner: nn.ReLU) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class FakeRewriter:
    name = "test.rewrite"

    def rewrite(self, module: nn.Module) -> nn.Module | None:
        return Doubler(module) if isinstance(module, nn.ReLU) else None


def registered(factory: Any) -> Iterator[str]:
    """A fixture's body: ``factory`` registered under its ``name`` for the test."""
    ts.REGISTRY.register(factory.name, factory, lossless=True, summary="")
    yield factory.name
    ts.REGISTRY.unregister(factory.name)


@pytest.fixture
def rewrite_strategy() -> Iterator[str]:
    yield from registered(FakeRewriter)


def test_rewrites_swap_modules_and_remove_puts_them_back(rewrite_strategy: str) -> None:
    model = ENTRIES["resnet"].build()
    originals = {n: m for n, m in model.named_modules() if isinstance(m, nn.ReLU)}
    keys = list(model.state_dict())
    h = ts.apply(model, rewrite_strategy)
    assert len(h.rewrites) == len(originals) > 0
    assert all(isinstance(model.get_submodule(n), Doubler) for n in originals)
    assert list(model.state_dict()) == keys
    x, y = ENTRIES["resnet"].batch(2, torch.device("cpu"))
    ENTRIES["resnet"].loss(model, x, y).backward()
    h.remove()
    assert all(model.get_submodule(n) is m for n, m in originals.items())


class CountingReLU(nn.ReLU):
    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CountingReLU.calls += 1
        return super().forward(x)


class InPlaceRewriter:
    """Swaps a ReLU's class in place, as memsave does."""

    name = "test.swap"

    def rewrite(self, module: nn.Module) -> ts.Swapped | None:
        if type(module) is not nn.ReLU:
            return None
        module.__class__ = CountingReLU

        def undo() -> None:
            module.__class__ = nn.ReLU

        return ts.Swapped(module, undo)


@pytest.fixture
def swap_strategy() -> Iterator[str]:
    yield from registered(InPlaceRewriter)


def test_in_place_rewrites_keep_state_and_undo(swap_strategy: str) -> None:
    shared = nn.ReLU()
    model = nn.Sequential(nn.Linear(4, 4), shared, nn.Sequential(shared), nn.Linear(4, 4))
    h = ts.apply(model, swap_strategy)
    assert len(h.rewrites) == 1  # registered under two parents: swapped once
    assert model[1] is shared and type(shared) is CountingReLU
    model.eval()  # state changed while applied is the module's own: nothing to copy back
    CountingReLU.calls = 0
    model(torch.randn(2, 4) * 1).sum().backward()
    assert CountingReLU.calls == 2
    h.remove()
    assert type(shared) is nn.ReLU and model[1] is shared and not shared.training
    # the model itself may be changed in place
    root = nn.ReLU()
    with ts.apply(root, swap_strategy) as h2:
        assert type(root) is CountingReLU and len(h2.rewrites) == 1
    assert type(root) is nn.ReLU


def test_a_new_module_for_the_root_is_refused(rewrite_strategy: str) -> None:
    with pytest.raises(ApplyError, match="only in place"):
        ts.apply(nn.ReLU(), rewrite_strategy)


def test_rewriting_nothing_is_a_warning(rewrite_strategy: str) -> None:
    """A loop over every strategy goes on: the model is left as it was, and said so."""
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.warns(NothingToRewriteWarning, match="found no module to rewrite"):
        handle = ts.apply(model, rewrite_strategy)
    assert not handle.rewrites and type(model[0]) is nn.Linear
    handle.remove()
    assert ts.handle_of(model) is None


def test_a_submodule_of_an_applied_model_is_refused(toy_strategies: list[str]) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)))
    with ts.apply(model, "test.clone"):
        with pytest.raises(ApplyError, match=r"holds this Sequential as '1'"):
            ts.apply(model[1], "test.half")
        with pytest.raises(ApplyError, match="already applied to this model"):
            ts.apply(model, "test.half")
    with (
        ts.apply(model[1], "test.half"),  # after remove, either is fine
        pytest.raises(ApplyError, match="already applied to submodule '1'"),
    ):
        ts.apply(model, "test.clone")


def test_stash_refuses_rewriters(rewrite_strategy: str) -> None:
    with pytest.raises(ApplyError, match="use torchstash.apply"):
        ts.stash(rewrite_strategy)


def test_chain_composes_compressors(toy_strategies: list[str]) -> None:
    model = ENTRIES["gpt"].build()
    e = ENTRIES["gpt"]
    x, y = e.batch(2, torch.device("cpu"))
    report = ts.measure(
        model, lambda: e.loss(model, x, y).backward(), "test.clone>test.half", min_bytes=0, repeat=1
    )
    assert report.stored_bytes < 0.6 * report.raw_bytes  # clone's payload went through half
    with pytest.raises(ts.errors.OptionError, match="keyed by part name"):
        ts.apply(model, "test.clone>test.half", bits=2)


def test_measure_report(tmp_path: Path, toy_strategies: list[str]) -> None:
    e = ENTRIES["vit"]
    model = e.build()
    x, y = e.batch(2, torch.device("cpu"))
    report = ts.measure(model, lambda m: e.loss(m, x, y).backward(), "test.half", repeat=2)
    assert report.strategy == "test.half" and report.device == "cpu"
    assert len(report.step_times_s) == 2 and report.step_time_s > 0
    assert report.cuda_peak_bytes is None
    assert 1.5 < report.ratio < 2.1
    d = json.loads(report.to_json())
    assert d["raw_bytes"] == report.raw_bytes and d["rows"][0]["module"] is not None
    text = str(report)
    assert "test.half" in text and "total raw" in text
    # measuring an applied model measures what is applied
    with ts.apply(model, "none"):
        r2 = ts.measure(model, lambda: e.loss(model, x, y).backward(), repeat=1)
        assert r2.raw_bytes == r2.stored_bytes == report.raw_bytes
        with pytest.raises(ApplyError, match="already has torchstash applied"):
            ts.measure(model, lambda: None, "none")


def test_measure_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    e = ENTRIES["gpt"]
    model = e.build()
    x, y = e.batch(2, torch.device("cpu"))
    out = ts.measure(model, lambda: e.loss(model, x, y).backward(), repeat=1).plot(
        tmp_path / "m.png"
    )
    assert out.stat().st_size > 1000
