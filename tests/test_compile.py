"""torch.compile with every installed strategy: inside the compiled graph where its codes
trace (``quant.int8``, ``quant.fp8`` and presets: :mod:`torchstash.graphhooks`), else one
clear warning quoting why, and an eager fallback.

In the graph a strategy codes what the compiled graph saves, with gradients as close to stock's
as eager's; a strategy that does not run there (int4 and int2, whose graphs keep more bytes
or fall short of eager's gradients on models outside the zoo, mesa, ``quant.auto``, ``quant.int1``,
the dropping and offloading strategies) runs eagerly under ``torch.compile`` (bit-exact with
eager, savings intact); rewrite-only ``memsave`` is traced into the graph. ``aot_eager`` runs
AOTAutograd's capture without code generation, so the suite stays fast; the inductor cases
check the generated code too."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import torchstash as ts
from torchstash.errors import ApplyError, CompileFallbackWarning
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
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CompileFallbackWarning)
        out = _steps(entry, model, wrap(model), steps)
    fallbacks = [w for w in caught if issubclass(w.category, CompileFallbackWarning)]
    return out, fallbacks, handle


def _steps(
    entry: ZooEntry, model: torch.nn.Module, run: Callable[..., Any], steps: int
) -> list[list[torch.Tensor]]:
    """Each step's gradients, on batches seeded by the step."""
    out = []
    for i in range(steps):
        torch.manual_seed(100 + i)
        x, y = entry.batch(4, torch.device("cpu"))
        model.zero_grad()
        entry.loss(run, x, y).backward()  # type: ignore[arg-type]
        out.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    return out


def _stock(entry: ZooEntry, steps: int = 2) -> list[list[torch.Tensor]]:
    """Stock's gradients at :func:`_train`'s steps."""
    torch.manual_seed(0)
    model = entry.build()
    return _steps(entry, model, model, steps)


def cosine(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    x = torch.cat([g.flatten() for g in a]).double()
    y = torch.cat([g.flatten() for g in b]).double()
    return float(x @ y / (x.norm() * y.norm()))


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
    if handle.graph is not None:
        # In the graph: what the graph saves, coded; gradients as near stock's as eager's
        # (cosine within 0.001 of the eager strategy's).
        assert not warned, [str(w.message) for w in warned]
        assert handle.graph.decisions and 0 < handle.tally.stored_bytes < handle.tally.raw_bytes
        for stock, a, b in zip(_stock(entry), eager, compiled, strict=True):
            assert cosine(stock, b) >= cosine(stock, a) - 1e-3, strategy
    elif handle.plan.has_compressors:
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


@pytest.mark.parametrize("strategy", ["quant.int8", "quant.fp8", "memsave"])
def test_inductor_trains_as_eager(strategy: str) -> None:
    """Generated code too: the group codes' and fp8's kernels in the graph,
    memsave's mask unpacking and ReLU code compiled by inductor."""
    entry = MODELS["resnet"]
    eager, _, handle = _train(entry, strategy, _eager, steps=1)
    handle.remove()
    compiled, warned, handle = _train(entry, strategy, _compiled("inductor"), steps=1)
    in_graph = handle.graph is not None or strategy in REWRITE_ONLY
    assert len(warned) == (0 if in_graph else 1)
    if handle.graph is not None:
        assert cosine(eager[0], compiled[0]) > 0.999
    else:
        for ga, gb in zip(eager[0], compiled[0], strict=True):
            torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-5)
    handle.remove()


def test_a_compiled_step_function_codes_in_the_graph() -> None:
    """A compiled training step that calls the model: the model's call, started by the
    entry dynamo leaves alone, is compiled with the strategy's graph hooks."""
    entry = MODELS["gpt"]
    eager, _, handle = _train(entry, "quant.int8", _eager, steps=1)
    handle.remove()

    def wrap(model: torch.nn.Module) -> Callable[..., Any]:
        return torch.compile(lambda x: model(x), backend="aot_eager")

    compiled, warned, handle = _train(entry, "quant.int8", wrap, steps=1)
    assert not warned
    assert handle.graph is not None and handle.graph.decisions
    assert cosine(eager[0], compiled[0]) > 0.999
    handle.remove()


