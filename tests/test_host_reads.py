"""No host read of a tensor's value in a steady step, on the CPU: what ``tests/test_cuda_sync.py``
checks on a GPU (where each read is a wait for the device), checked where CI runs. Every
registered strategy on every zoo model; a read outside the library's known ones
(``KNOWN_HOST_READS``) fails with its stack. A strategy added tomorrow is checked the day it
is registered."""

from __future__ import annotations

import pytest
import torch

import torchstash as ts
from torchstash.testing.hostreads import KNOWN_HOST_READS, host_reads, unexplained
from torchstash.testing.models import zoo

STRATEGIES = [None, *ts.REGISTRY.names()]
MODELS = {e.name: e for e in zoo("tiny")}


def test_the_gauge_sees_each_kind_of_read_and_puts_torch_back() -> None:
    t = torch.ones(3)
    before = torch.Tensor.item, torch.Tensor.__bool__, torch.equal
    with host_reads() as stacks:
        t.sum().item()
        bool(t.any())
        t.tolist()
        torch.equal(t, t)
        t.nonzero()
    assert len(stacks) == 5
    me = "test_host_reads:test_the_gauge_sees_each_kind_of_read_and_puts_torch_back"
    assert all(s[-1] == me for s in stacks), stacks
    assert (torch.Tensor.item, torch.Tensor.__bool__, torch.equal) == before
    assert unexplained([["m:step", "groupwise:encode"], ["m:step", "mine:compress_as"]]) == [
        "m:step > mine:compress_as"
    ]
    assert set(KNOWN_HOST_READS) == {"pool:pack_pool_positions", "groupwise:encode"}


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_steady_step_reads_nothing_on_the_host(strategy: str | None, model_name: str) -> None:
    entry = MODELS[model_name]
    x, y = entry.batch(8, torch.device("cpu"))
    torch.manual_seed(0)
    model = entry.build()
    handle = ts.apply(model, strategy) if strategy is not None else None
    try:
        for _ in range(3):  # recorded, then replayed; estimates and budgets settle
            model.zero_grad(set_to_none=True)
            entry.loss(model, x, y).backward()
        with host_reads() as stacks:
            loss = entry.loss(model, x, y)
            loss.backward()
        assert not unexplained(stacks), f"the step read on the host: {unexplained(stacks)}"
    finally:
        if handle is not None:
            handle.remove()
