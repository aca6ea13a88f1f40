"""Every installed strategy under mixed precision: bf16 autocast trains; fp16 autocast with a
GradScaler trains, and a step whose activations overflow is skipped by the scaler (the
overflow survives every compressor, so nothing is silently wrong)."""

from __future__ import annotations

import pytest
import torch

import torchstash as ts
from torchstash.bench.zoo import zoo

STRATEGIES = ts.REGISTRY.names()
MODELS = {e.name: e for e in zoo("tiny")}


def _setup(model_name: str, strategy: str) -> tuple[torch.nn.Module, ts.Handle, object]:
    entry = MODELS[model_name]
    torch.manual_seed(0)
    model = entry.build()
    return model, ts.apply(model, strategy), entry


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bf16_autocast_trains(strategy: str, model_name: str) -> None:
    model, handle, entry = _setup(model_name, strategy)
    x, y = entry.batch(4, torch.device("cpu"))  # type: ignore[attr-defined]
    with handle:
        with torch.autocast("cpu", torch.bfloat16):
            loss = entry.loss(model, x, y)  # type: ignore[attr-defined]
        loss.backward()
        rows = handle.tally.rows.values()
        assert sum(r.stored_bytes for r in rows) <= sum(r.raw_bytes for r in rows)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(g.isfinite().all() for g in grads)


@pytest.mark.parametrize("model_name", ["vit", "resnet"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fp16_grad_scaler_skips_an_overflow_step(strategy: str, model_name: str) -> None:
    model, handle, entry = _setup(model_name, strategy)
    x, y = entry.batch(4, torch.device("cpu"))  # type: ignore[attr-defined]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # A modest scale: under int1 the ResNet's stem gradient at scale 2**8 passes fp16's 65504
    # (stock's is 45), so its ordinary steps overflow too and the scaler backs off, as it should
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)

    def step(inputs: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", torch.float16):
            loss = entry.loss(model, inputs, y)  # type: ignore[attr-defined]
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    with handle:
        before = [p.detach().clone() for p in model.parameters()]
        step(x)  # a normal step: the parameters move
        assert scaler.get_scale() == 1.0
        moved = [p.detach().clone() for p in model.parameters()]
        assert any(not torch.equal(a, b) for a, b in zip(before, moved))
        bad = x.clone()
        bad[0, 0, 0, 0] = float("inf")  # one overflowing pixel
        step(bad)  # skipped: no parameter changes, the scale backs off
        assert scaler.get_scale() < 1.0, "the overflow did not reach the scaler"
        assert all(torch.equal(a, p) for a, p in zip(moved, model.parameters()))