@pytest.mark.parametrize("strategy", ["quant.int4", "quant.fp8"])
def test_module_compile(strategy: str) -> None:
    """``model.compile()``: in the graph where the codes trace, else the eager fallback."""
    entry = MODELS["gpt"]
    eager, _, handle = _train(entry, strategy, _eager, steps=1)
    handle.remove()

    def wrap(model: torch.nn.Module) -> Callable[..., Any]:
        model.compile(backend="aot_eager")
        return model

    compiled, warned, handle = _train(entry, strategy, wrap, steps=1)
    if handle.graph is not None:
        assert not warned and handle.graph.decisions
        assert cosine(eager[0], compiled[0]) > 0.99
    else:
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
    assert "_call_impl" not in model.__dict__ and "__call__" not in model.__dict__
    x, y = entry.batch(2, torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        entry.loss(torch.compile(model, backend="aot_eager"), x, y).backward()  # type: ignore[arg-type]


def test_state_dict_and_deepcopy_unaffected() -> None:

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


@pytest.mark.parametrize(
    ("backend", "strategy"),
    [("eager", "quant.int1"), ("aot_eager", "quant.int1"), ("aot_eager", "quant.int8")],
)
def test_a_graph_compiled_for_a_stock_copy_is_never_reused(backend: str, strategy: str) -> None:
    """A stock copy compiled first (to compare), then the strategy applied to another copy and
    that compiled: dynamo guards a frame on its module's type, and an applied model takes a
    subclass of its own (same name), so the stock graph, which runs no hook, is not reused
    (it was: nothing compressed, no warning, stock's gradients). In the graph the codes are
    the graph's; otherwise the fallback warns and the gradients are eager's. The tally
    counts. ``remove`` gives the class back."""
    x = torch.randn(8, 256)
    model = _mlp()
    with ts.apply(model, strategy, **_options(strategy)):
        model(x).square().sum().backward()
        eager = [p.grad.clone() for p in model.parameters()]
    stock = _mlp()
    torch.compile(stock, backend=backend)(x).square().sum().backward()
    want = [p.grad for p in stock.parameters()]
    model = _mlp()
    handle = ts.apply(model, strategy, **_options(strategy))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CompileFallbackWarning)
        torch.compile(model, backend=backend)(x).square().sum().backward()
    assert 0 < handle.tally.stored_bytes < handle.tally.raw_bytes
    grads = [p.grad for p in model.parameters()]
    if handle.graph is not None:
        assert not caught
        assert cosine(want, grads) > cosine(want, eager) - 1e-3
        assert not all(torch.equal(a, b) for a, b in zip(want, grads, strict=True))
    else:
        assert [w.category for w in caught] == [CompileFallbackWarning]
        for ga, gb in zip(eager, grads, strict=True):
            assert torch.equal(ga, gb)
    assert type(model).__name__ == type(stock).__name__ and type(model) is not type(stock)
    handle.remove()
    assert type(model) is type(stock)


def test_fullgraph_is_an_error_naming_the_strategy_and_what_to_do() -> None:
    """A strategy whose codes do not trace (int1's) under ``fullgraph=True``."""
    entry = MODELS["gpt"]
    torch.manual_seed(0)
    model = entry.build()
    x, y = entry.batch(2, torch.device("cpu"))
    with ts.apply(model, "quant.int1"):
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        with pytest.raises(torch._dynamo.exc.Unsupported) as caught:
            entry.loss(compiled, x, y)  # type: ignore[arg-type]
    text = str(caught.value)
    assert "torchstash: 'quant.int1' is applied to this model" in text
    assert "Compile without fullgraph=True" in text


def test_a_backend_without_aotautograd_is_said_not_silent() -> None:
    """The graph's codes are AOTAutograd's hooks: a backend without it (``eager``) saves as
    stock does, and one warning says so and what to do."""
    x = torch.randn(8, 256)
    model = _mlp()
    handle = ts.apply(model, "quant.int8", seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CompileFallbackWarning)
        compiled = torch.compile(model, backend="eager")
        for _ in range(2):
            compiled(x).square().sum().backward()
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "'quant.int8'" in text and "backend='eager'" in text and "inductor" in text
    handle.remove()


