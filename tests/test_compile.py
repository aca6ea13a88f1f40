"""torch.compile with every installed strategy: the same gradients as eager, and where a
strategy cannot run inside a compiled graph, one clear warning and an eager fallback.

Compressing strategies run eagerly under ``torch.compile`` (bit-exact with eager, savings
intact); rewrite-only ``memsave`` is traced into the graph. ``aot_eager`` runs AOTAutograd's
capture without code generation, so the suite stays fast; one inductor case checks the
generated code too.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import torchstash as ts
from torchstash.errors import CompileFallbackWarning
from torchstash.testing.models import ZooEntry, zoo

STRATEGIES = ts.REGISTRY.names()
MODELS = {e.name: e for e in zoo("tiny")}
REWRITE_ONLY = {"memsave"}

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.*:DeprecationWarning")


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _options(strategy: str) -> dict[str, Any]:
    return {"seed": 0} if strategy.startswith("quant.int") or strategy == "quant" else {}


def _train(
    entry: ZooEntry,
    strategy: str,
    wrap: Callable[[torch.nn.Module], Callable[..., Any]],
    steps: int = 2,
) -> tuple[list[list[torch.Tensor]], list[warnings.WarningMessage], ts.Handle]:
    torch.manual_seed(0)
    model = entry.build()
    handle = ts.apply(model, strategy, **_options(strategy))
    run = wrap(model)
    out = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CompileFallbackWarning)
        for i in range(steps):
            torch.manual_seed(100 + i)
            x, y = entry.batch(4, torch.device("cpu"))
            model.zero_grad()
            entry.loss(run, x, y).backward()  # type: ignore[arg-type]
            out.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    fallbacks = [w for w in caught if issubclass(w.category, CompileFallbackWarning)]
    return out, fallbacks, handle


def _eager(model: torch.nn.Module) -> Callable[..., Any]:
    return model


def _compiled(backend: str) -> Callable[[torch.nn.Module], Callable[..., Any]]:
    return lambda model: torch.compile(model, backend=backend)


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_compiled_matches_eager(strategy: str, model_name: str) -> None:
    entry = MODELS[model_name]
    eager, none_warned, handle = _train(entry, strategy, _eager)
    assert not none_warned
    handle.remove()
    compiled, warned, handle = _train(entry, strategy, _compiled("aot_eager"))
    if handle.plan.has_compressors:
        # The eager fallback: bit-exact, said once however many steps ran.
        assert len(warned) == 1, [str(w.message) for w in warned]
        message = str(warned[0].message)
        assert strategy in message and "runs eagerly" in message
        for a, b in zip(eager, compiled, strict=True):
            for ga, gb in zip(a, b, strict=True):
                assert torch.equal(ga, gb)
        assert sum(r.stored_bytes for r in handle.tally.rows.values()) > 0
    else:
        # Traced into the graph: AOTAutograd may reorder float sums, nothing more.
        assert not warned, [str(w.message) for w in warned]
        for a, b in zip(eager, compiled, strict=True):
            for ga, gb in zip(a, b, strict=True):
                torch.testing.assert_close(gb, ga, rtol=1e-5, atol=1e-6)
    handle.remove()


@pytest.mark.parametrize("strategy", ["quant.int8", "memsave"])
def test_inductor_trains_as_eager(strategy: str) -> None:
    """Generated code too: memsave's mask unpacking and ReLU code compile with inductor."""
    entry = MODELS["resnet"]
    eager, _, handle = _train(entry, strategy, _eager, steps=1)
    handle.remove()
    compiled, warned, handle = _train(entry, strategy, _compiled("inductor"), steps=1)
    assert len(warned) == (0 if strategy in REWRITE_ONLY else 1)
    for ga, gb in zip(eager[0], compiled[0], strict=True):
        torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-5)
    handle.remove()


