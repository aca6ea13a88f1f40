"""The compiled path (:mod:`torchstash.graphhooks`) with the core's own toy compressors: a
code that traces runs inside the graph; one that reads a value on the host is kept as stock
saves it, with one warning naming the site; a site is named from the graph as eagerly."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import torchstash
from torchstash.errors import CompileFallbackWarning
from torchstash.packed import Packed
from torchstash.site import Site
from torchstash.testing.toys import HalfCompressor

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.*:DeprecationWarning")


class TracedHalf(HalfCompressor):
    """``test.half`` declared traceable: a cast each way."""

    name = "test.traced_half"
    traceable = True


class ReadsTheHost(HalfCompressor):
    """Traceable by its word, but it asks the data a question on the host."""

    name = "test.reads_host"
    traceable = True

    def compress(self, x: torch.Tensor, site: Site) -> Packed:
        if bool(x.isnan().any()):
            return Packed.like(x, self.name, data=x.detach().clone())
        return super().compress(x, site)


@pytest.fixture(autouse=True)
def _toys() -> Iterator[None]:
    torch._dynamo.reset()
    reg = torchstash.REGISTRY
    for factory in (TracedHalf, ReadsTheHost):
        reg.register(factory.name, factory, lossless=False, summary=factory.__doc__ or "")
    try:
        yield
    finally:
        for factory in (TracedHalf, ReadsTheHost):
            reg.unregister(factory.name)
        torch._dynamo.reset()


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 256)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def grads(model: nn.Module, call: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    call(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_a_code_that_traces_runs_in_the_graph() -> None:
    torch.manual_seed(0)
    x = torch.randn(16, 64)
    eager, ours = MLP(), MLP()
    ours.load_state_dict(eager.state_dict())
    with torchstash.apply(eager, "test.traced_half"):
        want = grads(eager, eager, x)
    with torchstash.apply(ours, "test.traced_half") as handle:
        with warnings.catch_warnings():
            warnings.simplefilter("error", CompileFallbackWarning)
            got = grads(ours, torch.compile(ours, backend="aot_eager", fullgraph=True), x)
        assert handle.graph is not None
        coded = [d for d in handle.graph.decisions if d.compressor is not None]
        # the model's input too, a graph input (the hooks see all but parameters)
        assert {(d.site.module, d.site.op, d.site.role) for d in coded} == {
            ("fc1", "linear", "input"),
            ("act", "gelu", "input"),
            ("fc2", "linear", "input"),
        }
        rows = handle.tally.rows
        assert rows["fc2"].stored_bytes * 2 == rows["fc2"].raw_bytes == 16 * 256 * 4
        assert rows["fc1"].stored_bytes * 2 == rows["fc1"].raw_bytes == 16 * 64 * 4
    # every gradient reads the same bf16 values both ways
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_a_code_that_reads_the_host_is_kept_and_named() -> None:
    torch.manual_seed(0)
    x = torch.randn(16, 64)
    stock, ours = MLP(), MLP()
    ours.load_state_dict(stock.state_dict())
    compiled_stock = copy.deepcopy(stock)
    want = grads(compiled_stock, torch.compile(compiled_stock, backend="aot_eager"), x)
    with torchstash.apply(ours, "test.reads_host") as handle:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CompileFallbackWarning)
            got = grads(ours, torch.compile(ours, backend="aot_eager"), x)
        assert handle.graph is not None
        assert not any(d.compressor for d in handle.graph.decisions)
    texts = [str(w.message) for w in caught]
    assert texts and all("'test.reads_host' keeps" in t and "does not trace" in t for t in texts)
    assert any("fc2 (Linear)" in t for t in texts)
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