def test_fullgraph_compiles_a_tracing_strategy_in_one_graph() -> None:
    """``fullgraph=True`` with a strategy whose codes trace: one frame, no break, coded."""
    from torch._dynamo.testing import CompileCounterWithBackend

    entry = MODELS["gpt"]
    torch.manual_seed(0)
    model = entry.build()
    x, y = entry.batch(2, torch.device("cpu"))
    frames = CompileCounterWithBackend("aot_eager")
    with ts.apply(model, "quant.int8") as handle:
        compiled = torch.compile(model, backend=frames, fullgraph=True)
        for _ in range(3):
            entry.loss(compiled, x, y).backward()  # type: ignore[arg-type]
        assert frames.frame_count == 1  # no recompilation after the first call
        assert handle.graph is not None
        assert any(d.compressor is not None for d in handle.graph.decisions)
        assert 0 < handle.tally.stored_bytes < handle.tally.raw_bytes


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_a_compiled_save_is_named_as_eager_names_it(model_name: str) -> None:
    """Each value the graph codes is named from the graph (:mod:`torchstash.graphsite`) by
    a module and an op that the eager engine names a save by on the same model, so a policy
    line selects the same saves compiled and eager; and the gradients match eager's."""
    entry = MODELS[model_name]
    eager, _, handle = _train(entry, "quant.int8", _eager, steps=1)
    named = {(row.module, op) for row in handle.tally.rows.values() for op in row.ops}
    handle.remove()
    compiled, warned, handle = _train(entry, "quant.int8", _compiled("aot_eager"), steps=1)
    assert handle.graph is not None and not warned
    coded = {(d.site.module, d.site.op) for d in handle.graph.decisions if d.compressor}
    assert coded and coded <= named, coded - named
    assert cosine(eager[0], compiled[0]) > 0.9999
    handle.remove()


def test_a_policy_line_selects_in_the_graph() -> None:
    """A ``module`` selector decided at trace time: only the selected modules' saves coded."""
    entry = MODELS["gpt"]
    torch.manual_seed(0)
    model = entry.build()
    x, y = entry.batch(2, torch.device("cpu"))
    rules = [{"module": "blocks.0.*", "strategy": "quant.int8"}]
    with ts.apply(model, policy=rules) as handle:
        entry.loss(torch.compile(model, backend="aot_eager"), x, y).backward()  # type: ignore[arg-type]
        assert handle.graph is not None
        coded = {d.site.module for d in handle.graph.decisions if d.compressor}
    assert coded and all(m.startswith("blocks.0.") for m in coded), coded


def test_remove_then_apply_again_compiles_with_the_new_hooks() -> None:
    """A graph guards on its hooks' identity: after ``remove`` the model's compiled graph is
    stock's (nothing coded, nothing counted), and applied again it is coded again."""
    x = torch.randn(8, 256)
    model = _mlp()
    compiled = torch.compile(model, backend="aot_eager")
    handle = ts.apply(model, "quant.int8", seed=0)
    compiled = torch.compile(model, backend="aot_eager")
    compiled(x).square().sum().backward()
    assert handle.tally.stored_bytes > 0
    handle.remove()
    stock = torch.compile(model, backend="aot_eager")
    stock(x).square().sum().backward()
    again = ts.apply(model, "quant.int8", seed=0)
    torch.compile(model, backend="aot_eager")(x).square().sum().backward()
    assert 0 < again.tally.stored_bytes < again.tally.raw_bytes
    assert again.graph is not None and again.graph.decisions
    again.remove()


def test_eager_calls_after_compiling_still_take_the_eager_engine() -> None:
    x = torch.randn(8, 256)
    model = _mlp()
    with ts.apply(model, "quant.int8", seed=0) as handle:
        torch.compile(model, backend="aot_eager")(x).square().sum().backward()
        compiled_rows = handle.tally.stored_bytes
        model(x).square().sum().backward()  # eager: the engine's hooks count it
        assert handle.tally.stored_bytes > compiled_rows
        assert handle.engine.replayer.recorded + handle.engine.replayer.replayed >= 1


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_bf16_autocast_in_the_graph(model_name: str) -> None:
    """bf16 autocast around a compiled ``fullgraph=True`` call: the graph's bf16 and float32
    saves coded, gradients near stock's under the same autocast."""
    entry = MODELS[model_name]
    torch.manual_seed(0)
    stock = entry.build()
    ours = copy.deepcopy(stock)
    x, y = entry.batch(4, torch.device("cpu"))

    def step(model: torch.nn.Module, call: Callable[..., Any]) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = entry.loss(call, x, y)  # type: ignore[arg-type]
        loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    want = step(stock, stock)
    with ts.apply(ours, "quant.int8", seed=0) as handle:
        got = step(ours, torch.compile(ours, backend="aot_eager", fullgraph=True))
        assert handle.graph is not None
        assert any(d.compressor for d in handle.graph.decisions)
    assert cosine(want, got) > 0.999


