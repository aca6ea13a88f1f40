"""``python -m torchstash_bench.speed``: its rows and its command line (never its times)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from torchstash_bench import speed


def test_rows_relate_each_method_to_stock() -> None:
    entry = next(m for m in speed.MODELS if m.name == "mlp-host")
    rows, profiles = speed.measure_model(
        entry,
        ["none", "empty-hooks", "checkpoint"],
        torch.device("cpu"),
        warmup=3,
        steps=3,
        profile=2,
    )
    by = {r["method"]: r for r in rows}
    assert set(by) == {"stock", "none", "empty-hooks", "checkpoint"}
    assert by["stock"]["ratio"] == pytest.approx(1.0)
    assert by["stock"]["mean_ratio"] == pytest.approx(1.0)
    assert all(r["mean_ratio"] > 0 for r in rows)
    assert by["none"]["saves"] == 197  # 65 linears (input, weight), 64 GELUs, the loss (3)
    assert by["none"]["held_share"] == pytest.approx(1.0)
    assert by["none"]["engine_us_per_saved"] > 0  # the engine's hooks ran
    assert by["checkpoint"]["engine_us_per_saved"] is None  # torch's own method
    assert by["checkpoint"]["held_share"] is not None
    # the floor under the engine's hooks: stock's bytes, no engine
    assert by["empty-hooks"]["held_share"] == pytest.approx(1.0)
    assert by["empty-hooks"]["engine_us_per_saved"] is None
    assert list(profiles) == ["mlp-host none"]
    # the Python a step enters, counted: the engine's module entries and hooks add to stock's
    assert by["stock"]["python_calls"] > 0
    assert by["none"]["python_calls"] > by["stock"]["python_calls"]
    assert by["empty-hooks"]["python_calls"] > by["stock"]["python_calls"]  # a pack, an unpack


def test_python_calls_counts_the_functions_a_step_enters() -> None:
    import sys

    def inner(k: int) -> int:
        return k + 1

    def gen():  # type: ignore[no-untyped-def]
        yield 1
        yield 2

    def step() -> None:
        for k in range(5):
            inner(k)
        list(gen())  # entered once, resumed twice more

    before = sys.getprofile()
    assert speed.python_calls(step) == 1 + 5 + 3
    assert sys.getprofile() is before  # the profile function is given back


def test_cold_call_us_times_a_call_both_ways() -> None:
    warm, cold = speed.cold_call_us(repeat=5, evict_bytes=1 << 20)
    assert 0 < warm < 1e5 and 0 < cold < 1e5


def test_the_command_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "speed.json"
    argv = ["--models", "mlp-host", "--strategies", "none", "--steps", "2", "--warmup", "2"]
    assert speed.main([*argv, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["method"] for r in rows] == ["stock", "none"]


def test_each_model_is_written_when_it_is_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run cut short (a GPU check's time cap) keeps the models it finished: the JSON holds
    the first model's rows before the second starts."""
    out = tmp_path / "speed.json"
    seen: list[list[str]] = []
    measure = speed.measure_model

    def spy(entry: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append([r["model"] for r in json.loads(out.read_text())] if out.exists() else [])
        return measure(entry, *args, **kwargs)

    monkeypatch.setattr(speed, "measure_model", spy)
    argv = ["--models", "mlp-host,cnn-small", "--strategies", "none", "--steps", "2"]
    assert speed.main([*argv, "--warmup", "1", "--json", str(out)]) == 0
    assert seen == [[], ["mlp-host", "mlp-host"]]


def test_an_unknown_model_is_refused() -> None:
    assert speed.main(["--models", "nope"]) == 2


def test_a_failed_row_shows_its_text_not_markup() -> None:
    """An error quotes brackets (a shape, a type): the table prints them as they are."""
    from rich.console import Console

    from torchstash_bench.common import key, rows_table

    columns = [("model", key("model")), ("method", key("method")), ("ms", key("ms"))]
    rows = [{"model": "m", "method": "x", "ms": None, "error": "shape [bold]4[/bold] of [2, 3]"}]
    console = Console(record=True, width=200)
    console.print(rows_table("t", columns, rows, failed="error"))
    assert "shape [bold]4[/bold] of [2, 3]" in console.export_text()
