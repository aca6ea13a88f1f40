"""offload.cpu: an identity on CPU (declined with a reason); on CUDA, exact and faster than save_on_cpu."""

from __future__ import annotations

import time

import pytest
import torch

import torchstash as ts
from torchstash.offload import CpuOffload
from torchstash.site import Site
from torchstash.testing.models import zoo

from ._helpers import stock_then_measured

GPT = next(e for e in zoo("tiny") if e.name == "gpt")


def test_cpu_tensors_are_declined_with_a_reason() -> None:
    reasons = CpuOffload().unsupported(torch.randn(8), Site())
    assert reasons and "already" in reasons[0]
    model = GPT.build()
    x, y = GPT.batch(2, torch.device("cpu"))
    report = ts.measure(model, lambda: GPT.loss(model, x, y).backward(), "offload.cpu", repeat=1)
    assert report.stored_bytes == report.raw_bytes and report.host_bytes == 0
    declined = {k for r in report.rows for k in r.declined}
    assert any("offload.cpu moves accelerator tensors" in k for k in declined)


def test_bad_prefetch_option() -> None:
    with pytest.raises(ValueError, match="prefetch"):
        ts.apply(torch.nn.Linear(2, 2), "offload.cpu", prefetch=-1)


@pytest.mark.cuda
def test_gradients_exact_and_bytes_on_host() -> None:
    entry = next(e for e in zoo("small") if e.name == "gpt")
    torch.manual_seed(0)
    model = entry.build().cuda()
    batch = entry.batch(entry.batch_size, torch.device("cuda"))
    stock, report = stock_then_measured(entry, model, batch, "offload.cpu")
    assert all(torch.equal(a, p.grad) for a, p in zip(stock, model.parameters(), strict=True))
    assert report.host_bytes > 0.9 * report.raw_bytes


@pytest.mark.cuda
def test_faster_than_save_on_cpu() -> None:
    entry = next(e for e in zoo("base") if e.name == "gpt")
    model = entry.build().cuda()
    x, y = entry.batch(entry.batch_size, torch.device("cuda"))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        entry.loss(model, x, y).backward()

    def timed(ctx_factory: object, n: int = 10) -> float:
        times = []
        for _ in range(n + 2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with ctx_factory():  # type: ignore[operator]
                step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return sorted(times[2:])[n // 2]

    theirs = timed(lambda: torch.autograd.graph.save_on_cpu(pin_memory=True))
    ours = timed(lambda: ts.apply(model, "offload.cpu"))
    assert ours < theirs, f"offload.cpu {ours * 1e3:.1f} ms vs save_on_cpu {theirs * 1e3:.1f} ms"