def _gpt_at(model: torch.nn.Module, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 128, (2, length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _gpt_step(call: Callable[..., Any], model: torch.nn.Module, x: Any, y: Any) -> list[Any]:
    model.zero_grad(set_to_none=True)
    logits = call(x)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("how", ["mark_dynamic", "automatic"])
def test_dynamic_shapes_one_graph_serves_every_length(how: str) -> None:
    """A changing sequence length: one graph traced with dynamic shapes serves every length
    (the codes do not specialize it), each call's saves are counted at its own length (as a
    graph traced at that length counts them, within 10%), and the gradients stay near
    eager's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    entry = MODELS["gpt"]
    torch.manual_seed(0)
    model = entry.build()
    lengths = [16, 12, 8, 10]
    eager_grads, static_bytes = [], []
    with ts.apply(model, "quant.int8", seed=0):
        for i, n in enumerate(lengths):
            eager_grads.append(_gpt_step(model, model, *_gpt_at(model, n, i)))
    with ts.apply(model, "quant.int8", seed=0) as handle:
        compiled = torch.compile(model, backend="aot_eager", dynamic=False)
        for i, n in enumerate(lengths):
            before = handle.tally.stored_bytes
            _gpt_step(compiled, model, *_gpt_at(model, n, i))
            static_bytes.append(handle.tally.stored_bytes - before)
    torch._dynamo.reset()
    frames = CompileCounterWithBackend("aot_eager")
    with ts.apply(model, "quant.int8", seed=0) as handle:
        compiled = torch.compile(model, backend=frames)
        for i, n in enumerate(lengths):
            x, y = _gpt_at(model, n, i)
            if how == "mark_dynamic":
                torch._dynamo.mark_dynamic(x, 1)
            before = handle.tally.stored_bytes
            got = _gpt_step(compiled, model, x, y)
            stored = handle.tally.stored_bytes - before
            assert abs(stored - static_bytes[i]) <= 0.1 * static_bytes[i], (n, stored)
            assert cosine(eager_grads[i], got) > 0.999, n
        # mark_dynamic: one graph; automatic: the first length's, then one dynamic graph
        assert frames.frame_count == (1 if how == "mark_dynamic" else 2)
        assert handle.graph is not None
        assert any(d.order is not None for d in handle.graph.decisions), "none coded dynamic"


def test_no_recompiles_after_warm_up() -> None:
    """Steps at one shape, a switch to eval and back, no_grad calls: each mode compiles once,
    and the steps after that reuse its graphs."""
    from torch._dynamo.testing import CompileCounterWithBackend

    entry = MODELS["gpt"]
    torch.manual_seed(0)
    model = entry.build()
    x, y = entry.batch(2, torch.device("cpu"))
    frames = CompileCounterWithBackend("aot_eager")
    with ts.apply(model, "quant.int8", seed=0):
        compiled = torch.compile(model, backend=frames)
        for _ in range(3):
            entry.loss(compiled, x, y).backward()  # type: ignore[arg-type]
        warm = frames.frame_count
        model.eval()
        with torch.no_grad():
            compiled(x)
            compiled(x)
        model.train()
        for _ in range(3):
            entry.loss(compiled, x, y).backward()  # type: ignore[arg-type]
        evaluated = frames.frame_count
        for _ in range(3):
            entry.loss(compiled, x, y).backward()  # type: ignore[arg-type]
            with torch.no_grad():
                model.eval()
                compiled(x)
                model.train()
    assert warm == 1
    assert frames.frame_count == evaluated <= 2


def test_a_compiled_function_counts_each_length_of_a_dynamic_graph() -> None:
    """A compiled step function that calls the model with changing sizes: the model's call is
    a frame of its own (the entry dynamo leaves alone), so the dynamic graph's sizes are read
    from the model's arguments and each call is counted at its own length."""
    entry = MODELS["gpt"]
    torch.manual_seed(0)
    model = entry.build()
    added = {}
    with ts.apply(model, "quant.int8", seed=0) as handle:
        step = torch.compile(lambda tokens: model(tokens[:, :-1]), backend="aot_eager")
        with warnings.catch_warnings():
            warnings.simplefilter("error", CompileFallbackWarning)
            for i, n in enumerate([16, 12, 8, 10, 8]):
                x, _ = _gpt_at(model, n, i)
                before = handle.tally.stored_bytes
                step(torch.cat([x, x[:, :1]], 1)).float().sum().backward()
                added.setdefault(n, []).append(handle.tally.stored_bytes - before)
        assert handle.graph is not None and any(d.order is not None for d in handle.graph.decisions)
    assert added[8][0] == added[8][1] < added[10][0] < added[12][0] < added[16][0], added


def test_an_attention_kernel_s_operands_are_coded_and_its_log_sum_exp_kept() -> None:
    """SDPA in the graph: ``q``, ``k``, ``v`` and its output coded as values, its log-sum-exp
    (which its backward reads with them) kept exact; gradients near eager's."""
    from torchstash.testing.models import GPT

    torch.manual_seed(0)
    model = GPT(128, 32, 64, 2, 4, sdpa=True)
    x, y = _gpt_at(model, 32, 1)
    with ts.apply(model, "quant.int8", seed=0):
        want = _gpt_step(model, model, x, y)
    with ts.apply(model, "quant.int8", seed=0) as handle:
        got = _gpt_step(torch.compile(model, backend="aot_eager"), model, x, y)
        assert handle.graph is not None
        sdpa = [d for d in handle.graph.decisions if d.site.op == "scaled_dot_product_attention"]
    coded = {d.site.role for d in sdpa if d.compressor is not None}
    kept = [d for d in sdpa if d.compressor is None]
    assert coded == {"input", "arg1", "arg2", "output"}, coded
    assert kept and all("log-sum-exp" in d.reason for d in kept)
    assert cosine(want, got) > 0.999


def test_compile_budget_recomputes_before_the_codes() -> None:
    """``compile_budget=``: inductor's partitioner keeps that share of what stock's compiled
    graph saves (recomputing the cheapest values in backward), the strategy codes the rest;
    gradients stay near eager's. A strategy that runs eagerly under compile refuses it."""
    entry = MODELS["gpt"]
    torch.manual_seed(0)
    model = entry.build()
    x, y = entry.batch(4, torch.device("cpu"))
    raw = {}
    for budget in (None, 0.3):
        torch._dynamo.reset()
        with ts.apply(model, "quant.int8", seed=0, compile_budget=budget) as handle:
            model.zero_grad(set_to_none=True)
            entry.loss(torch.compile(model), x, y).backward()  # type: ignore[arg-type]
            raw[budget] = handle.tally.raw_bytes
            grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    with ts.apply(model, "quant.int8", seed=0):
        model.zero_grad(set_to_none=True)
        entry.loss(model, x, y).backward()  # type: ignore[arg-type]
        eager = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert raw[0.3] < 0.6 * raw[None], raw
    assert cosine(eager, grads) > 0.999
    with pytest.raises(ApplyError, match="compile_budget"):
        ts.apply(model, "quant.int1", compile_budget=0.5)
    with pytest.raises(ApplyError, match="fraction"):
        ts.apply(model, "quant.int8", compile_budget=1.5)


def _stock_eager_compiled(
    entry: ZooEntry, strategy: str, run: Callable[[torch.nn.Module], Callable[..., Any]], **kw: Any
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], float]:
    """Stock's gradients, the eager strategy's, the compiled strategy's (``kw`` given to its
    apply), and its compiled saved bytes over eager's; one batch, one model."""
    torch.manual_seed(0)
    model = entry.build()
    x, y = entry.batch(8, torch.device("cpu"))

    def grads(call: Callable[..., Any]) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        entry.loss(call, x, y).backward()  # type: ignore[arg-type]
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    stock = grads(model)
    with ts.apply(model, strategy, **_options(strategy)) as handle:
        eager, eager_bytes = grads(model), handle.tally.stored_bytes
    with ts.apply(model, strategy, **_options(strategy), **kw) as handle:
        assert handle.graph is not None
        compiled = grads(run(model))
        return stock, eager, compiled, handle.tally.stored_bytes / eager_bytes


BUDGETED = [(s, "gpt") for s in STRATEGIES] + [("quant.int8", "vit"), ("quant.int8", "resnet")]


@pytest.mark.parametrize(("strategy", "model_name"), BUDGETED)
def test_compiled_with_a_budget_keeps_eager_s_accuracy(strategy: str, model_name: str) -> None:
    """Every strategy under ``compile_budget``: in the graph, with gradients as close to
    stock's as eager's (cosine within 0.001) at no more than 1.1x eager's saved bytes, or
    refused by ``apply`` with its compressors' reasons. ``aot_eager_decomp_partition``: the
    partitioner that honours a budget, without code generation."""
    entry = MODELS[model_name]
    applied = ts.apply(entry.build(), strategy)
    compresses = applied.plan.has_compressors
    applied.remove()
    try:
        ts.apply(entry.build(), strategy, compile_budget=0.5).remove()
    except ApplyError as error:
        said = str(error)
        assert "compile_budget" in said and strategy in said, said
        assert "compresses nothing" in said if not compresses else "does not run" in said
        return
    run = _compiled("aot_eager_decomp_partition")
    stock, eager, compiled, ratio = _stock_eager_compiled(entry, strategy, run, compile_budget=0.5)
    assert cosine(stock, compiled) >= cosine(stock, eager) - 1e-3, strategy
    assert ratio <= 1.1, ratio


def test_a_strategy_that_stays_eager_says_why() -> None:
    """``quant.int4``, ``quant.int2`` and ``quant.int1`` run eagerly under compile: the
    warning and the ``fullgraph=True`` error quote the reason, and ``compile_budget`` is
    refused with it."""
    entry = MODELS["gpt"]
    x, y = entry.batch(2, torch.device("cpu"))
    for strategy, options, reason in [
        ("quant.int4", {}, "outside the test zoo"),
        ("quant.int2", {}, "outside the test zoo"),
        ("quant.int1", {}, "at 1 bit"),
    ]:
        torch._dynamo.reset()
        model = entry.build()
        with ts.apply(model, strategy, **options) as handle:
            assert handle.graph is None
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", CompileFallbackWarning)
                entry.loss(torch.compile(model, backend="aot_eager"), x, y)  # type: ignore[arg-type]
            said = [str(w.message) for w in caught if w.category is CompileFallbackWarning]
            assert len(said) == 1 and strategy in said[0] and reason in said[0], said
            assert "runs eagerly" in said[0]
            torch._dynamo.reset()
            with pytest.raises(Exception, match=reason):
                run = torch.compile(model, backend="aot_eager", fullgraph=True)
                entry.loss(run, x, y)  # type: ignore[arg-type]
        with pytest.raises(ApplyError, match=reason):
            ts.apply(entry.build(), strategy, compile_budget=0.5)


def test_an_empty_save_is_kept_with_min_bytes_zero() -> None:
    """``min_bytes=0`` lets every value through to the code; an empty one is kept (its seed
    would read values it does not have)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    with ts.apply(model, "quant.int8", min_bytes=0) as handle:
        x = torch.randn(0, 8)
        torch.compile(model, backend="aot_eager")(x).sum().backward()
        assert handle.graph is not None
        assert any(d.reason == "it is empty" for d in handle.graph.decisions)


class _Broken(torch.nn.Module):
    """Two graphs: a graph break between its layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.fc1(x))
        torch._dynamo.graph_break()
        return self.fc2(torch.tanh(h))  # its output saved (a GELU's is recomputed)


