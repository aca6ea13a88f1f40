"""No host synchronisation in a pack or an unpack, on CUDA: every registered strategy runs a
steady training step under ``torch.cuda.set_sync_debug_mode("warn")``, where any call that
waits for the device (``.item()``, ``.tolist()``, a boolean test of a device tensor, a copy
from pageable host memory) warns; each warning's Python stack is kept, and any sync outside
the few the library makes by design (each with its reason) fails the
test (``torchstash.testing.hostreads.KNOWN_HOST_READS``, shared with the CPU's gauge,
``tests/test_host_reads.py``). A strategy added tomorrow is checked the day it is registered."""

from __future__ import annotations

import pytest
import torch

import torchstash as ts
from torchstash.testing.hostreads import device_waits, unexplained
from torchstash.testing.models import zoo

#: every strategy, and stock first (a model whose own step waits would fail them all)
STRATEGIES = [None, *ts.REGISTRY.names()]
MODELS = {e.name: e for e in zoo("tiny")}


@pytest.mark.cuda
def test_a_host_read_is_seen() -> None:
    """The gauge itself on a GPU: a read of a device value is caught, with its stack."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; none is visible to torch here")
    with device_waits() as stacks:
        torch.ones(1, device="cuda").item()
    assert stacks and stacks[0][-1] == "test_cuda_sync:test_a_host_read_is_seen", stacks


@pytest.mark.cuda
@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_steady_step_never_waits_for_the_device(strategy: str | None, model_name: str) -> None:
    entry = MODELS[model_name]
    device = torch.device("cuda")
    x, y = entry.batch(8, device)
    torch.manual_seed(0)
    model = entry.build().to(device)
    handle = ts.apply(model, strategy) if strategy is not None else None
    try:
        for _ in range(3):  # kernels load, running estimates and budgets settle
            model.zero_grad(set_to_none=True)
            entry.loss(model, x, y).backward()
        torch.cuda.synchronize()
        with device_waits() as stacks:
            loss = entry.loss(model, x, y)
            loss.backward()
        assert torch.isfinite(loss).item()
        assert not unexplained(stacks), f"the step waited for the device: {unexplained(stacks)}"
    finally:
        if handle is not None:
            handle.remove()