def test_compiled_step_function_keeps_the_fallback() -> None:
    """A compiled training step that calls the model: the model still runs eagerly."""
    entry = MODELS["gpt"]
    eager, _, handle = _train(entry, "quant.int8", _eager, steps=1)
    handle.remove()

    def wrap(model: torch.nn.Module) -> Callable[..., Any]:
        return torch.compile(lambda x: model(x), backend="aot_eager")

    compiled, warned, handle = _train(entry, "quant.int8", wrap, steps=1)
    assert len(warned) == 1
    for ga, gb in zip(eager[0], compiled[0], strict=True):
        assert torch.equal(ga, gb)
    handle.remove()


def test_module_compile_keeps_the_fallback() -> None:
    entry = MODELS["gpt"]
    eager, _, handle = _train(entry, "quant.int4", _eager, steps=1)
    handle.remove()

    def wrap(model: torch.nn.Module) -> Callable[..., Any]:
        model.compile(backend="aot_eager")
        return model

    compiled, warned, handle = _train(entry, "quant.int4", wrap, steps=1)
    assert len(warned) == 1
    for ga, gb in zip(eager[0], compiled[0], strict=True):
        assert torch.equal(ga, gb)
    handle.remove()


def test_remove_restores_compilation() -> None:
    """After remove the model compiles as stock does: no fallback, no warning, no override."""
    entry = MODELS["gpt"]
    torch.manual_seed(0)
    model = entry.build()
    ts.apply(model, "quant.int8").remove()
    assert "_call_impl" not in model.__dict__
    x, y = entry.batch(2, torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        entry.loss(torch.compile(model, backend="aot_eager"), x, y).backward()  # type: ignore[arg-type]


def test_state_dict_and_deepcopy_unaffected() -> None:
    import copy

    entry = MODELS["gpt"]
    model = entry.build()
    keys = list(model.state_dict())
    handle = ts.apply(model, "quant.int8")
    assert list(model.state_dict()) == keys
    twin = copy.deepcopy(model)
    x, _ = entry.batch(2, torch.device("cpu"))
    with torch.no_grad():
        torch.testing.assert_close(twin(x), model(x))
    handle.remove()


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)
    )


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_graph_compiled_for_a_stock_copy_is_never_reused(backend: str) -> None:
    """A stock copy compiled first (to compare), then the strategy applied to another copy and
    that compiled: dynamo guards a frame on its module's type, and an applied model takes a
    subclass of its own (same name), so the stock graph, which runs no hook, is not reused
    (it was: nothing compressed, no warning, stock's gradients): the fallback warns, the tally
    counts, the gradients are eager's. ``remove`` gives the class back."""
    x = torch.randn(8, 256)
    model = _mlp()
    with ts.apply(model, "quant.int8", seed=0):
        model(x).square().sum().backward()
        eager = [p.grad.clone() for p in model.parameters()]
    stock = _mlp()
    torch.compile(stock, backend=backend)(x).square().sum().backward()
    model = _mlp()
    handle = ts.apply(model, "quant.int8", seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CompileFallbackWarning)
        torch.compile(model, backend=backend)(x).square().sum().backward()
    assert [w.category for w in caught] == [CompileFallbackWarning]
    assert 0 < handle.tally.stored_bytes < handle.tally.raw_bytes
    for ga, p in zip(eager, model.parameters(), strict=True):
        assert torch.equal(ga, p.grad)
    assert type(model).__name__ == type(stock).__name__ and type(model) is not type(stock)
    handle.remove()
    assert type(model) is type(stock)


def test_fullgraph_is_an_error_naming_the_strategy_and_what_to_do() -> None:
    entry = MODELS["gpt"]
    torch.manual_seed(0)
    model = entry.build()
    x, y = entry.batch(2, torch.device("cpu"))
    with ts.apply(model, "quant.int8"):
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        with pytest.raises(torch._dynamo.exc.Unsupported) as caught:
            entry.loss(compiled, x, y)  # type: ignore[arg-type]
    text = str(caught.value)
    assert "torchstash: 'quant.int8' is applied to this model" in text
    assert "Compile without fullgraph=True" in text