# dynamo reads ``.grad`` of a non-leaf while it traces the frame after the break (stock's too)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_a_dynamic_graph_after_a_graph_break_says_how_it_is_counted() -> None:
    """The graph after a break has sizes of its own, not the model's arguments': its saves
    at new sizes are counted as traced, and one warning says so; the codes still run."""
    torch.manual_seed(0)
    model = _Broken()
    with ts.apply(model, "quant.int8", seed=0) as handle:
        compiled = torch.compile(model, backend="aot_eager")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CompileFallbackWarning)
            warnings.filterwarnings("ignore", "The .grad attribute of a Tensor that is not")
            for n in (4, 6, 8, 10):
                compiled(torch.randn(n, 64)).square().sum().backward()
        said = [str(w.message) for w in caught if issubclass(w.category, CompileFallbackWarning)]
        assert len(said) == 1 and "graph break" in said[0], said
        assert handle.graph is not None and any(d.order is not None for d in handle.graph.decisions)


def test_compile_budget_keeps_what_eager_keeps_exact() -> None:
    """Under ``compile_budget`` a ResNet's ReLU outputs and BatchNorm statistics are saved
    (the partitioner would recompute them from coded values): the ReLU outputs are coded with
    their signs exact, and the gradients stay as near stock's as eager's."""
    entry = MODELS["resnet"]
    torch.manual_seed(0)
    model = entry.build()
    x, y = entry.batch(8, torch.device("cpu"))
    model.zero_grad(set_to_none=True)
    entry.loss(model, x, y).backward()  # type: ignore[arg-type]
    want = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    with ts.apply(model, "quant.int8", seed=0):
        model.zero_grad(set_to_none=True)
        entry.loss(model, x, y).backward()  # type: ignore[arg-type]
        eager = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    with ts.apply(model, "quant.int8", seed=0, compile_budget=0.5) as handle:
        model.zero_grad(set_to_none=True)
        run = torch.compile(model, backend="aot_eager_decomp_partition")  # min-cut, no codegen
        entry.loss(run, x, y).backward()  # type: ignore[arg-type]
        got = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        assert handle.graph is not None
        assert any(d.signs for d in handle.graph.decisions), "no ReLU output saved"
    assert cosine(want, got) > cosine(want, eager) - 1e-3


