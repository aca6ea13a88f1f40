"""Every installed strategy under mixed precision: bf16 autocast trains; fp16 autocast with a
GradScaler trains, and a step whose activations overflow is skipped by the scaler (the
overflow survives every compressor, so nothing is silently wrong)."""

from __future__ import annotations

import pytest
import torch

import torchstash as ts
from torchstash.testing.models import zoo

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


def _bf16_grads(model_name: str, strategy: str | None, device: str = "cpu") -> list[torch.Tensor]:
    entry = MODELS[model_name]
    torch.manual_seed(0)
    model = entry.build().to(device)
    handle = ts.apply(model, strategy) if strategy else None
    x, y = entry.batch(4, torch.device(device))  # type: ignore[attr-defined]
    torch.manual_seed(1)
    with torch.autocast(device, torch.bfloat16):
        loss = entry.loss(model, x, y)  # type: ignore[attr-defined]
    loss.backward()
    if handle is not None:
        ts.remove(model)
    return [p.grad.flatten().cpu() for p in model.parameters() if p.grad is not None]


def _cosine(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.cat(a), torch.cat(b), 0))


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bf16_autocast_with_cudas_policy_trains_as_well(strategy: str, model_name: str) -> None:
    """Under CUDA's autocast policy (softmax, LayerNorm in float32 on bf16 inputs), emulated
    on the CPU: a step trains, as close to stock's as under the CPU's policy. Outputs the
    engine recomputes in backward are replayed under the forward's autocast; replayed
    without it, the zoo's hand-written attention failed in backward under every quant
    strategy ("expected scalar type Float but found BFloat16"), on CUDA and here."""
    from torchstash.testing.autocast import cuda_autocast_policy_on_cpu

    cpu_policy = _cosine(_bf16_grads(model_name, None), _bf16_grads(model_name, strategy))
    with cuda_autocast_policy_on_cpu():
        stock = _bf16_grads(model_name, None)
        got = _bf16_grads(model_name, strategy)
    assert all(g.isfinite().all() for g in got)
    assert _cosine(stock, got) >= cpu_policy - 0.02, (_cosine(stock, got), cpu_policy)


@pytest.mark.cuda
@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bf16_cuda_autocast_trains_as_well(strategy: str, model_name: str) -> None:
    """The same on CUDA itself: a step under CUDA's bf16 autocast trains, about as close to
    stock's (under the same autocast) as on the CPU (the GPU's own rounding aside)."""
    cpu = _cosine(_bf16_grads(model_name, None), _bf16_grads(model_name, strategy))
    stock = _bf16_grads(model_name, None, "cuda")
    got = _bf16_grads(model_name, strategy, "cuda")
    assert all(g.isfinite().all() for g in got)
    assert _cosine(stock, got) >= cpu - 0.05, (_cosine(stock, got), cpu)
