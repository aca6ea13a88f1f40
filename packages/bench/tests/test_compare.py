"""``torchstash bench --compare`` at tiny scale: every method's row is sane, the memory count
sees what each method really keeps, the exact methods train exactly like stock, and a method
that fails gives a row with the reason instead of stopping the run."""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

import torchstash
from torchstash.testing.models import zoo
from torchstash.testing.toys import HalfCompressor
from torchstash_bench import commands, common, compare, compare_methods, compare_report
from torchstash_bench.compare_methods import CHECKPOINT, COMPILE, SAC, SAVE_ON_CPU
from torchstash_bench.demo_task import DemoConfig

HALF, CRASH = "comparetest.half", "comparetest.crash"
EXACT = (CHECKPOINT, SAC, SAVE_ON_CPU)
MODELS = {e.name: e for e in zoo("tiny")}
CPU = torch.device("cpu")


class _Crash(HalfCompressor):
    """bf16 until armed, then fails on every tensor it is given (inside a training step)."""

    name = CRASH
    armed = True

    def compress(self, x: torch.Tensor, site: Any) -> Any:
        if _Crash.armed:
            raise RuntimeError("crashed on purpose")
        return super().compress(x, site)


@pytest.fixture
def crash(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    torchstash.REGISTRY.register(CRASH, _Crash, lossless=False, summary="crashes (test)")
    monkeypatch.setattr(_Crash, "armed", True)
    try:
        yield CRASH
    finally:
        torchstash.REGISTRY.unregister(CRASH)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One thread, as run_compare takes on a 2-core machine: OpenMP threads spanning every
    core of a busy machine can stall (see common.cpu_threads)."""
    with common.num_threads(1):
        yield


def _quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


@pytest.fixture(scope="module")
def half() -> Iterator[str]:
    torchstash.REGISTRY.register(HALF, HalfCompressor, lossless=False, summary="bf16 (test)")
    try:
        yield HALF
    finally:
        torchstash.REGISTRY.unregister(HALF)


@pytest.fixture(scope="module")
def result(half: str) -> compare_report.CompareResult:
    """Every model, the exact alternatives, ``none`` and a lossy toy strategy; no demo."""
    return compare.run_compare(
        scale="tiny",
        names=[*EXACT, "none", half],
        device="cpu",
        repeat=2,
        demo_steps=0,
        console=_quiet(),
    )


def _row(result: compare_report.CompareResult, model: str, method: str) -> dict[str, Any]:
    return next(r for r in result.rows if r["model"] == model and r["method"] == method)


def test_every_row_is_sane(result: compare_report.CompareResult) -> None:
    names = ["stock", *EXACT, "none", HALF]
    assert [r["method"] for r in result.rows] == names * 3
    assert [r["model"] for r in result.rows[:: len(names)]] == ["gpt", "vit", "resnet"]
    for r in result.rows:
        assert r["error"] is None, r
        assert r["saved_bytes"] > 0 and r["host_bytes"] == 0 and r["cuda_peak_mb"] is None
        assert 0 < r["vs_stock"] <= 1.0
        assert r["step_ms"] > 0 and len(r["step_times_ms"]) == 2 and r["time_ratio"] > 0
        assert 0.0 <= r["grad_error"] < 0.1
    for model in MODELS:
        stock = _row(result, model, "stock")
        assert stock["vs_stock"] == 1.0 and stock["time_ratio"] == 1.0
        assert _row(result, model, HALF)["vs_stock"] < 0.75  # bf16 copies of fp32 tensors


def test_checkpoint_saves_less_than_stock(result: compare_report.CompareResult) -> None:
    for model in ("gpt", "vit"):  # checkpoint keeps block inputs, SAC also matmul outputs
        stock, ckpt, sac = (_row(result, model, m)["saved_bytes"] for m in ("stock", *EXACT[:2]))
        assert ckpt < 0.25 * stock and ckpt < sac < stock
    assert _row(result, "resnet", CHECKPOINT)["vs_stock"] < 0.8


def test_stock_count_is_the_tally_of_none(result: compare_report.CompareResult) -> None:
    """The hook count and torchstash's tally agree on stock: both count storages, so a saved
    view (the GPT's token batch, the ViT's class token) counts the whole storage it keeps
    alive, in both. ``none`` (the identity) is therefore exactly stock."""
    for model in MODELS:
        stock, none = _row(result, model, "stock"), _row(result, model, "none")
        assert none["saved_bytes"] == stock["tally_bytes"] and none["vs_stock"] == 1.0
        assert stock["saved_bytes"] == stock["tally_bytes"], model


def test_exact_methods_give_stock_gradients(result: compare_report.CompareResult) -> None:
    for model in MODELS:
        for name in EXACT:
            assert _row(result, model, name)["grad_error"] == 0.0
    # and directly, bit for bit, on the GPT and the ResNet (BatchNorm, in-place ReLU)
    for model in ("gpt", "resnet"):
        methods = {m.name: m for m in compare_methods.methods(list(EXACT))}
        _, ref = compare.measure_method(MODELS[model], methods["stock"], CPU, 1)
        assert ref is not None
        for name in EXACT:
            row, grads = compare.measure_method(MODELS[model], methods[name], CPU, 1)
            assert grads is not None and row["error"] is None
            assert all(torch.equal(g, r) for g, r in zip(grads, ref, strict=True)), name


def test_checkpoint_with_a_strategy_codes_the_block_inputs(half: str) -> None:
    """``checkpoint+<strategy>``: reentrant checkpointing keeps the block inputs through
    ``save_for_backward``, where the strategy codes them (bf16 here: half checkpoint's bytes
    on the transformers), and the gradients stay close to stock's."""
    combo = f"{CHECKPOINT}+{half}"
    res = compare.run_compare(
        scale="tiny",
        names=[CHECKPOINT, combo],
        device="cpu",
        repeat=1,
        demo_steps=0,
        console=_quiet(),
    )
    for model in ("gpt", "vit"):
        ckpt, both = _row(res, model, CHECKPOINT), _row(res, model, combo)
        assert both["error"] is None and both["grad_error"] < 0.01, both
        assert both["saved_bytes"] <= 0.55 * ckpt["saved_bytes"], (both, ckpt)


def test_the_count_sees_checkpointed_block_inputs() -> None:
    """Non-reentrant checkpointing keeps each block's input through autograd: the hook sees
    exactly those (and what is saved outside the blocks)."""
    entry = MODELS["gpt"]
    torch.manual_seed(0)
    model = entry.build()
    x, _ = entry.batch(entry.batch_size, CPU)
    inputs: list[torch.Tensor] = []
    with compare_methods.Checkpointed(model) as att:
        for blk in att.blocks:
            blk.register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
        counter = compare_methods.HeldCounter(model, CPU)
        att.forward(x, counter)
    keys = {compare_methods._storage_key(t) for t in inputs}
    assert len(keys) == len(att.blocks) == 2 and keys <= set(counter.held)
    assert "forward" not in vars(att.blocks[0])  # removed on exit


def test_sac_counts_its_cache() -> None:
    """Selective checkpointing keeps matmul outputs in its own cache, not through autograd."""
    entry = MODELS["gpt"]
    torch.manual_seed(0)
    model = entry.build()
    x, _ = entry.batch(entry.batch_size, CPU)
    with compare_methods.Checkpointed(model, selective=True) as att:
        counter = compare_methods.HeldCounter(model, CPU)
        att.forward(x, counter)
        caches = list(att.caches)
    cached = [t for mode in caches for t in compare_methods._cached_tensors(mode.storage)]
    # per block: qkv, q@k, att@v, proj, mlp.0 and mlp.2 outputs
    assert len(caches) == 2 and len(cached) == 12
    assert {compare_methods._storage_key(t) for t in cached} <= set(counter.held)


def test_a_failing_method_gives_a_row_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, crash: str
) -> None:
    def no_compiler(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(torch, "compile", no_compiler)
    console = _quiet()
    out = compare.run_compare(
        ["gpt"], "tiny", [COMPILE, crash, CHECKPOINT], "cpu", 1, 2, console=console
    )
    failed = _row(out, "gpt", COMPILE)
    assert failed["error"] == "RuntimeError: no C++ compiler here" and failed["saved_mb"] is None
    crashed = _row(out, "gpt", crash)  # fails inside the forward, not when attached
    assert "crashed on purpose" in crashed["error"] and crashed["step_ms"] is None
    assert _row(out, "gpt", CHECKPOINT)["error"] is None  # measured after the failures
    demo = {d["method"]: d for d in out.demo}
    assert demo[COMPILE]["error"] and demo[COMPILE]["train_loss"] is None
    assert demo[CHECKPOINT]["error"] is None
    notes = compare_report.compare_notes(out)
    assert "compile-budget (gpt, demo): failed: RuntimeError: no C++ compiler here" in notes
    console.print(compare_report.compare_table(out))
    assert "failed" in console.file.getvalue()  # type: ignore[attr-defined]
    assert "| compile-budget | failed | - | failed | - |" in compare_report.markdown_table(out)


def test_a_failure_while_timed_ends_that_trial_only(crash: str) -> None:
    entry = MODELS["gpt"]
    _Crash.armed = False
    trial = compare.Trial(entry, compare_methods.methods([crash])[1], CPU)
    stock = compare.Trial(entry, compare_methods.methods([])[0], CPU)
    assert trial.alive and trial.row["error"] is None and trial.row["saved_bytes"]
    _Crash.armed = True
    for t in (trial, stock):
        t.step()
    assert not trial.alive and "crashed on purpose" in trial.row["error"]
    assert trial.close()["step_ms"] is None
    assert stock.alive and stock.close()["step_ms"] > 0 and not stock.alive


def test_demo_trains_exact_methods_like_stock() -> None:
    out = compare.run_compare(
        ["gpt"],
        "tiny",
        list(EXACT),
        "cpu",
        repeat=1,
        demo_steps=3,
        console=_quiet(),
        demo_config=DemoConfig.quick(),
    )
    demo = {d["method"]: d for d in out.demo}
    assert list(demo) == ["stock", *EXACT]
    stock = demo["stock"]
    assert len(stock["losses"]) == 3 and stock["train_loss"] > 0 and stock["val_loss"] > 0
    for name in EXACT:  # same weights, same batches, exact gradients: the same training
        assert demo[name]["losses"] == stock["losses"]
        assert demo[name]["val_loss"] == stock["val_loss"] and demo[name]["delta_val_pct"] == 0


def test_pareto_front() -> None:
    points = [(1.0, 10.0), (1.5, 4.0), (1.2, 12.0), (2.0, 5.0), (3.0, 1.0), (1.5, 6.0)]
    assert compare_report.pareto_front(points) == [(1.0, 10.0), (1.5, 4.0), (3.0, 1.0)]
    assert compare_report.pareto_front([]) == []


def test_plot_is_written(result: compare_report.CompareResult, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = compare_report.save_plot(result, tmp_path / "sub" / "compare.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--compare", "--scale", "tiny", "--models", "vit", "--strategies", CHECKPOINT]
    assert commands.main([*argv, "--repeat", "1", "--demo-steps", "0", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in data["rows"]] == ["stock", CHECKPOINT]
    assert data["demo"] == [] and data["scale"] == "tiny" and data["repeat"] == 1
    path = tmp_path / "out.json"
    plot = tmp_path / "out.png"
    assert (
        commands.main([*argv, "--demo-steps", "0", "--json", str(path), "--plot", str(plot)]) == 0
    )
    text = capsys.readouterr().out
    assert "torchstash bench --compare" in text
    assert json.loads(path.read_text())["repeat"] == 5
    table = compare_report.markdown_table(compare.from_json(path))
    assert table.splitlines()[0] == "| method | vit saved MB | vit time |"
    assert plot.exists() == (importlib.util.find_spec("matplotlib") is not None)
    if not plot.exists():
        assert "no plot: pip install torchstash[plot]" in text
    with pytest.raises(SystemExit):
        commands.main(["--plot", str(plot)])  # --plot belongs to --compare
    assert commands.main(["--compare", "--models", "gpt,bert", "--demo-steps", "0"]) == 2
    assert "unknown models ['bert']" in capsys.readouterr().out


def test_importing_compare_loads_no_plugin_and_no_matplotlib() -> None:
    code = (
        "import sys, torchstash_bench.compare; "
        "print([m for m in sys.modules if m.startswith(('torchstash_', 'matplotlib')) "
        "and not m.startswith('torchstash_bench')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_the_count_sees_the_compiled_graphs_saves() -> None:
    """torch.compile's saved tensors pass through the same hook; the budget makes it keep
    about half of what the unbudgeted graph keeps (slow: inductor compiles C++)."""
    entry = MODELS["gpt"]
    method = compare_methods.methods([COMPILE])[1]
    row, grads = compare.measure_method(entry, method, CPU, 1)
    stock, _ = compare.measure_method(entry, compare_methods.methods([])[0], CPU, 1)
    assert row["error"] is None and grads is not None
    assert 0.3 < row["saved_bytes"] / stock["saved_bytes"] < 0.7


def test_a_compiled_strategy_s_row_counts_what_its_graph_saves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``compiled+quant.int8``: the codes run in the graph (the row says so), its saved bytes
    are the graph's, within 10% of eager ``quant.int8``'s, its gradients as close to stock's."""
    pytest.importorskip("torchstash_quant")
    monkeypatch.setattr(compare_methods.CompiledStash, "backend", "aot_eager_decomp_partition")
    entry = MODELS["gpt"]
    todo = compare_methods.methods(["quant.int8", "compiled+quant.int8"])
    stock, eager, compiled = compare.measure_methods(entry, todo, CPU, 1)
    assert compiled.row["error"] is None and compiled.row["in_graph"] is True, compiled.row
    assert eager.row["in_graph"] is None and compiled.row["compressed"] > 0
    assert 0.9 < compiled.row["saved_bytes"] / eager.row["saved_bytes"] < 1.1
    error = {t.method.name: compare.grad_error(t.grads, stock.grads) for t in (eager, compiled)}
    assert error["compiled+quant.int8"] < error["quant.int8"] + 1e-3, error


def test_a_compile_budget_leaves_the_other_compiled_rows_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The methods of a model are attached side by side; ``compile-budget``'s budget is set
    around its own calls only. Held while it was attached, it had compiled the
    ``compiled+quant.int8`` graph with the budget too (half of eager int8's bytes)."""
    pytest.importorskip("torchstash_quant")
    quick = "aot_eager_decomp_partition"  # the min-cut partitioner, which reads the budget
    monkeypatch.setattr(compare_methods.CompiledStash, "backend", quick)
    monkeypatch.setattr(compare_methods.Compiled, "backend", quick)
    entry = MODELS["gpt"]
    todo = compare_methods.methods(["quant.int8", COMPILE, "compiled+quant.int8"])
    stock, eager, budget, compiled = compare.measure_methods(entry, todo, CPU, 1)
    assert budget.row["error"] is None and compiled.row["error"] is None
    assert 0.3 < budget.row["saved_bytes"] / stock.row["saved_bytes"] < 0.7
    assert 0.9 < compiled.row["saved_bytes"] / eager.row["saved_bytes"] < 1.1