def test_keep_exact_joins_the_user_s_own_joint_pass() -> None:
    """A user's own ``joint_custom_pass`` still runs under ``compile_budget`` (first), the
    values eager keeps exact are marked after it, and the user's setting is theirs again
    once the call is over."""
    import torch._functorch.config as functorch_config
    from torch.utils.checkpoint import CheckpointPolicy

    from torchstash.graphkeep import KeepExact, with_keep_exact

    seen: list[str] = []

    def mine(module: torch.fx.GraphModule, joint_inputs: Any) -> torch.fx.GraphModule:
        seen.append("mine")
        return module

    marked: list[torch.fx.Node] = []

    def after(module: torch.fx.GraphModule, joint_inputs: Any) -> torch.fx.GraphModule:
        kept = with_keep_exact(mine)(module, joint_inputs)
        marked.extend(
            n for n in kept.graph.nodes if n.meta.get("recompute") is CheckpointPolicy.MUST_SAVE
        )
        return kept

    assert isinstance(with_keep_exact(None), KeepExact)
    assert with_keep_exact(with_keep_exact(mine)).first is mine
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3), nn.Flatten()
    )
    x = torch.randn(4, 3, 12, 12)
    with functorch_config.patch(joint_custom_pass=mine):
        with ts.apply(model, "quant.int8", seed=0, compile_budget=0.5):
            torch.compile(model, backend="aot_eager_decomp_partition")(x).sum().backward()
        assert seen == ["mine"] and functorch_config.joint_custom_pass is mine
    with functorch_config.patch(joint_custom_pass=after):
        torch._dynamo.reset()
        seen.clear()
        with ts.apply(model, "quant.int8", seed=0):  # no budget: the user's pass alone
            torch.compile(model, backend="aot_eager_decomp_partition")(x).sum().backward()
    # the ReLU's mask (its output is recomputed from the BatchNorm's coded input, as
    # eagerly), the decomposed BatchNorm's var_mean and its variance and mean
    assert seen == ["mine"] and len(marked) == 4, marked
    assert {n.target for n in marked} >= {torch.ops.aten.le.Scalar}


