"""No host read of a tensor's value in a steady step, on the CPU: what ``tests/test_cuda_sync.py``
checks on a GPU (where each read is a wait for the device), checked where CI runs. Every
registered strategy on every zoo model; a read outside the library's known ones
(``KNOWN_HOST_READS``) fails with its stack. A strategy added tomorrow is checked the day it
is registered."""

from __future__ import annotations

import pytest
import torch

import torchstash as ts
from torchstash import env
from torchstash.testing.hostreads import KNOWN_HOST_READS, host_reads, unexplained
from torchstash.testing.models import zoo

STRATEGIES = [None, *ts.REGISTRY.names()]
MODELS = {e.name: e for e in zoo("tiny")}


def test_the_gauge_sees_each_kind_of_read_and_puts_torch_back() -> None:
    t = torch.ones(3)
    before = torch.Tensor.item, torch.Tensor.__bool__, torch.equal
    copies = torch.tensor, torch.as_tensor
    with host_reads() as stacks:
        t.sum().item()
        bool(t.any())
        t.tolist()
        torch.equal(t, t)
        t.nonzero()
        torch.tensor([1.0, 2.0])  # host values: a copy the host waits for on a GPU
        torch.as_tensor([3])
        torch.as_tensor(t)  # a tensor: no host values
    assert len(stacks) == 7
    me = "test_host_reads:test_the_gauge_sees_each_kind_of_read_and_puts_torch_back"
    assert all(s[-1] == me for s in stacks), stacks
    assert (torch.Tensor.item, torch.Tensor.__bool__, torch.equal) == before
    assert (torch.tensor, torch.as_tensor) == copies
    assert unexplained([["m:step", "groupwise:encode"], ["m:step", "mine:compress_as"]]) == [
        "m:step > mine:compress_as"
    ]
    assert set(KNOWN_HOST_READS) == {"pool:pack_pool_positions", "groupwise:encode"}


@pytest.mark.parametrize("kernels", ["as-set", "off"])
@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_steady_step_reads_nothing_on_the_host(
    strategy: str | None, model_name: str, kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the kernels off the references run, as they do on CUDA for an op whose kernel is
    the CPU's only (``window_indices`` made its offsets from a host list: every quant code on
    the ResNet waited for an H200 in unpack, and this test, kernels off, failed with it)."""
    if kernels == "off":
        monkeypatch.setenv(env.KERNELS, "off")
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