class _LayerNorm2d(torch.nn.LayerNorm):
    """timm's ``LayerNorm2d``: a LayerNorm over the channels of ``x.permute(0, 2, 3, 1)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def test_a_value_its_op_reads_permuted_is_coded_as_it_reads_it() -> None:
    """On a channels-last map the LayerNorm's permuted view is contiguous in rows of
    channels: eager codes it so. The graph saves the map itself, (N, C, H, W) in shape, and
    codes it through the same ``permute`` (in rows of W it would be kept exact): the same
    bytes as eager's, gradients as close to stock's."""
    torch.manual_seed(0)
    channels_last = torch.channels_last
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 64, 1), _LayerNorm2d(64), torch.nn.Conv2d(64, 64, 1)
    ).to(memory_format=channels_last)
    x = torch.randn(4, 3, 8, 8).to(memory_format=channels_last)
    stock = copy.deepcopy(model)
    stock(x).square().sum().backward()
    want = [p.grad for p in stock.parameters()]

    def grads(call: Callable[..., Any]) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        call(x).square().sum().backward()
        return [p.grad for p in model.parameters()]  # type: ignore[misc]

    with ts.apply(model, "quant.int8", seed=0) as handle:
        eager = grads(model)
        eager_row = handle.tally.rows["1"]
        assert eager_row.compressed == 1, eager_row
        eager_bytes = eager_row.stored_bytes
    torch._dynamo.reset()
    with ts.apply(model, "quant.int8", seed=0) as handle:
        compiled = grads(torch.compile(model, backend="aot_eager_decomp_partition"))
        assert handle.graph is not None
        (coded,) = [d for d in handle.graph.decisions if d.site.op == "layer_norm" and d.compressor]
        assert coded.permuted == (0, 2, 3, 1)
        assert handle.tally.rows["1"].stored_bytes == eager_bytes
    assert cosine(want, compiled) >= cosine(want, eager) - 1e-3


class _TakesState(torch.nn.Module):
    """A block whose forward is handed trainable state: another layer's weight (a
    Parameter) and a trainable leaf that is not one (a learned scale kept outside a module,
    an input whose gradient is wanted)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(torch.nn.functional.gelu(self.a(x)), w) * scale


def _coded(handle: ts.Handle) -> list[tuple[str, str, str]]:
    assert handle.graph is not None
    return sorted(
        (d.site.module, d.site.op, d.site.role) for d in handle.graph.decisions if d.compressor
    )


@pytest.mark.parametrize("frozen", [False, True])
def test_a_parameter_s_autocast_copy_is_kept_as_eager_keeps_it(frozen: bool) -> None:
    """Under bf16 autocast a Linear saves its weight's bf16 copy (transposed) for the input's
    gradient. Eager keeps a parameter's copy as it is (``engine/params.py``); the graph had
    coded it at 8 bits, every input gradient then computed with a rounded weight."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    model[2].requires_grad_(not frozen)
    x = torch.randn(8, 64)
    with ts.apply(model, "quant.int8", seed=0, min_bytes=0) as handle:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
        y.float().square().sum().backward()
        assert _coded(handle) == [("0", "linear", "input"), ("1", "gelu", "input")]


def test_trainable_state_passed_as_an_argument_is_kept_as_eager_keeps_it() -> None:
    """A Parameter and a trainable leaf handed to a compiled forward: ``no_static`` hooks
    every graph input but the static ones, so the graph had coded the trainable leaf (the
    product's second operand), which eager keeps as it is."""
    torch.manual_seed(0)
    model, other = _TakesState(), torch.nn.Linear(64, 64)
    scale = torch.randn(8, 64, requires_grad=True)
    x = torch.randn(8, 64)
    with ts.apply(model, "quant.int8", seed=0, min_bytes=0) as handle:
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        compiled(x, other.weight, scale).square().sum().backward()
        assert _coded(handle) == [
            ("", "gelu", "input"),
            ("", "mul", "input"),
            ("a", "linear", "input"),
        ]
    assert scale.grad is not None and other.weight.grad is not None


def test_a_torch_that_hides_the_static_inputs_is_said_not_silent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Which inputs are static is read from the function tracing the hooks; where a torch
    traces them elsewhere, a frozen parameter's copy would be coded: one warning says so."""
    from torchstash import graphsite

    monkeypatch.setattr(graphsite, "_HOOK_TRACER", "no_such_function")
    monkeypatch.setattr(graphsite, "_UNSEEN", [])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    model[2].requires_grad_(False)
    with (
        ts.apply(model, "quant.int8", seed=0, min_bytes=0),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always", CompileFallbackWarning)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = torch.compile(model, backend="aot_eager", fullgraph=True)(torch.randn(8, 64))
        y.float().square().sum().backward()
    said = [str(w.message) for w in caught if issubclass(w.category, CompileFallbackWarning)]
    assert sum("frozen parameter's copy" in m for m in said) == 1, said
